"""Real chat templates of every family mmprm claims, through THE step tokenization.

Each template in `tests/fixtures/chat_templates/` is a real checkpoint's, copied unmodified (sources
and licenses in the README there). It is put on a tokenizer trained here that holds the family's
special tokens and settings (`families.json`: bos/eos/pad/unk, whether the tokenizer adds a BOS,
padding side), beside a tiny random-init model of the matching class, saved and loaded back
exactly as a checkpoint is. Then `tokenize_steps`, `extend_steps` and the rollout prompt the HF
backend continues are checked token by token, with a system prompt and without.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from template_families import FAMILIES, FIXTURES, NAMES, TEXT_ARCHS, build_family_checkpoint

from mmprm.models import add_step_token, load_backbone
from mmprm.steps import (
    STEP_TOKEN,
    assistant_start,
    build_messages,
    chat_messages,
    extend_steps,
    is_text_only,
    needs_special_tokens,
    prompt_text,
    render_prefix,
    tokenize_steps,
)
from mmprm.training.vision_sync import no_vision_sync

REPO = Path(__file__).resolve().parents[1]
SYSTEMS = [None, "Answer in short numbered steps."]
SYSTEM_IDS = ["no_system", "system"]

TEXT_QUESTION = "Kim has 7 dots and finds 5 more. How many dots?"
MM_QUESTION = "How many dots are in <image1>? Count them all."
STEPS = [
    "Read the picture: there are 7 dots.",
    "Add the 5 hidden dots: 7 + 5 = 12.",
    "The answer is 12.\n<answer>12</answer>",
]
LABELS = [1.0, 0.7, 0.25]
OTHER_STEPS = ["Count again: 7 + 5 = 13.", "So 13.\n<answer>13</answer>"]

# What each template writes between its generation prompt and the assistant's words, read off the
# templates by hand: LLaVA-1.5 "ASSISTANT:" + " answer", LLaVA-NeXT and Mistral "[/INST]" + " answer".
# LLaVA-OneVision renders an assistant turn as "assistant \n" but prompts with "assistant\n": no lead.
EXPECTED_LEAD = {"llava_1_5_hf": " ", "llava_next_hf": " ", "mistral_v0_3_instruct": " "}
MODEL_CLASS = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "internvl": "InternVLForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration",
    "llava_next": "LlavaNextForConditionalGeneration",
    "llava_onevision": "LlavaOnevisionForConditionalGeneration",
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """name -> directory of that family's tiny checkpoint (built once; load it, never write into it)."""
    root = tmp_path_factory.mktemp("template_families")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_family_checkpoint(name, root / name)
        return built[name]

    return get


