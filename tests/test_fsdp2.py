"""FSDP2 (launch/accelerate/fsdp.yaml) in one gloo process on CPU: train.max_grad_norm bounds the
gradient the optimizer steps with (`tests/fsdp2_step.py` runs the step)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from ports import free_port
from recipe_runs import recipe_env


def run_fsdp2_step(tiny_models, tmp_path, *args: str) -> dict:
    """tests/fsdp2_step.py on the tiny Qwen2-VL in its own process; its JSON line."""
    script = Path(__file__).with_name("fsdp2_step.py")
    res = subprocess.run(
        [sys.executable, str(script), str(tiny_models("qwen2_vl")), str(tmp_path / "out"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=recipe_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())),
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "trainable",
    ["frozen", pytest.param("all", marks=pytest.mark.slow)],
    ids=["frozen_vision_tower", "every_weight"],
)
def test_fsdp2_clips_the_gradient_the_optimizer_steps_with(tiny_models, tmp_path, trainable):
    """fully_shard replaces every parameter: a list of them taken before prepare holds no gradient
    (the clip saw a norm of 0 and left the sharded gradients as they were)."""
    out = run_fsdp2_step(tiny_models, tmp_path, trainable)
    assert out["sharded"] > 0  # fully_shard replaced the parameters
    assert out["before"] > 100  # train.max_grad_norm=1.0 has work to do
    assert out["stepped"] == pytest.approx(1.0, rel=1e-3)
    assert out["logged"] == pytest.approx(out["before"], rel=1e-5)  # metrics.jsonl's grad_norm: before clipping


@pytest.mark.slow
def test_fsdp2_grad_norm_without_clipping(tiny_models, tmp_path):
    """train.max_grad_norm=0: the logged norm is the global one over the sharded gradients, which
    the optimizer then steps with untouched."""
    out = run_fsdp2_step(tiny_models, tmp_path, "frozen", "0")
    assert out["before"] > 100 and out["stepped"] == out["before"]
    assert out["logged"] == pytest.approx(out["before"], rel=1e-5)
