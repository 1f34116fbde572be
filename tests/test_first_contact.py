"""benchmarks/gpu_first_contact.sh on CPU: its one JSON line, each step's status and limit, the
budget, and a step that really runs and fails. On a GPU it is run as it is (docs/gpu-readiness.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_first_contact.sh"
NAMES = ["install", "env", "gpu_check", "annotate", "score"]


def first_contact(tmp_path: Path, **env: str) -> tuple[int, dict]:
    run = subprocess.run(
        ["bash", str(SCRIPT)],
        env={**os.environ, "WORK": str(tmp_path / "work"), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1, run.stdout + run.stderr  # ONE line: the JSON
    return run.returncode, json.loads(lines[0])


def test_dry_run_lists_every_step_within_the_budget(tmp_path):
    rc, res = first_contact(tmp_path, DRY_RUN="1")
    assert rc == 0 and res["ok"] is True and res["budget_s"] == 470
    assert [s["name"] for s in res["steps"]] == NAMES
    assert all(s["status"] == "dry_run" and s["rc"] is None for s in res["steps"])
    assert sum(s["limit_s"] for s in res["steps"]) <= 480  # under 8 minutes in all


def test_a_spent_budget_runs_nothing_and_fails(tmp_path):
    rc, res = first_contact(tmp_path, BUDGET="3", PYTHON=sys.executable)
    assert rc == 1 and res["ok"] is False
    assert [s["status"] for s in res["steps"]] == ["not_run", "no_time", "no_time", "no_time", "no_time"]


@pytest.mark.slow
def test_a_step_that_runs_and_fails_is_recorded(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: mmprm env may pass here")
    pythonpath = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    rc, res = first_contact(tmp_path, PYTHON=sys.executable, STEPS="env", PYTHONPATH=pythonpath)
    env = res["steps"][1]
    assert rc == 1 and env["status"] == "failed" and env["rc"] == 1 and env["seconds"] > 0, res
    assert "CPU build" in (tmp_path / "work" / "logs" / "env.log").read_text()
    assert [s["status"] for i, s in enumerate(res["steps"]) if i != 1] == ["not_run"] * 4


def test_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    run = subprocess.run(
        ["shellcheck", "--shell=bash", "--severity=style", str(SCRIPT)], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout
