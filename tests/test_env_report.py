"""`mmprm env`: each library checked for real, a broken install and a missing GPU are problems
(exit 1), a library not installed is listed with the extra that installs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmprm.env_report import check_library, driver_problem, python_problem

REPO = Path(__file__).resolve().parents[1]


def broken_package(root: Path, name: str, dist: str) -> Path:
    """An installed package whose import fails as a build for another torch does."""
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text(
        'raise ImportError("/site/flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi")\n'
    )
    meta = root / f"{dist.replace('-', '_')}-2.8.3.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 2.8.3\n")
    return root


def test_a_library_that_does_not_import_is_broken_and_one_not_installed_is_named(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(broken_package(tmp_path, "mmprm_fake_flash", "mmprm-fake-flash")))
    lib = check_library("mmprm_fake_flash", "mmprm-fake-flash", "flash", cuda=False)
    assert lib.status == "broken" and lib.version == "2.8.3"
    assert "undefined symbol" in lib.detail and "another torch" in lib.detail
    lib = check_library("mmprm_not_here", "mmprm-not-here", "vllm", cuda=False)
    assert lib.status == "not installed" and lib.detail == "pip install 'mmprm[vllm]'"
    assert check_library("yaml", "pyyaml", None, cuda=False).status == "ok"


def test_python_and_driver_problems_say_what_to_do():
    assert python_problem((3, 11, 7)) is None
    assert "Python 3.10.14: mmprm needs >= 3.11" in python_problem((3, 10, 14))
    assert driver_problem("13.0", "580.95.05") is None and driver_problem("12.9", "550.54.15") is None
    said = driver_problem("13.0", "550.54.15")
    assert "CUDA 13.0, which needs an NVIDIA driver >= 580; this one is 550.54.15" in said
    assert "docs/scaling.md#install-on-a-cluster" in said
    assert driver_problem(None, "550.54.15") is None and driver_problem("13.0", None) is None


@pytest.mark.slow
def test_mmprm_env_on_this_machine(tmp_path):
    import torch

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "mmprm.cli", "env"]
    run = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    report = json.loads(run.stdout)
    libs = {lib["name"]: lib for lib in report["libraries"]}
    assert libs["transformers"]["status"] == libs["accelerate"]["status"] == "ok"
    assert report["torch"] == torch.__version__
    if not torch.cuda.is_available():  # no GPU is a problem unless --cpu-ok says none is meant
        assert run.returncode == 1 and any("--cpu-ok" in p for p in report["problems"])
        ok = subprocess.run([*cmd, "--cpu-ok"], capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
        assert ok.returncode == 0 and "no problems" in ok.stdout, ok.stdout + ok.stderr
    # a flash-attn built for another torch: exit 1, named, whatever the machine
    broken = broken_package(tmp_path, "flash_attn", "flash-attn")
    env["PYTHONPATH"] = os.pathsep.join([str(broken), env["PYTHONPATH"]])
    bad = subprocess.run([*cmd, "--cpu-ok"], capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert bad.returncode == 1 and "flash-attn: broken: ImportError" in bad.stdout, bad.stdout
