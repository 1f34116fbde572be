"""`model.attn_implementation`: one loading function takes it, every recipe checks it before loading,
and scores come back as float32 whatever dtype the PRM runs in."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmprm.config import ConfigError
from mmprm.models.loading import load_backbone, resolve_attn_implementation

REPO = Path(__file__).resolve().parents[1]
HAS_FLASH = importlib.util.find_spec("flash_attn") is not None


def test_resolve_attn_implementation():
    assert resolve_attn_implementation("sdpa") == "sdpa"
    assert resolve_attn_implementation("eager") == "eager"
    if not torch.cuda.is_available():
        assert resolve_attn_implementation("auto") == "sdpa"


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto may choose flash-attn on a GPU")
def test_auto_says_which_kernel_it_chose_and_why_once(capsys, monkeypatch):
    from mmprm.models import loading

    monkeypatch.setattr(loading, "_SAID", set())  # what earlier tests had said
    for _ in range(2):
        assert resolve_attn_implementation("auto", key="scorer.attn") == "sdpa"
    why = "flash-attn is not installed" if not HAS_FLASH else "no CUDA GPU is visible"
    [line] = capsys.readouterr().err.splitlines()  # said once, though resolved twice
    assert line.startswith(f"scorer.attn=auto: sdpa ({why}")
    with pytest.raises(ConfigError, match=r"scorer\.attn: 'flash' is not one of \['sdpa', 'flash_attention_2'"):
        resolve_attn_implementation("flash", key="scorer.attn")


@pytest.mark.skipif(HAS_FLASH and torch.cuda.is_available(), reason="flash-attn usable here")
def test_flash_attention_without_flash_attn_or_cuda_is_a_clear_error():
    with pytest.raises(
        ConfigError,
        match=r"model\.attn_implementation=flash_attention_2 .*set "
        r"model\.attn_implementation=sdpa",
    ):
        resolve_attn_implementation("flash_attention_2")


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_load_backbone_loads_language_model_and_vision_tower_with_the_kernel(tiny_models, kernel):
    model, _ = load_backbone(tiny_models("qwen2_vl"), attn_implementation=kernel)
    assert model.config.get_text_config()._attn_implementation == kernel
    assert model.config.vision_config._attn_implementation == kernel


def test_load_prm_passes_the_kernel_and_scores_float32_in_bf16(tiny_models, tmp_path):
    from mmprm import load_prm
    from mmprm.models.prm import PRMSpec, ProcessRewardModel, build_prm, save_prm

    backbone, processor = load_backbone(tiny_models("qwen2_vl"))
    save_prm(build_prm(backbone, processor, PRMSpec()), processor, tmp_path / "prm")
    examples = [{"question": "What is 2 + 3?", "steps": ["2 + 3 = 5.", "The answer is 5."]}]
    fp32 = load_prm(tmp_path / "prm", attn_implementation="eager")
    assert fp32.model.backbone.config.get_text_config()._attn_implementation == "eager"
    bf16 = load_prm(tmp_path / "prm", dtype=torch.bfloat16)
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    assert ProcessRewardModel.probabilities(torch.zeros(3, 2, dtype=torch.bfloat16)).dtype == torch.float32
    a, b = fp32.score(examples)[0], bf16.score(examples)[0]
    assert len(a) == len(b) == 2 and all(isinstance(x, float) for x in b)
    assert max(abs(x - y) for x, y in zip(a, b)) < 2e-2  # bf16 rounding, not a different model


# Each recipe with just enough keys to reach the check; it must fail there, before loading anything.
RECIPE_ARGS = {
    "prm_train": [],
    "policy_sft": [],
    "mcts_annotate": [],
    "bon_rerank": ["prm.path=nowhere"],
    "prm_eval": ["data.path=nowhere", "prm.path=nowhere"],
    "tree_eval": ["scorer.kind=prm", "prm.path=nowhere"],
    "quickstart": ["output_dir=/nonexistent/never-written"],
}


def recipe_main(name: str):
    """recipes/<name>.py's main, loaded by path (the `recipes` package raises on import by design)."""
    key = f"_attn_recipe_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, REPO / "recipes" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module  # dataclasses resolve string annotations through sys.modules
        spec.loader.exec_module(module)
    return sys.modules[key].main


@pytest.mark.skipif(HAS_FLASH, reason="flash-attn installed: the missing-package error cannot happen")
@pytest.mark.parametrize("recipe", sorted(RECIPE_ARGS))
def test_every_recipe_names_the_key_when_flash_attn_is_missing(recipe, monkeypatch, capsys):
    from mmprm.models import loading

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the attention kernel was checked")

    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained", no_loading)
    monkeypatch.setattr(loading.AutoModelForImageTextToText, "from_pretrained", no_loading)
    # main raises the ConfigError (its __main__ block prints it and exits 2), or prints it and returns 2
    try:
        code = recipe_main(recipe)([*RECIPE_ARGS[recipe], "model.attn_implementation=flash_attention_2"])
    except ConfigError as e:
        code, message = 2, str(e)
    else:
        message = capsys.readouterr().err
    assert code == 2, f"{recipe} accepted model.attn_implementation=flash_attention_2 without flash-attn"
    assert (
        "model.attn_implementation=flash_attention_2 but flash-attn is not installed: on a CUDA machine with "
        "torch installed, pip install 'mmprm[flash]' --no-build-isolation" in message
    )


