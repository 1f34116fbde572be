"""Run a recipe the way a user does - its own process, from the repository root - and read what
it wrote; or load it in this process (`load_recipe`). One copy for every recipe test, so they all
see the same environment."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


def recipe_env(**extra: str) -> dict[str, str]:
    """The caller's environment with unbuffered output and one thread per process: tiny models
    gain nothing from more, and two test processes on two cores would fight over them."""
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        **extra,
    }


def cpu_ddp_launcher(processes: int = 2) -> list[str]:
    """`accelerate launch --multi_gpu` for PROCESSES gloo processes on CPU, on a free port.

    Run it with ACCELERATE_USE_CPU=true: without it each process sees no GPU and runs alone.
    """
    from ports import free_port

    return [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
        "--num_processes", str(processes), "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()),
    ]  # fmt: skip


def run_recipe(
    recipe: str,
    *overrides: Any,
    launcher: Sequence[str] | None = None,
    timeout: int = 600,
    extra_env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """`python recipes/<recipe>.py OVERRIDES...` (or under `launcher`, e.g. accelerate launch);
    fails the test with the tail of its output when it exits non-zero."""
    cmd = [*(launcher or [sys.executable]), str(REPO / "recipes" / f"{recipe}.py"), *map(str, overrides)]
    res = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=recipe_env(**(extra_env or {}))
    )
    assert res.returncode == 0, f"{recipe} {' '.join(cmd[2:])}\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
    return res


def read_metrics(out: Path | str, split: str | None = None) -> list[dict[str, Any]]:
    """The rows of `out/metrics.jsonl`, only those of `split` when given."""
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if split is None or r["split"] == split]


# the numbers every train row of metrics.jsonl holds on a CPU run (docs/scaling.md, "What a training run logs")
TRAIN_KEYS = (
    "loss", "lr", "grad_norm", "tokens_per_s", "samples_per_s", "mfu", "peak_rss_gb",
    "data_s", "fwd_bwd_s", "optimizer_s", "step_s", "seconds",
)  # fmt: skip


def check_train_rows(rows: list[dict[str, Any]], mfu: bool) -> None:
    """Each train row of a CPU run logs every one of TRAIN_KEYS: positive numbers, its step time
    the sum of its parts, and MFU only when `mfu` (train.peak_tflops set), else null."""
    assert rows, "no train rows"
    for r in rows:
        missing = [k for k in TRAIN_KEYS if k not in r]
        assert not missing, f"step {r['step']}: no {missing} in {r}"
        assert (r["mfu"] is not None) == mfu, r
        numbers = [k for k in TRAIN_KEYS if k not in ("lr", "mfu")] + (["mfu"] if mfu else [])
        assert all(isinstance(r[k], float) and 0 < r[k] < float("inf") for k in numbers), r
        assert r["data_s"] + r["fwd_bwd_s"] + r["optimizer_s"] == pytest.approx(r["step_s"], rel=1e-6), r


def load_recipe(name: str) -> ModuleType:
    """recipes/<name>.py loaded by path (the `recipes` package refuses imports), once per process."""
    key = f"_recipe_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, REPO / "recipes" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module  # dataclasses resolve string annotations through sys.modules
        spec.loader.exec_module(module)
    return sys.modules[key]


def load_demo(name: str) -> ModuleType:
    """recipes/demo/<name>.py, imported as `demo.<name>` the way quickstart imports it: recipes/ is
    sys.path[0] of a script there, and is appended here (last, so it shadows no installed module)."""
    recipes = str(REPO / "recipes")
    if recipes not in sys.path:
        sys.path.append(recipes)
    return importlib.import_module(f"demo.{name}")


def short_train_args(model, train, ev, out, steps: int) -> list[str]:
    """Overrides of a short training run (prm_train or policy_sft): STEPS steps of 4 rows, every step
    logged, evaluated and saved at the end."""
    return [
        f"model.name_or_path={model}",
        f"data.train_file={train}",
        f"data.eval_file={ev}",
        f"output_dir={out}",
        f"train.max_steps={steps}",
        "train.lr=1e-3",
        "train.batch_size=4",
        "train.log_every=1",
        f"train.eval_every={steps}",
        f"train.save_every={steps}",
        "data.max_length=256",
        "train.report_to=none",
    ]
