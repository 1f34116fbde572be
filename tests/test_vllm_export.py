"""`mmprm export-vllm`: a PRM directory written as vLLM loads it for token classification.

These run without vllm (the export is files and configs); the vLLM tier (tests/test_vllm_scorer.py)
loads the exports in a real engine and checks its scores against the HF scorer's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from mmprm.models.prm import VALUE_HEAD_FILE, PRMSpec, build_prm, load_prm, save_prm
from mmprm.models.vllm_prm import INDEX_FILE, SCORE_WEIGHTS_FILE, ImagePlaceholders, cli_export_vllm, export_for_vllm


@pytest.fixture(scope="module")
def prms(tiny_models, tmp_path_factory):
    """(arch, head) -> a saved random-init PRM; the value head's bias set off zero so it counts."""
    from mmprm.models.loading import load_backbone

    made: dict[tuple[str, str], Path] = {}

    def get(arch: str, head: str) -> Path:
        if (arch, head) not in made:
            backbone, processor = load_backbone(tiny_models(arch))
            model = build_prm(backbone, processor, PRMSpec(head=head))
            if head == "value":
                torch.nn.init.constant_(model.value_head.bias, 0.75)
            made[arch, head] = save_prm(model, processor, tmp_path_factory.mktemp(f"{arch}_{head}") / "prm")
        return made[arch, head]

    return get


def examples(images: list[str]) -> list[dict]:
    question = "How many tiles are red?"
    return [
        {"id": "a", "question": question, "images": images, "steps": ["Tile 1 is red.", "Tile 2 is blue.", "One."]},
        {"id": "b", "question": question, "images": images, "steps": ["Tile 1 is red.", "Both are red."]},
    ]


@pytest.mark.parametrize("arch", ["qwen2", "qwen2_vl", "internvl"])
def test_token_pair_export_names_the_reward_tokens_negative_first(prms, arch, tmp_path):
    prm = prms(arch, "token_pair")
    out = export_for_vllm(prm, tmp_path / "vllm")
    config = json.loads((out / "config.json").read_text())
    # vLLM's 2-way softmax scores the second token: ours is positive first, "+"
    assert config["classifier_from_token"] == ["-", "+"]
    assert config["method"] == "from_2_way_softmax"
    original = json.loads((prm / "config.json").read_text())
    if "text_config" in original:
        assert config["text_config"]["classifier_from_token"] == ["-", "+"]
        from safetensors import safe_open

        with safe_open(str(prm / "model.safetensors"), framework="pt") as st:
            saved_head = any(k.endswith("lm_head.weight") for k in st.keys())
        assert config["text_config"]["tie_word_embeddings"] is (not saved_head)
    # the weights are linked, not copied; nothing else of the PRM's config changes
    assert (out / "model.safetensors").is_symlink()
    assert (out / "model.safetensors").resolve() == (prm / "model.safetensors").resolve()
    assert {k: v for k, v in config.items() if k not in ("classifier_from_token", "method", "text_config")} == {
        k: v for k, v in original.items() if k != "text_config"
    }


