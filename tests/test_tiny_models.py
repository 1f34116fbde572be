"""Tiny presets of every arch: build, reload as a real checkpoint, forward a padded image batch."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from mmprm.models import (
    TINY_ARCHS,
    add_step_token,
    build_tiny_model,
    is_multimodal,
    load_backbone,
    load_processor,
    vision_tower_parameters,
)
from mmprm.models.tiny import cli_tiny_model
from mmprm.steps import STEP_TOKEN, build_messages

VLM_ARCHS = [a for a in TINY_ARCHS if a != "qwen2"]
MODEL_CLASS = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "internvl": "InternVLForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration",
    "qwen2": "Qwen2ForCausalLM",
}
# The image token each processor expands, as the arch's tokenizer names it.
IMAGE_TOKEN = {
    "qwen2_vl": "<|image_pad|>",
    "qwen2_5_vl": "<|image_pad|>",
    "internvl": "<IMG_CONTEXT>",
    "llava": "<image>",
}


def _has_torchvision() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchvision") is not None


def _tokenizer(processor):
    return getattr(processor, "tokenizer", processor)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_reloads_as_real_checkpoint(tiny_models, arch):
    model, processor = load_backbone(tiny_models(arch))
    assert type(model).__name__ == MODEL_CLASS[arch]
    text = model.config.get_text_config()
    assert text.hidden_size == 64 and text.num_hidden_layers == 2
    tok = _tokenizer(processor)
    assert 1000 <= len(tok) <= 2048
    assert text.vocab_size == len(tok) == model.get_input_embeddings().weight.shape[0]
    # Special-token ids in the config are the tiny vocab's, not the real model's 150k ids.
    assert text.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert text.pad_token_id == tok.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    assert model.generation_config.pad_token_id == tok.pad_token_id
    assert STEP_TOKEN not in tok.get_vocab(), "the step token is add_step_token's job, not the preset's"
    if arch in IMAGE_TOKEN:
        assert model.config.image_token_id == tok.convert_tokens_to_ids(IMAGE_TOKEN[arch])
    if arch in ("qwen2_vl", "qwen2_5_vl"):
        assert model.config.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
        assert model.config.vision_end_token_id == tok.convert_tokens_to_ids("<|vision_end|>")
        assert model.config.video_token_id == tok.convert_tokens_to_ids("<|video_pad|>")
        # M-RoPE sections must cover head_dim / 2 = 64 / 4 / 2 rotary frequencies.
        assert sum(text.rope_parameters["mrope_section"]) == text.hidden_size // text.num_attention_heads // 2
    if arch == "internvl":
        assert processor.start_image_token_id == tok.convert_tokens_to_ids("<img>")
        assert processor.end_image_token_id == tok.convert_tokens_to_ids("</img>")


@pytest.mark.parametrize("arch", VLM_ARCHS)
def test_saved_processor_names_upstream_class_and_pil_backend(tiny_models, arch):
    path = tiny_models(arch)
    saved = json.loads((path / "processor_config.json").read_text())
    assert not saved["processor_class"].endswith("ImageOnlyProcessor")
    processor = load_processor(path)
    assert not hasattr(processor, "video_processor")
    # torchvision is absent here, so only the PIL backend can work; on a GPU box either may load.
    assert type(processor.image_processor).__name__.endswith("Pil") or _has_torchvision()


@pytest.mark.parametrize("arch", ["qwen2_vl", "internvl"])
def test_processor_only_directory_loads_image_only(tiny_models, tmp_path, arch):
    # A directory holding only the processor (no config.json) still skips the video processor.
    load_processor(tiny_models(arch)).save_pretrained(tmp_path)
    assert not (tmp_path / "config.json").exists()
    processor = load_processor(tmp_path)
    assert type(processor).__name__.endswith("ImageOnlyProcessor")


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_same_seed_same_weights(tiny_models, tmp_path, arch):
    again = build_tiny_model(arch, tmp_path / "again", seed=0)
    other = build_tiny_model(arch, tmp_path / "other", seed=1)
    ref = load_file(tiny_models(arch) / "model.safetensors")
    same, diff = load_file(again / "model.safetensors"), load_file(other / "model.safetensors")
    assert ref.keys() == same.keys() == diff.keys()
    assert all(torch.equal(ref[k], same[k]) for k in ref)
    assert not all(torch.equal(ref[k], diff[k]) for k in ref)
    # The tokenizer is trained, so training must be deterministic too.
    assert (again / "tokenizer.json").read_bytes() == (tiny_models(arch) / "tokenizer.json").read_bytes()


def test_build_leaves_caller_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model("qwen2", tmp_path / "m", seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_unknown_arch_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny arch 'gpt5'.*qwen2_vl"):
        build_tiny_model("gpt5", tmp_path)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tokenizer_takes_any_text(tiny_models, arch):
    tok = _tokenizer(load_processor(tiny_models(arch)))
    text = "Ünïcode 日本語 🙂 \x00\x7f tabs\t\tand\r\nCRLF; <step>3 × 4 = 12</step> <answer>12</answer>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.convert_tokens_to_ids("<|endoftext|>") not in ids  # Qwen2Tokenizer's unk: nothing unknown
    assert tok.decode(ids) == text
    # Chat markers are single special tokens, never split into bytes.
    for marker in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert tok(marker, add_special_tokens=False)["input_ids"] == [tok.convert_tokens_to_ids(marker)]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_chat_template(tiny_models, arch):
    processor = load_processor(tiny_models(arch))
    text_only = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    assert processor.apply_chat_template(text_only, tokenize=False) == (
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
    )
    prompt = processor.apply_chat_template(
        build_messages("2+2?", 0, system="Be brief."), add_generation_prompt=True, tokenize=False
    )
    assert (
        prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    partial = build_messages("2+2?", 0, assistant="<step>2 + 2 = 4.</step>\n")
    cont = processor.apply_chat_template(partial, continue_final_message=True, tokenize=False)
    assert cont == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<step>2 + 2 = 4.</step>\n"
    with_image = build_messages("Count <image1>.", 1)
    if arch == "qwen2":
        with pytest.raises(Exception, match="text-only"):
            processor.apply_chat_template(with_image, tokenize=False)
    else:
        rendered = processor.apply_chat_template(with_image, tokenize=False)
        assert rendered.count(IMAGE_TOKEN[arch]) == 1
        assert rendered.index("Count ") < rendered.index(IMAGE_TOKEN[arch]) < rendered.index(".<|im_end|>")


def _prompts(processor, questions: list[str]) -> list[str]:
    return [
        processor.apply_chat_template(build_messages(q, 1), add_generation_prompt=True, tokenize=False)
        for q in questions
    ]


@pytest.mark.parametrize("arch", VLM_ARCHS)
@pytest.mark.parametrize("side", ["left", "right"])
def test_forward_padded_batch_of_two_image_sizes(tiny_models, mathv_images, arch, side):
    model, processor = load_backbone(tiny_models(arch))
    model.eval()
    images = mathv_images(["4", "7"])  # 56x53 and 56x28 after thumbnail: different sizes
    assert images[0].size != images[1].size
    texts = _prompts(
        processor,
        ["How many different digits can you find in <image1>?", "How many bricks are missing in the wall? <image1>"],
    )
    batch = processor(text=texts, images=images, padding=True, padding_side=side, return_tensors="pt")
    assert batch["input_ids"].shape[0] == 2
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (*batch["input_ids"].shape, len(_tokenizer(processor)))
    assert torch.isfinite(logits).all()

    # Padding must not change an example's logits: compare each row with that example alone.
    image_id = model.config.image_token_id
    counts = (batch["input_ids"] == image_id).sum(dim=1)
    if arch != "llava":  # LLaVA center-crops every image to one size; the others keep aspect
        assert counts[0] != counts[1]
    for i in range(2):
        single = processor(text=[texts[i]], images=[images[i]], return_tensors="pt")
        with torch.no_grad():
            alone = model(**single).logits[0]
        mask = batch["attention_mask"][i].bool()
        assert torch.allclose(logits[i][mask], alone, atol=1e-4), f"{arch}: row {i} changed by {side} padding"


def test_text_only_forward_padded(tiny_models):
    model, tok = load_backbone(tiny_models("qwen2"))
    texts = _prompts_text(tok, ["1+1?", "What is 12 times 12, written in words?"])
    batch = tok(texts, padding=True, padding_side="left", return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (*batch["input_ids"].shape, len(tok)) and torch.isfinite(logits).all()


def _prompts_text(tok, questions: list[str]) -> list[str]:
    return [
        tok.apply_chat_template(build_messages(q, 0), add_generation_prompt=True, tokenize=False) for q in questions
    ]


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2"])
def test_load_backbone_dtype(tiny_models, arch):
    model, _ = load_backbone(tiny_models(arch), dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_add_step_token_is_special_idempotent_and_saved(tiny_models, tmp_path, arch):
    model, processor = load_backbone(tiny_models(arch))
    tok = _tokenizer(processor)
    before = len(tok)
    old_rows = model.get_input_embeddings().weight.detach().clone()
    step_id = add_step_token(processor, model)
    assert step_id == before and len(tok) == before + 1
    assert model.get_input_embeddings().weight.shape[0] == before + 1
    assert model.get_output_embeddings().weight.shape[0] == before + 1
    assert torch.equal(model.get_input_embeddings().weight[:before], old_rows)  # old rows untouched
    assert add_step_token(processor, model) == step_id and len(tok) == before + 1  # idempotent
    assert model.get_input_embeddings().weight.shape[0] == before + 1
    # Special: one id even when glued to text, never normalized or split.
    assert tok("x=2." + STEP_TOKEN + "\nNext", add_special_tokens=False)["input_ids"].count(step_id) == 1
    assert step_id in tok.all_special_ids
    # The token survives save/reload of processor and model, with the same id.
    processor.save_pretrained(tmp_path)
    model.save_pretrained(tmp_path)
    reloaded_model, reloaded = load_backbone(tmp_path)
    assert _tokenizer(reloaded).convert_tokens_to_ids(STEP_TOKEN) == step_id
    assert add_step_token(reloaded, reloaded_model) == step_id
    assert reloaded_model.get_input_embeddings().weight.shape[0] == before + 1


def test_add_step_token_keeps_spare_rows(tiny_models):
    # Real checkpoints pad the embedding matrix (Qwen2-VL: 151k tokens, 152k rows): no resize.
    model, processor = load_backbone(tiny_models("qwen2"))
    model.resize_token_embeddings(len(processor) + 63)
    rows = model.get_input_embeddings().weight.shape[0]
    assert add_step_token(processor, model) == len(processor) - 1
    assert model.get_input_embeddings().weight.shape[0] == rows


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_vision_tower_parameters(tiny_models, arch):
    model, _ = load_backbone(tiny_models(arch))
    params = vision_tower_parameters(model)
    names = {id(p): n for n, p in model.named_parameters()}
    if arch == "qwen2":
        assert params == [] and not is_multimodal(model)
        return
    assert is_multimodal(model) and is_multimodal(model.config) and is_multimodal(tiny_models(arch))
    picked = [names[id(p)] for p in params]
    assert picked and all(("visual." in n or "vision_tower." in n) for n in picked)
    assert not any("merger" in n or "multi_modal_projector" in n for n in picked)
    # Everything not picked is the language model or the projector.
    rest = [n for n in names.values() if n not in picked]
    assert all("visual." not in n or "merger" in n for n in rest)
    assert all("vision_tower." not in n for n in rest)
    assert any("merger" in n or "multi_modal_projector" in n for n in rest)


def test_cli_tiny_model(tmp_path, capsys):
    assert cli_tiny_model(["--arch", "qwen2", "--out", str(tmp_path / "m"), "--seed", "3"]) == 0
    assert "qwen2" in capsys.readouterr().out
    model, _ = load_backbone(tmp_path / "m")
    assert type(model).__name__ == "Qwen2ForCausalLM"
    with pytest.raises(SystemExit):
        cli_tiny_model(["--arch", "nope", "--out", str(tmp_path / "x")])


def test_image_processors_are_small(tiny_models):
    # Large images become a handful of tokens, so CPU tests stay fast.
    big = Image.new("RGB", (1200, 800), "white")
    for arch in VLM_ARCHS:
        processor = load_processor(tiny_models(arch))
        text = _prompts(processor, ["Describe <image1>."])
        batch = processor(text=text, images=[big], return_tensors="pt")
        assert (batch["input_ids"] == _tokenizer(processor).convert_tokens_to_ids(IMAGE_TOKEN[arch])).sum() <= 20


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_head_dim_64_for_vllm_forwards(tmp_path, arch):
    # vLLM's attention kernels refuse 16-dim heads; the vLLM tier builds every preset at 64.
    model, processor = load_backbone(build_tiny_model(arch, tmp_path / arch, head_dim=64, hidden_size=128))
    text = model.config.get_text_config()
    assert (text.head_dim, text.num_attention_heads, text.hidden_size) == (64, 2, 128)
    if arch.startswith("qwen2_"):  # M-RoPE sections must cover head_dim / 2 rotary pairs
        assert sum(text.rope_parameters["mrope_section"]) == 32
    if arch == "qwen2":
        batch = processor(_prompts_text(processor, ["1+1?"]), return_tensors="pt")
    else:
        batch = processor(
            text=_prompts(processor, ["How many digits in <image1>?"]),
            images=[Image.new("RGB", (56, 42), "teal")],
            return_tensors="pt",
        )
    with torch.no_grad():
        assert torch.isfinite(model(**batch).logits).all()


def test_head_dim_and_vllm_variant_errors(tmp_path, capsys):
    with pytest.raises(ValueError, match="head_dim=24: use a multiple of 16"):
        build_tiny_model("qwen2", tmp_path / "a", head_dim=24)
    with pytest.raises(ValueError, match="hidden_size=96: use a positive multiple of head_dim=64"):
        build_tiny_model("qwen2", tmp_path / "b", hidden_size=96, head_dim=64)
    if not _has_torchvision():
        with pytest.raises(ValueError, match="video processor, which needs torchvision"):
            build_tiny_model("qwen2_vl", tmp_path / "c", head_dim=64, vllm_ready=True)
    # text-only: nothing to add, so the vLLM variant builds anywhere
    assert cli_tiny_model(["--arch", "qwen2", "--out", str(tmp_path / "d"), "--vllm"]) == 0
    assert json.loads((tmp_path / "d" / "config.json").read_text())["head_dim"] == 64


def test_tokenizer_trained_on_a_task_corpus_holds_its_words_whole(tmp_path, capsys):
    from mmprm.data.schema import write_jsonl
    from mmprm.models.tiny import corpus_text

    rows = [
        {"question": "Add up the tiles one by one.", "steps": [f"Tile {i} is {i}. Total {i}."], "answer": str(i)}
        for i in range(300)
    ]
    write_jsonl(tmp_path / "train.jsonl", rows)
    assert corpus_text(tmp_path / "train.jsonl")[:2] == [
        "Add up the tiles one by one.",
        "<step>Tile 0 is 0. Total 0.</step>\n<answer>0</answer>",
    ]
    assert (
        cli_tiny_model(["--arch", "qwen2", "--out", str(tmp_path / "m"), "--corpus", str(tmp_path / "train.jsonl")])
        == 0
    )
    plain = _tokenizer(load_processor(build_tiny_model("qwen2", tmp_path / "plain")))
    fitted = _tokenizer(load_processor(tmp_path / "m"))
    text = "Tile 3 is 7. Total 8 + 7 = 15."
    assert len(fitted.tokenize(" Total")) == 1 and len(plain.tokenize(" Total")) > 1
    assert len(fitted(text)["input_ids"]) < len(plain(text)["input_ids"])
    assert fitted.decode(fitted(text)["input_ids"]) == text  # still byte-level: any text round-trips

    (tmp_path / "bad.jsonl").write_text('{"question": "ok"}\nnot json\n')
    with pytest.raises(SystemExit):
        cli_tiny_model(["--arch", "qwen2", "--out", str(tmp_path / "x"), "--corpus", str(tmp_path / "bad.jsonl")])
    assert "bad.jsonl:2: invalid JSON" in capsys.readouterr().err
    with pytest.raises(ValueError, match="either a tokenizer or a corpus"):
        build_tiny_model("qwen2", tmp_path / "y", tokenizer=fitted, corpus=["x"])
