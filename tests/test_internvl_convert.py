"""`mmprm convert-internvl`: an InternVL chat checkpoint (remote-code layout) in transformers' format.

A tiny transformers-format InternVL is written out here in InternVL's own layout - its
repository's weight names (`vision_model.encoder.layers.N.attn.qkv`, `mlp1.0`, InternLM2's
`attention.wqkv` with each key/value head's query group, key and value stacked), its config.json
(`llm_config`, `vision_config`, `ps_version`, `max_dynamic_patch`) - and converted back: the weights,
the tiling and the scores must come back exactly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from released_checkpoints import QUESTION, SOLUTIONS, build_internvl_prm, figure

from mmprm import load_prm
from mmprm.cli import main as mmprm_main
from mmprm.models.internvl_convert import ConversionError, convert_internvl, split_wqkv


def internvl_layout(state: dict[str, torch.Tensor], kind: str, heads: int, kv_heads: int) -> dict[str, torch.Tensor]:
    """transformers' InternVL weights under the names InternVL's repository gives them."""
    out: dict[str, torch.Tensor] = {}
    vt, lm = "model.vision_tower.", "model.language_model."
    out["vision_model.embeddings.class_embedding"] = state[vt + "embeddings.cls_token"]
    out["vision_model.embeddings.position_embedding"] = state[vt + "embeddings.position_embeddings"]
    for p in ("weight", "bias"):
        out[f"vision_model.embeddings.patch_embedding.{p}"] = state[vt + f"embeddings.patch_embeddings.projection.{p}"]
    layers = 1 + max(int(k.split(".")[4]) for k in state if k.startswith(vt + "encoder.layer."))
    for i in range(layers):
        ours, theirs = f"{vt}encoder.layer.{i}.", f"vision_model.encoder.layers.{i}."
        out[theirs + "attn.qkv.weight"] = torch.cat([state[ours + f"attention.{x}_proj.weight"] for x in "qkv"])
        out[theirs + "ls1"], out[theirs + "ls2"] = state[ours + "lambda_1"], state[ours + "lambda_2"]
        for p in ("weight", "bias"):
            out[theirs + f"attn.proj.{p}"] = state[ours + f"attention.projection_layer.{p}"]
            out[theirs + f"mlp.fc1.{p}"] = state[ours + f"mlp.fc1.{p}"]
            out[theirs + f"mlp.fc2.{p}"] = state[ours + f"mlp.fc2.{p}"]
            out[theirs + f"norm1.{p}"] = state[ours + f"layernorm_before.{p}"]
            out[theirs + f"norm2.{p}"] = state[ours + f"layernorm_after.{p}"]
    for theirs, ours in (("0", "layer_norm"), ("1", "linear_1"), ("3", "linear_2")):
        for p in ("weight", "bias"):
            out[f"mlp1.{theirs}.{p}"] = state[f"model.multi_modal_projector.{ours}.{p}"]
    if kind == "qwen2":
        out.update({"language_model.model." + k[len(lm) :]: v for k, v in state.items() if k.startswith(lm)})
        out["language_model.lm_head.weight"] = state["lm_head.weight"]
        return out
    # InternLM2
    out["language_model.model.tok_embeddings.weight"] = state[lm + "embed_tokens.weight"]
    out["language_model.model.norm.weight"] = state[lm + "norm.weight"]
    out["language_model.output.weight"] = state["lm_head.weight"]
    n_layers = 1 + max(int(k.split(".")[3]) for k in state if k.startswith(lm + "layers."))
    for i in range(n_layers):
        ours, theirs = f"{lm}layers.{i}.", f"language_model.model.layers.{i}."
        q, k, v = (state[ours + f"self_attn.{x}_proj.weight"] for x in "qkv")
        head_dim, group = k.shape[0] // kv_heads, heads // kv_heads
        rows = []
        for h in range(kv_heads):
            rows += [q[(h * group + j) * head_dim : (h * group + j + 1) * head_dim] for j in range(group)]
            rows += [k[h * head_dim : (h + 1) * head_dim], v[h * head_dim : (h + 1) * head_dim]]
        out[theirs + "attention.wqkv.weight"] = torch.cat(rows)
        out[theirs + "attention.wo.weight"] = state[ours + "self_attn.o_proj.weight"]
        out[theirs + "feed_forward.w1.weight"] = state[ours + "mlp.gate_proj.weight"]
        out[theirs + "feed_forward.w3.weight"] = state[ours + "mlp.up_proj.weight"]
        out[theirs + "feed_forward.w2.weight"] = state[ours + "mlp.down_proj.weight"]
        out[theirs + "attention_norm.weight"] = state[ours + "input_layernorm.weight"]
        out[theirs + "ffn_norm.weight"] = state[ours + "post_attention_layernorm.weight"]
    return out


def write_internvl_chat(hf_dir: Path, out: Path, kind: str) -> Path:
    """`hf_dir` (transformers' InternVL) as an InternVL chat checkpoint directory, in two shards."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, InternVLForConditionalGeneration

    model = InternVLForConditionalGeneration.from_pretrained(hf_dir)
    cfg = model.config
    text, vis = cfg.text_config, cfg.vision_config
    weights = internvl_layout(model.state_dict(), kind, text.num_attention_heads, text.num_key_value_heads)
    out.mkdir(parents=True)
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: weights[k].contiguous() for k in keys}, str(out / file))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    if kind == "qwen2":
        llm = {
            **text.to_dict(),
            "architectures": ["Qwen2ForCausalLM"],
            "attn_implementation": "flash_attention_2",  # a training run's setting: must not reach the load
            "use_cache": False,
        }
    else:
        llm = {
            "architectures": ["InternLM2ForCausalLM"],
            "model_type": "internlm2",
            "auto_map": {"AutoConfig": "configuration_internlm2.InternLM2Config"},
            "bias": False,
            "rope_scaling": None,
            "rope_theta": text.rope_parameters["rope_theta"],
            **{
                k: getattr(text, k)
                for k in (
                    "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads "
                    "num_key_value_heads hidden_act max_position_embeddings rms_norm_eps"
                ).split()
            },
        }
    config = {
        "architectures": ["InternVLChatModel"],
        "model_type": "internvl_chat",
        "auto_map": {"AutoModel": "modeling_internvl_chat.InternVLChatModel"},
        "template": "internvl2_5",
        "downsample_ratio": cfg.downsample_ratio,
        "select_layer": -1,
        "ps_version": "v2",
        "dynamic_image_size": True,
        "use_thumbnail": True,
        "min_dynamic_patch": 1,
        "max_dynamic_patch": 4,
        "force_image_size": vis.image_size[0],
        "torch_dtype": "float32",
        "llm_config": llm,
        "vision_config": {
            "architectures": ["InternVisionModel"],
            "model_type": "intern_vit_6b",
            "hidden_size": vis.hidden_size,
            "num_hidden_layers": vis.num_hidden_layers,
            "num_attention_heads": vis.num_attention_heads,
            "intermediate_size": vis.intermediate_size,
            "qkv_bias": False,
            "qk_normalization": False,
            "norm_type": "layer_norm",
            "layer_norm_eps": vis.layer_norm_eps,
            "image_size": vis.image_size[0],
            "patch_size": vis.patch_size[0],
            "hidden_act": "gelu",
            "use_flash_attn": True,
        },
    }
    (out / "config.json").write_text(json.dumps(config))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(hf_dir / f, out / f)
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(hf_dir)
    added = tok.get_added_vocab()
    (out / "added_tokens.json").write_text(json.dumps({t: i for t, i in added.items() if t.startswith("<")}))
    if kind == "internlm2":  # InternLM2's tokenizer: a sentencepiece file and remote code
        (out / "tokenizer.json").unlink()
        shutil.copyfile(hf_dir / "tokenizer.model", out / "tokenizer.model")
        fields = ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
        tokenizer_config.update(
            tokenizer_class="InternLM2Tokenizer",
            auto_map={"AutoTokenizer": ["tokenization_internlm2.InternLM2Tokenizer", None]},
            # as transformers 4 wrote it, and the released checkpoints carry it
            added_tokens_decoder={
                str(i): {f: getattr(t, f) for f in fields} for i, t in tok.added_tokens_decoder.items()
            },
        )
        (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return out


@pytest.fixture(scope="module")
def qwen2_internvl(tmp_path_factory):
    return build_internvl_prm(tmp_path_factory.mktemp("qwen2_internvl"))


@pytest.fixture(scope="module")
def internlm2_shaped(tmp_path_factory):
    """Transformers' format of what InternLM2-based releases convert to, tokenizer.model beside."""
    from released_checkpoints import build_internlm2_internvl_prm

    out = build_internlm2_internvl_prm(tmp_path_factory.mktemp("internlm2_internvl"))
    text = json.loads((out / "config.json").read_text())["text_config"]
    assert (text["num_attention_heads"], text["num_key_value_heads"]) == (4, 2)
    return out


def assert_same_weights(a: Path, b: Path) -> None:
    from transformers import InternVLForConditionalGeneration

    sa = InternVLForConditionalGeneration.from_pretrained(a).state_dict()
    sb = InternVLForConditionalGeneration.from_pretrained(b).state_dict()
    assert sorted(sa) == sorted(sb)
    assert all(torch.equal(sa[k], sb[k]) for k in sa), [k for k in sa if not torch.equal(sa[k], sb[k])]


def rows() -> list[dict]:
    return [{"id": f"a{i}", "question": QUESTION, "steps": s, "images": [figure()]} for i, s in enumerate(SOLUTIONS)]


def test_split_wqkv_reads_each_heads_group_key_and_value():
    """2 key/value heads, 2 query heads each, head_dim 1: rows q0 q1 k0 v0 q2 q3 k1 v1."""
    w = torch.tensor([[10.0], [11.0], [20.0], [30.0], [12.0], [13.0], [21.0], [31.0]])
    q, k, v = split_wqkv(w, heads=4, kv_heads=2)
    assert q.flatten().tolist() == [10, 11, 12, 13]
    assert k.flatten().tolist() == [20, 21] and v.flatten().tolist() == [30, 31]


def test_qwen2_internvl_converts_back_to_the_same_model(qwen2_internvl, tmp_path):
    src = write_internvl_chat(qwen2_internvl, tmp_path / "chat", "qwen2")
    out = convert_internvl(src, tmp_path / "hf")
    assert_same_weights(qwen2_internvl, out)
    config = json.loads((out / "config.json").read_text())
    assert config["text_config"]["model_type"] == "qwen2" and config["image_seq_length"] == 4
    assert config["vision_config"]["use_qk_norm"] is False
    assert config["dtype"] == "float32" and config["text_config"]["use_cache"] is True
    tiling = json.loads((out / "processor_config.json").read_text())["image_processor"]
    assert (tiling["max_patches"], tiling["size"], tiling["crop_to_patches"]) == (4, {"height": 56, "width": 56}, True)
    assert tiling["image_mean"] == [0.485, 0.456, 0.406]
    for convention in ("mm_prm", "visualprm"):
        ours = load_prm(out, convention=convention).score(rows())
        assert ours == load_prm(qwen2_internvl, convention=convention).score(rows())


def test_internlm2_internvl_converts_back_with_its_tokenizer_rebuilt(internlm2_shaped, tmp_path, capsys):
    from transformers import AutoTokenizer

    src = write_internvl_chat(internlm2_shaped, tmp_path / "chat", "internlm2")
    out = tmp_path / "rebuilt"
    assert mmprm_main(["convert-internvl", str(src), str(out)]) == 0
    assert "tokenizer: InternLM2's, rebuilt from tokenizer.model" in capsys.readouterr().out
    assert_same_weights(internlm2_shaped, out)
    ours, theirs = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(internlm2_shaped)
    text = "<|im_start|>user\n<img><IMG_CONTEXT></img>\n你好 Question: 3 + 15?<prm>Yes<|im_end|>"
    assert ours(text)["input_ids"] == theirs(text)["input_ids"] and ours(text)["input_ids"][0] == ours.bos_token_id
    for convention in ("mm_prm", "visualprm"):
        assert load_prm(out, convention=convention).score(rows()) == load_prm(
            internlm2_shaped, convention=convention
        ).score(rows())
    # a remote-code tokenizer with no sentencepiece file to rebuild from needs --tokenizer
    (src / "tokenizer.model").unlink()
    with pytest.raises(ConversionError, match="InternLM2Tokenizer.*remote code.*--tokenizer"):
        convert_internvl(src, tmp_path / "refused")


def test_internlm2_internvl_takes_a_tokenizer_and_a_tile_limit(internlm2_shaped, tmp_path):
    src = write_internvl_chat(internlm2_shaped, tmp_path / "chat", "internlm2")
    out = convert_internvl(src, tmp_path / "hf", tokenizer=internlm2_shaped, max_patches=1)
    assert_same_weights(internlm2_shaped, out)
    config = json.loads((out / "config.json").read_text())
    assert config["text_config"]["model_type"] == "llama"
    assert json.loads((out / "processor_config.json").read_text())["image_processor"]["max_patches"] == 1
    # one tile (no thumbnail) now, where the source's own processor cut two and a thumbnail
    assert load_prm(out, convention="visualprm").score(rows()[:2]) != load_prm(
        internlm2_shaped, convention="visualprm"
    ).score(rows()[:2])
    (out / "processor_config.json").write_text((internlm2_shaped / "processor_config.json").read_text())
    assert load_prm(out, convention="visualprm").score(rows()[:2]) == load_prm(
        internlm2_shaped, convention="visualprm"
    ).score(rows()[:2])


def test_a_tokenizer_with_other_ids_for_the_added_tokens_is_refused(internlm2_shaped, tmp_path):
    src = write_internvl_chat(internlm2_shaped, tmp_path / "chat", "internlm2")
    added = json.loads((src / "added_tokens.json").read_text())
    added["<prm>"] += 1
    (src / "added_tokens.json").write_text(json.dumps(added))
    with pytest.raises(ConversionError, match="'<prm>': .* in the checkpoint"):
        convert_internvl(src, tmp_path / "hf", tokenizer=internlm2_shaped)


def test_unmappable_checkpoints_are_refused_naming_why(qwen2_internvl, tmp_path):
    src = write_internvl_chat(qwen2_internvl, tmp_path / "chat", "qwen2")
    config = json.loads((src / "config.json").read_text())
    with pytest.raises(ConversionError, match="already transformers' InternVL format"):
        convert_internvl(qwen2_internvl, tmp_path / "a")
    (src / "config.json").write_text(json.dumps({**config, "ps_version": "v1"}))
    with pytest.raises(ConversionError, match="ps_version"):
        convert_internvl(src, tmp_path / "b")
    llm = {**config["llm_config"], "architectures": ["Phi3ForCausalLM"]}
    (src / "config.json").write_text(json.dumps({**config, "llm_config": llm}))
    with pytest.raises(ConversionError, match="Phi3ForCausalLM"):
        convert_internvl(src, tmp_path / "c")
    vision = {k: v for k, v in config["vision_config"].items() if k != "hidden_size"}
    (src / "config.json").write_text(json.dumps({**config, "vision_config": vision}))
    with pytest.raises(ConversionError, match="config.json: no 'hidden_size'"):
        convert_internvl(src, tmp_path / "e")
    (src / "config.json").write_text("{")
    with pytest.raises(ConversionError, match="config.json: not JSON"):
        convert_internvl(src, tmp_path / "f")
    (src / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    shard = src / "model-00001-of-00002.safetensors"
    save_file({**load_file(str(shard)), "vision_model.head.weight": torch.zeros(2)}, str(shard))
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["vision_model.head.weight"] = shard.name
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConversionError, match="vision_model.head.weight"):
        convert_internvl(src, tmp_path / "d")


def test_the_command_reports_a_refusal_without_a_traceback(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(SystemExit) as exit_:
        mmprm_main(["convert-internvl", str(tmp_path / "src"), str(tmp_path / "out")])
    assert exit_.value.code == 2
    assert "not an InternVL chat checkpoint" in capsys.readouterr().err


def test_a_vocabulary_without_a_video_token_gets_one_after_every_id(tmp_path):
    """InternVL2.5's tokenizer has no <video>, which transformers' InternVL processor names."""
    from transformers import PreTrainedTokenizerFast

    from mmprm.models.internvl_convert import internvl_tokenizer
    from mmprm.models.tiny import train_bpe

    bpe = train_bpe(["<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>"])
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>").save_pretrained(tmp_path / "src")
    (tmp_path / "src" / "added_tokens.json").write_text(json.dumps({"<IMG_CONTEXT>": 4}))
    tok = internvl_tokenizer(tmp_path / "src", None)
    assert tok.video_token == "<video>" and tok.convert_tokens_to_ids("<video>") == bpe.get_vocab_size()
    assert tok.context_image_token_id == 4 and "<|im_start|>assistant" in tok.chat_template


def test_the_command_prints_the_template_and_a_system_message_of_the_checkpoints_own(qwen2_internvl, tmp_path, capsys):
    src = write_internvl_chat(qwen2_internvl, tmp_path / "chat", "qwen2")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "system_message": "You are a grader."}))
    assert mmprm_main(["convert-internvl", str(src), str(tmp_path / "hf")]) == 0
    out = capsys.readouterr().out
    assert "conversation template: 'internvl2_5'" in out and "'You are a grader.'" in out
    assert "tokenizer:" not in out  # its own tokenizer, as it is