@pytest.fixture(scope="module")
def loaded(checkpoint):
    """name -> (model, processor, step_id), loaded with `load_backbone`, step token added."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            model, processor = load_backbone(checkpoint(name))
            cache[name] = (model.eval(), processor, add_step_token(processor, model))
        return cache[name]

    return get


def _tok(processor):
    return getattr(processor, "tokenizer", processor)


def _image_file(tmp_path: Path) -> Path:
    from PIL import Image

    path = tmp_path / "dots.png"
    Image.new("RGB", (56, 42), (230, 25, 75)).save(path)
    return path


def _example(processor, tmp_path: Path) -> tuple[str, list]:
    from PIL import Image

    if is_text_only(processor):
        return TEXT_QUESTION, []
    with Image.open(_image_file(tmp_path)) as im:
        return MM_QUESTION, [im.convert("RGB")]


def _encode(processor, text: str, images: list) -> list[int]:
    """The ids `tokenize_steps` gives `text`: processor with images, tokenizer otherwise; BOS rule included."""
    tok = _tok(processor)
    special = needs_special_tokens(tok, text)
    if images:
        return processor(text=[text], images=images, add_special_tokens=special, return_tensors="pt")["input_ids"][
            0
        ].tolist()
    return tok(text, add_special_tokens=special)["input_ids"]


def test_every_family_has_its_template_and_settings():
    """The fixtures themselves: every claimed family is present and its template file exists."""
    claimed = {
        "qwen2_vl",
        "qwen2_5_vl",
        "internvl3_hf",
        "llava_1_5_hf",
        "llava_next_hf",
        "llava_onevision_hf",
        "qwen2_5_instruct",
        "llama3_1_instruct",
        "llama3_2_instruct",
        "mistral_v0_3_instruct",
        "smollm2_instruct",
    }
    assert set(FAMILIES) == claimed
    readme = (FIXTURES / "README.md").read_text(encoding="utf-8")
    for name, fam in FAMILIES.items():
        assert (FIXTURES / fam["template"]).is_file(), name
        assert fam["template"] in readme, f"{fam['template']}: source not named in the README"


@pytest.mark.parametrize("system", SYSTEMS, ids=SYSTEM_IDS)
@pytest.mark.parametrize("name", NAMES)
def test_tokenize_steps_token_by_token(loaded, tmp_path, name, system):
    model, processor, step_id = loaded(name)
    fam, tok = FAMILIES[name], _tok(processor)
    assert is_text_only(processor) == (fam["arch"] in TEXT_ARCHS)
    assert type(model).__name__ == MODEL_CLASS[fam["arch"]]
    question, images = _example(processor, tmp_path)
    prompt, lead = assistant_start(processor, question, len(images), system)
    assert lead == EXPECTED_LEAD.get(name, "")

    ts = tokenize_steps(processor, question, STEPS, images, labels=LABELS, system=system)
    ids, pos = ts.input_ids, ts.step_positions
    assert [i for i, t in enumerate(ids) if t == step_id] == pos and len(pos) == len(STEPS)
    assert ts.labels == LABELS and ts.dropped_steps == 0 and ts.lead == lead
    # Token by token: the prompt's own ids, then the lead and each step, each followed by its step token.
    n = ts.prompt_length
    assert n is not None
    assert ids[:n] == _encode(processor, prompt, images)
    expected, expected_pos = [], []
    for k, step in enumerate(STEPS):
        expected += tok((lead if k == 0 else "\n") + step, add_special_tokens=False)["input_ids"]
        expected_pos.append(n + len(expected))
        expected.append(step_id)
    assert ids[n:] == expected and pos == expected_pos
    # One BOS, never two: written by the template (Llama 3, Mistral) or added by the tokenizer (LLaVA).
    if fam["bos"]:
        assert (ids[0] == tok.bos_token_id) == (fam["add_bos_token"] or prompt.startswith(fam["bos"]))
        assert ids[1] != tok.bos_token_id
    # The system prompt is in the prompt when given; otherwise the template's default, if it has one.
    prompt_ids = ids[:n]
    shown = tok.decode(prompt_ids)
    if system:
        assert system in shown
    if fam["default_system"]:
        assert (fam["default_system"] in shown) == (system is None)
    # The example runs through the model as is.
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), **ts.model_inputs).logits
    assert logits.shape[1] == len(ids) and torch.isfinite(logits[0, pos]).all()


@pytest.mark.parametrize("system", SYSTEMS, ids=SYSTEM_IDS)
@pytest.mark.parametrize("name", NAMES)
def test_extend_steps_equals_full_tokenization(loaded, tmp_path, name, system):
    _, processor, _ = loaded(name)
    question, images = _example(processor, tmp_path)
    base = tokenize_steps(processor, question, STEPS, images, system=system)
    ext = extend_steps(processor, base, OTHER_STEPS, labels=[1.0, 0.0])
    full = tokenize_steps(processor, question, OTHER_STEPS, images, labels=[1.0, 0.0], system=system)
    assert ext is not None, f"{name}: the prompt could not be shared"
    assert ext.input_ids == full.input_ids and ext.step_positions == full.step_positions
    assert ext.labels == full.labels and ext.prompt_length == full.prompt_length
    assert set(ext.model_inputs) == set(full.model_inputs)
    for key, value in full.model_inputs.items():
        assert torch.equal(ext.model_inputs[key], value), key


@pytest.mark.parametrize("system", SYSTEMS, ids=SYSTEM_IDS)
@pytest.mark.parametrize("name", NAMES)
def test_rollout_prompt_token_by_token(loaded, tmp_path, name, system):
    """The text the HF backend continues: the generation prompt, then the steps so far, verbatim."""
    from mmprm.generation.base import RolloutRequest, SamplingConfig, rollout_prompt
    from mmprm.generation.hf import HFBackend

    model, processor, _ = loaded(name)
    tok = _tok(processor)
    question, images = _example(processor, tmp_path)
    prefix = STEPS[:2]
    text = rollout_prompt(processor, question, len(images), prefix, "tags", system)
    prompt = prompt_text(processor, question, len(images), system)
    _, lead = assistant_start(processor, question, len(images), system)
    assert text == prompt + lead + render_prefix(prefix)
    assert rollout_prompt(processor, question, len(images), [], "tags", system) == prompt
    # Token by token: the generation prompt's own ids, then the lead and the steps, as the model
    # would have generated them after that prompt.
    ids, prompt_ids = _encode(processor, text, images), _encode(processor, prompt, images)
    assert ids[: len(prompt_ids)] == prompt_ids
    expected = [
        t
        for k, s in enumerate(prefix)
        for t in tok((lead if k == 0 else "") + render_prefix([s]), add_special_tokens=False)["input_ids"]
    ]
    assert ids[len(prompt_ids) :] == expected
    # The template's own rendering of an assistant turn that starts with these steps is the same
    # text (LLaVA-OneVision's turn does not extend its own generation prompt: no such check there;
    # Mistral drops the system prompt once an assistant turn follows).
    probe = "PROBE-END"
    messages = chat_messages(processor, question, len(images), system, assistant=render_prefix(prefix) + probe)
    try:
        turn = processor.apply_chat_template(messages, tokenize=False).split(probe)[0]
    except Exception:  # noqa: BLE001 - a template may reject the conversation; nothing to compare then
        turn = None
    if turn is not None and name != "llava_onevision_hf" and not (name.startswith("mistral") and system):
        assert turn == text
    # The HF backend continues exactly that text (images from disk for VLMs).
    request_images = [str(_image_file(tmp_path))] if images else []
    backend = HFBackend(model, processor, SamplingConfig(max_new_tokens=3, seed=0), batch_size=4, system=system)
    out = backend.generate(
        [
            RolloutRequest("p0", question, request_images, prefix, 2),
            RolloutRequest("p1", question, request_images, [], 1),
        ]
    )
    assert [len(texts) for texts in out] == [2, 1] and all(isinstance(t, str) for t in out[0] + out[1])


@pytest.mark.parametrize("name", [n for n in NAMES if FAMILIES[n]["default_system"]])
def test_default_system_prompt_and_prefix_sharing(loaded, tmp_path, name):
    """Qwen2.5 ("You are Qwen..."), Qwen2-VL/2.5-VL and SmolLM2 add a system prompt when none is given.

    It is part of the shared prompt (extend_steps reuses it, once), of the rollout prompt, and it is
    replaced, not repeated, when the user sets one; prompts with and without it never share tokens
    past the point where they differ.
    """
    from mmprm.generation.base import rollout_prompt

    _, processor, step_id = loaded(name)
    tok, default = _tok(processor), FAMILIES[name]["default_system"]
    question, images = _example(processor, tmp_path)
    base = tokenize_steps(processor, question, STEPS, images)
    assert tok.decode(base.input_ids[: base.prompt_length]).count(default) == 1
    ext = extend_steps(processor, base, OTHER_STEPS)
    assert ext.input_ids == tokenize_steps(processor, question, OTHER_STEPS, images).input_ids
    assert rollout_prompt(processor, question, len(images), STEPS[:1]).count(default) == 1
    own = tokenize_steps(processor, question, STEPS, images, system="Be brief.")
    assert default not in tok.decode(own.input_ids) and "Be brief." in tok.decode(own.input_ids)
    # Both still put every step token right after its step; only the prompt differs.
    assert own.input_ids[own.prompt_length :] == base.input_ids[base.prompt_length :]
    assert own.input_ids[: own.prompt_length] != base.input_ids[: base.prompt_length]
    assert sum(t == step_id for t in own.input_ids) == len(STEPS)


@pytest.mark.parametrize("name", ["llama3_1_instruct", "qwen2_5_instruct", "smollm2_instruct"])
def test_left_padded_rollouts_equal_one_by_one(checkpoint, name):
    """With and without a pad token (Llama 3 has none), left-padded batches continue each prompt as
    it would alone: top_k=1 makes sampling greedy, so the texts must match exactly."""
    from mmprm.generation.base import RolloutRequest, SamplingConfig
    from mmprm.generation.hf import HFBackend

    model, processor = load_backbone(checkpoint(name))
    had_pad = processor.pad_token is not None
    assert had_pad == (FAMILIES[name]["pad"] is not None)
    backend = HFBackend(model, processor, SamplingConfig(top_k=1, max_new_tokens=6, seed=0), batch_size=8)
    assert processor.padding_side == "left"
    assert processor.pad_token == (FAMILIES[name]["pad"] or FAMILIES[name]["eos"])
    requests = [
        RolloutRequest("short", TEXT_QUESTION, [], [], 1),
        RolloutRequest("long", TEXT_QUESTION, [], STEPS[:2], 1),
    ]
    together = backend.generate(requests)
    alone = [backend.generate([r])[0] for r in requests]
    assert together == alone


@pytest.mark.parametrize("name", ["smollm2_instruct", "llama3_2_instruct", "llama3_1_instruct"])
def test_step_token_with_tied_and_untied_embeddings(checkpoint, tmp_path, name):
    """Adding the step token grows input and output embeddings together; tied ones stay one tensor
    (through a training step and a save/load), and the new row is what both sides use."""
    tied = FAMILIES[name]["tie_word_embeddings"]
    model, processor = load_backbone(checkpoint(name))
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert (emb.weight.data_ptr() == head.weight.data_ptr()) == tied
    rows = emb.weight.shape[0]
    step_id = add_step_token(processor, model)
    assert step_id == rows  # the tiny vocab has no spare rows: the matrices had to grow
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert emb.weight.shape[0] == head.weight.shape[0] == rows + 1
    assert (emb.weight.data_ptr() == head.weight.data_ptr()) == tied
    assert torch.isfinite(emb.weight[step_id]).all() and emb.weight[step_id].abs().sum() > 0
    assert add_step_token(processor, model) == step_id and emb.weight.shape[0] == rows + 1  # idempotent

    ts = tokenize_steps(processor, TEXT_QUESTION, STEPS[:2])
    ids = torch.tensor([ts.input_ids])
    out = model(input_ids=ids, output_hidden_states=True)
    # Input side: the step token's embedding is the new row. Output side: its logit reads that row
    # of lm_head (the same tensor when tied).
    assert torch.equal(emb(torch.tensor([step_id]))[0], emb.weight[step_id])
    hidden = out.hidden_states[-1][0, ts.step_positions[0] - 1]  # (H,) predicts the step token
    assert torch.allclose(out.logits[0, ts.step_positions[0] - 1, step_id], hidden @ head.weight[step_id], atol=1e-4)
    # One training step on a loss that reaches the new row keeps tied weights tied.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = -torch.log_softmax(out.logits[0, ts.step_positions[0] - 1], -1)[step_id]
    loss.backward()
    opt.step()
    if tied:
        assert torch.equal(emb.weight, model.get_output_embeddings().weight)
        assert emb.weight.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    model.save_pretrained(tmp_path / "saved")
    processor.save_pretrained(tmp_path / "saved")
    again, again_tok = load_backbone(tmp_path / "saved")
    assert again_tok.convert_tokens_to_ids(STEP_TOKEN) == step_id
    assert torch.equal(again.get_input_embeddings().weight[step_id], emb.weight[step_id].detach())
    assert torch.equal(again.get_output_embeddings().weight[step_id], head.weight[step_id].detach())
    assert (again.get_input_embeddings().weight.data_ptr() == again.get_output_embeddings().weight.data_ptr()) == tied


def _load_recipe(name: str):
    module_name = f"{name}_recipe_for_templates"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, REPO / "recipes" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses resolve string annotations through sys.modules
        spec.loader.exec_module(module)
    return sys.modules[module_name]


def test_string_concatenating_template_on_a_text_only_model(checkpoint):
    """The reported failure: SmolLM2's template does `'\\n' + message['content']`.

    Typed content parts (what every prompt used to be) raise the TypeError users saw; the prompt
    paths of prm_train (tokenize_steps), policy_sft (tokenize_sft) and mcts_annotate (HF backend)
    now give that template string content and run.
    """
    from mmprm.generation.base import RolloutRequest, SamplingConfig
    from mmprm.generation.hf import HFBackend

    model, processor = load_backbone(checkpoint("smollm2_instruct"))
    assert is_text_only(processor) and model.config.tie_word_embeddings
    with pytest.raises(TypeError, match=r'can only concatenate str \(not "list"\) to str'):
        processor.apply_chat_template(build_messages(TEXT_QUESTION, 0), add_generation_prompt=True, tokenize=False)
    assert chat_messages(processor, TEXT_QUESTION, 0, "Be brief.")[1]["content"] == TEXT_QUESTION

    assert prompt_text(processor, TEXT_QUESTION, 0).endswith(
        f"user\n{TEXT_QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    )
    add_step_token(processor, model)
    ts = tokenize_steps(processor, TEXT_QUESTION, STEPS, labels=LABELS)  # prm_train, prm scoring, export
    assert len(ts.step_positions) == len(STEPS)
    from mmprm.training.data import tokenize_sft

    sft = tokenize_sft(processor, TEXT_QUESTION, STEPS[:2], "12", [], 512, None)  # policy_sft
    assert sft is not None and any(label != -100 for label in sft["labels"])
    backend = HFBackend(model, processor, SamplingConfig(max_new_tokens=3), batch_size=4)  # mcts_annotate, HF
    assert len(backend.generate([RolloutRequest("q0", TEXT_QUESTION, [], STEPS[:1], 2)])[0]) == 2
    with pytest.raises(ValueError, match="text-only"):
        prompt_text(processor, MM_QUESTION, 1)


def test_policy_sft_eval_generation_without_a_pad_token(checkpoint):
    """policy_sft's eval generation pads a batch on the left; Llama 3 ships no pad token."""
    from accelerate import Accelerator

    recipe = _load_recipe("policy_sft")
    model, processor = load_backbone(checkpoint("llama3_1_instruct"))
    assert processor.pad_token is None
    cfg = recipe.PolicySFTConfig()
    cfg.train.eval_generations, cfg.train.eval_batch_size, cfg.train.max_new_tokens = 2, 2, 4
    examples = [
        {"id": f"q{i}", "question": q, "images": [], "answer": "12"}
        for i, q in enumerate([TEXT_QUESTION, "What is 2 + 2?"])
    ]
    stats = recipe.generate_eval(model, processor, examples, cfg, Accelerator(cpu=True), no_vision_sync)
    assert stats["generated"] == 2 and processor.pad_token == processor.eos_token


@pytest.mark.slow
def test_prm_train_recipe_on_a_string_template_checkpoint(checkpoint, tmp_path):
    """The real prm_train entry point, two steps, on the SmolLM2-style checkpoint (tied, string template)."""
    import os
    import subprocess

    sys.path.insert(0, str(Path(__file__).parent))
    from toy_data import write_toy_prm_data

    train = write_toy_prm_data(tmp_path / "data", 8, 0, images=False)
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        str(REPO / "recipes" / "prm_train.py"),
        f"model.name_or_path={checkpoint('smollm2_instruct')}",
        f"data.train_file={train}",
        f"output_dir={out}",
        "train.max_steps=2",
        "train.batch_size=4",
        "train.log_every=1",
        "train.save_every=2",
        "data.max_length=256",
        "train.report_to=none",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("split") == "train" for r in rows) and (out / "mmprm_prm.json").exists()
