"""benchmarks/gpu_wheels.sh and gpu_offline_check.py: the wheels a lent GPU machine (no registry)
needs, their pins, the size that travels, and the offline install rehearsed here."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / "benchmarks" / "gpu_wheels.sh"
# what the image lacks and mmprm needs (docs/gpu-readiness.md)
NEEDED = {
    "datasets",
    "dill",
    "multiprocess",
    "math_verify",
    "latex2sympy2_extended",
    "antlr4_python3_runtime",
    "liger_kernel",
    "pydantic",
    "pydantic_core",
    "annotated_types",
    "typing_inspection",
    "hjson",
    "deepspeed",
    "pyarrow",
}


def norm(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def test_a_bad_subcommand_exits_with_usage():
    run = subprocess.run(["bash", str(WHEELS), "nope"], capture_output=True, text=True)
    assert run.returncode == 2 and "unknown subcommand 'nope'" in run.stderr and "download" in run.stderr


def test_the_pins_name_every_package_once():
    run = subprocess.run(["bash", str(WHEELS), "list"], capture_output=True, text=True, check=True)
    pins = [line.split()[0] for line in run.stdout.splitlines()]
    names = [norm(p.split("==")[0]) for p in pins]
    assert all("==" in p for p in pins) and len(names) == len(set(names)), pins
    assert set(names) >= NEEDED, NEEDED - set(names)
    assert "torch" not in names and "transformers" not in names  # the image's own are kept


def test_install_without_the_wheels_says_what_to_run(tmp_path):
    run = subprocess.run(
        ["bash", str(WHEELS), "install", str(tmp_path), sys.executable], capture_output=True, text=True
    )
    assert run.returncode == 1 and "gpu_wheels.sh download" in run.stderr


def test_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    run = subprocess.run(
        ["shellcheck", "--shell=bash", "--severity=style", str(WHEELS)], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout


@pytest.mark.slow
def test_the_tree_and_the_wheels_fit_in_what_a_call_carries(tmp_path):
    wheels = tmp_path / "whl"
    run = subprocess.run(["bash", str(WHEELS), "download", str(wheels)], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    size = subprocess.run(["bash", str(WHEELS), "size", str(wheels)], capture_output=True, text=True)
    res = json.loads(size.stdout.strip().splitlines()[-1])
    assert size.returncode == 0 and res["total_bytes"] < 64 * 2**20, res


@pytest.mark.slow
def test_the_offline_install_and_transformers_517_rehearsed():
    if not Path("/root/.pyenv/versions/3.12.1/bin/python3").exists():
        pytest.skip("no Python 3.12 (pyenv 3.12.1) to rehearse the image's python3 with")
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_offline_check.py")],
        capture_output=True,
        text=True,
        timeout=1500,
        cwd=REPO,
    )
    res = json.loads(run.stdout.strip().splitlines()[-1])
    assert run.returncode == 0 and res["ok"], json.dumps(res)[-3000:] + run.stderr[-2000:]
    assert res["transformers_517"]["transformers"] == "5.17.0" and len(res["transformers_517"]["train_losses"]) == 3
    assert res["wheels"]["imports_ok"] and res["wheels"]["pip_check_other"] == []