@pytest.mark.skipif(HAS_FLASH, reason="flash-attn installed: the missing-package error cannot happen")
def test_recipe_exits_2_with_the_message():
    cmd = [sys.executable, str(REPO / "recipes" / "prm_train.py"), "model.attn_implementation=flash_attention_2"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, check=False)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.startswith("prm_train: ")
    assert "model.attn_implementation=flash_attention_2 but flash-attn is not installed" in res.stderr


@pytest.mark.parametrize("recipe", ["prm_train", "policy_sft"])
def test_training_recipes_refuse_an_unknown_dtype_before_loading(recipe):
    """The shared model section (mmprm.training.run.TrainModelConfig) names the accepted dtypes."""
    config = REPO / "recipes" / "configs" / "tiny" / f"{recipe}.yaml"
    with pytest.raises(ConfigError, match=r"model\.dtype: 'bf16' is not one of \['float32', 'bfloat16', 'float16'\]"):
        recipe_main(recipe)(["--config", str(config), "model.dtype=bf16"])


# ---- grouped-query sdpa on CPU (mmprm.models.attention) ----------------------------------------
@pytest.fixture
def transformers_sdpa(monkeypatch):
    """A context in which "sdpa" is transformers' own function again (repeated key/value heads)."""
    from contextlib import contextmanager

    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    @contextmanager
    def use():
        with monkeypatch.context() as m:
            m.setitem(AttentionInterface._global_mapping, "sdpa", sdpa_attention_forward)
            yield

    return use


@pytest.fixture
def repeats(monkeypatch):
    """Counts transformers' `repeat_kv` calls (the copy the grouped kernel avoids)."""
    from transformers.integrations import sdpa_attention

    calls = []
    real = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda x, n: calls.append(n) or real(x, n))
    return calls


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "internvl", "llava", "qwen2"])
def test_grouped_query_sdpa_generates_bitwise_what_repeated_heads_do(
    tiny_models, tmp_path, arch, transformers_sdpa, repeats
):
    """Left-padded greedy logits at every token and sampled rollouts (with an image for the VLMs):
    bitwise equal, with no head copied. Fails where "sdpa" repeats the heads (transformers' function: `repeats` fills)."""
    from PIL import Image

    from mmprm.generation.base import RolloutRequest, SamplingConfig
    from mmprm.generation.hf import HFBackend

    model, processor = load_backbone(tiny_models(arch))
    images = []
    if arch != "qwen2":
        Image.new("RGB", (56, 56), (200, 30, 30)).save(tmp_path / "tile.png")
        images = [str(tmp_path / "tile.png")]
    assert model.config.get_text_config().num_key_value_heads < model.config.get_text_config().num_attention_heads
    tokenizer = getattr(processor, "tokenizer", processor)
    tokenizer.padding_side = "left"
    enc = tokenizer(["What is 2 + 3?", "Add 4 and 5, then 6, then 7."], padding=True, return_tensors="pt")
    assert (enc["attention_mask"] == 0).any()  # a padded row: transformers' path would repeat

    def run():
        with torch.no_grad():
            gen = model.generate(
                **enc, max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True,
                pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
        backend = HFBackend(model, processor, SamplingConfig(max_new_tokens=16, seed=3), batch_size=8)
        requests = [
            RolloutRequest("p0", "Add the tiles.", images, ["2 + 3 = 5."], 3),  # rows of two lengths: padded
            RolloutRequest("p1", "Add the tiles.", images, [], 2),
        ]
        return gen.sequences, torch.stack(gen.logits), backend.generate(requests)

    ours = run()
    assert repeats == []
    with transformers_sdpa():
        theirs = run()
    assert repeats  # transformers' path did copy the heads
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1]) and ours[2] == theirs[2]


def test_grouped_query_sdpa_leaves_training_as_transformers_runs_it(tiny_models, transformers_sdpa, repeats):
    """With autograd the repeated heads run as before: the same loss and gradients, bitwise."""
    model, processor = load_backbone(tiny_models("qwen2"))
    tokenizer = getattr(processor, "tokenizer", processor)
    tokenizer.padding_side = "right"
    enc = tokenizer(["What is 2 + 3?", "Add 4 and 5, then 6, then 7."], padding=True, return_tensors="pt")

    def grads():
        model.zero_grad()
        model(**enc, labels=enc["input_ids"]).loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    ours = grads()
    assert repeats  # the training path repeats the heads, as transformers does
    with transformers_sdpa():
        theirs = grads()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_tree_packed_scores_are_bitwise_those_of_repeated_heads(
    tiny_models, tmp_path, transformers_sdpa, repeats, monkeypatch
):
    """The PRM scorer's tree-packed attention (`_tree_sdpa`) without autograd takes the grouped
    kernel, and scores what the repeated heads score, bitwise."""
    from mmprm import load_prm
    from mmprm.models import attention
    from mmprm.models.prm import PRMSpec, build_prm, save_prm

    backbone, processor = load_backbone(tiny_models("qwen2_vl"))
    save_prm(build_prm(backbone, processor, PRMSpec()), processor, tmp_path / "prm")
    prm = load_prm(tmp_path / "prm")
    examples = [
        {"question": "What is 2 + 3?", "steps": ["2 + 3 = 5.", "The answer is 5."]},
        {"question": "What is 2 + 3?", "steps": ["2 + 3 = 5.", "So 6."]},
        {"question": "Add 4 and 5.", "steps": ["4 + 5 = 9."]},
    ]
    ours = prm.score(examples)
    assert repeats == []
    with monkeypatch.context() as m:
        m.setattr(attention, "_HAS_ENABLE_GQA", False)  # as on torch 2.4: repeated heads everywhere
        with transformers_sdpa():
            theirs = prm.score(examples)
    assert repeats and ours == theirs