@pytest.mark.parametrize("arch", ["qwen2", "qwen2_vl"])
def test_value_export_writes_the_head_as_the_classifier_and_indexes_every_weight(prms, arch, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    prm = prms(arch, "value")
    out = export_for_vllm(prm, tmp_path / "vllm")
    name = "language_model.score.weight" if arch != "qwen2" else "score.weight"
    score = load_file(str(out / SCORE_WEIGHTS_FILE))
    head = load_file(str(prm / VALUE_HEAD_FILE))
    assert list(score) == [name]
    assert torch.equal(score[name], head["weight"].float())
    index = json.loads((out / INDEX_FILE).read_text())["weight_map"]
    with safe_open(str(prm / "model.safetensors"), framework="pt") as st:
        backbone = set(st.keys())
    # vLLM loads only the indexed files: every backbone weight and the classifier, not value_head
    assert index == {**dict.fromkeys(backbone, "model.safetensors"), name: SCORE_WEIGHTS_FILE}
    assert json.loads((out / "config.json").read_text())["id2label"] == {"0": "step_correct"}


@pytest.mark.parametrize("head", ["token_pair", "value"])
def test_an_export_is_still_a_prm_directory_with_the_same_scores(prms, head, tmp_path):
    from PIL import Image

    Image.new("RGB", (56, 28), "red").save(tmp_path / "tiles.png")
    images = [str(tmp_path / "tiles.png")]
    prm = prms("qwen2_vl", head)
    out = export_for_vllm(prm, tmp_path / "vllm")
    exs = examples(images)
    assert load_prm(out).score(exs) == load_prm(prm).score(exs)


def test_folding_undoes_the_processors_image_expansion(prms):
    """vLLM expands one placeholder per image itself: Qwen2-VL's pads, InternVL's <img>...</img>."""
    from PIL import Image

    from mmprm.models.loading import load_processor
    from mmprm.steps import tokenize_steps

    for arch in ("qwen2_vl", "internvl"):
        processor = load_processor(prms(arch, "token_pair"))
        tokenizer = processor.tokenizer
        images = [Image.new("RGB", (56, 28), "red"), Image.new("RGB", (28, 56), "blue")]
        tok = tokenize_steps(processor, "Which is red?", ["The first.", "So 1."], images)
        fold = ImagePlaceholders(processor)
        wrapped = [tokenizer.convert_ids_to_tokens(fold.before), tokenizer.convert_ids_to_tokens(fold.after)]
        assert wrapped == ([["<img>"], ["</img>"]] if arch == "internvl" else [[], []])
        folded, spans = fold.fold(tok.input_ids)
        assert spans == 2
        placeholder = tokenizer.convert_tokens_to_ids(processor.image_token)
        assert folded.count(placeholder) == 2
        # what is left is the text around the images, token for token
        assert [t for t in folded if t != placeholder] == [
            t for t in tok.input_ids if t != fold.repeated and t not in fold.before + fold.after
        ]
        # a text without images is left as it is
        text_only = tokenize_steps(processor, "Which is red?", ["The first."], [])
        assert fold.fold(text_only.input_ids) == (text_only.input_ids, 0)


def test_export_refuses_its_own_directory_and_a_non_prm(prms, tmp_path, capsys):
    prm = prms("qwen2", "token_pair")
    with pytest.raises(ValueError, match="directory of its own"):
        export_for_vllm(prm, prm)
    with pytest.raises(SystemExit) as e:
        cli_export_vllm([str(tmp_path), str(tmp_path / "out")])
    assert e.value.code == 2
    assert "no mmprm_prm.json" in capsys.readouterr().err


def test_cli_prints_the_serve_command(prms, tmp_path, capsys):
    out = tmp_path / "served"
    assert cli_export_vllm([str(prms("qwen2", "value")), str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"vllm serve {out} --runner pooling --convert classify" in printed
    assert (out / SCORE_WEIGHTS_FILE).exists() and not math.isnan(load_prm(out).score(examples([]))[0][0])


@pytest.mark.parametrize("head", ["token_pair", "value"])
def test_a_sharded_checkpoint_exports_with_its_index(prms, head, tmp_path):
    """A 7B is saved in shards: the export keeps the index (a value head's classifier added to
    it), and still loads and scores as the PRM."""
    import shutil

    from transformers import AutoModelForCausalLM

    prm = prms("qwen2", head)
    sharded = tmp_path / "sharded"
    shutil.copytree(prm, sharded)
    (sharded / "model.safetensors").unlink()
    AutoModelForCausalLM.from_pretrained(prm).save_pretrained(sharded, max_shard_size="100KB")
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    assert len(shards) > 1 and (sharded / INDEX_FILE).exists()
    out = export_for_vllm(sharded, tmp_path / "vllm")
    index = json.loads((out / INDEX_FILE).read_text())["weight_map"]
    original = json.loads((sharded / INDEX_FILE).read_text())["weight_map"]
    if head == "value":
        assert index == {**original, "score.weight": SCORE_WEIGHTS_FILE}
    else:
        assert (out / INDEX_FILE).is_symlink() and index == original
    exs = examples([])
    assert load_prm(out).score(exs) == load_prm(prm).score(exs)
