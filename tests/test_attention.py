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
    with pytest.raises(ConfigError, match=r"scorer\.attn: 'flash' is not one of \['sdpa', 'flash_attention_2'"):
        resolve_attn_implementation("flash", key="scorer.attn")


@pytest.mark.skipif(HAS_FLASH and torch.cuda.is_available(), reason="flash-attn usable here")
def test_flash_attention_without_flash_attn_or_cuda_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"model\.attn_implementation=flash_attention_2 .*set "
                                          r"model\.attn_implementation=sdpa"):
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
    "bon_rerank": ["prm=nowhere"],
    "prm_eval": ["data.path=nowhere", "scorer.prm_path=nowhere"],
    "tree_eval": ["scorer.kind=prm", "scorer.prm_path=nowhere"],
    "quickstart": ["output_dir=/nonexistent/never-written"],
}


@pytest.mark.skipif(HAS_FLASH, reason="flash-attn installed: the missing-package error cannot happen")
@pytest.mark.parametrize("recipe", sorted(RECIPE_ARGS))
def test_every_recipe_names_the_key_when_flash_attn_is_missing(recipe):
    cmd = [sys.executable, str(REPO / "recipes" / f"{recipe}.py"), *RECIPE_ARGS[recipe],
           "model.attn_implementation=flash_attention_2"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, check=False)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "model.attn_implementation=flash_attention_2 but flash-attn is not installed" in res.stderr
