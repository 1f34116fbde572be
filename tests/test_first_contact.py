"""The GPU scripts on CPU: benchmarks/gpu_first_contact.sh (a cluster node with a registry),
benchmarks/gpu_lease_check.sh (a lent machine with none) and the time-boxed steps they share
(benchmarks/timeboxed.sh): the one JSON line and summary.json, each step's status and limit, the
budget, no_time, and steps that really run. docs/gpu-readiness.md says which machine is for which."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIRST_CONTACT = REPO / "benchmarks" / "gpu_first_contact.sh"
LEASE = REPO / "benchmarks" / "gpu_lease_check.sh"
TIMEBOXED = REPO / "benchmarks" / "timeboxed.sh"
NAMES = ["install", "env", "gpu_check", "annotate", "score"]
LEASE_STEPS = ["gpu", "install", "env", "zero2", "zero3", "probe", "packed_flex", "scoring", "compile", "annotate"]
LEASE_NOT_RUN = ["flash_attn", "vllm", "vllm_tp", "vllm_scorer"]


def run_script(script: Path, out: Path, **env: str) -> tuple[int, dict, subprocess.CompletedProcess]:
    run = subprocess.run(
        ["bash", str(script)],
        # WORK: where the script before timeboxed.sh put its logs; OUT: where they go now
        env={**os.environ, "OUT": str(out), "WORK": str(out), **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1, run.stdout + run.stderr  # ONE line: the JSON
    return run.returncode, json.loads(lines[0]), run


def first_contact(tmp_path: Path, **env: str) -> tuple[int, dict]:
    rc, res, _ = run_script(FIRST_CONTACT, tmp_path / "out", **env)
    return rc, res


def test_dry_run_lists_every_step_within_the_budget(tmp_path):
    rc, res = first_contact(tmp_path, DRY_RUN="1")
    assert rc == 0 and res["ok"] is True and res["budget_s"] == 470
    assert [s["name"] for s in res["steps"]] == NAMES
    assert all(s["status"] == "dry_run" and s["rc"] is None for s in res["steps"])
    assert sum(s["limit_s"] for s in res["steps"]) <= 480  # under 8 minutes in all
    assert json.loads((tmp_path / "out" / "summary.json").read_text()) == res  # results in one place


def test_a_spent_budget_runs_nothing_and_fails(tmp_path):
    rc, res = first_contact(tmp_path, BUDGET="3", PYTHON=sys.executable)
    assert rc == 1 and res["ok"] is False
    assert [s["status"] for s in res["steps"]] == ["not_run", "no_time", "no_time", "no_time", "no_time"]
    assert res["failed"] == NAMES[1:]


def test_the_install_step_runs_the_scripts_function(tmp_path):
    """`timeout install` ran coreutils' /usr/bin/install ("missing file operand") and never the
    script's function: the venv was never made. Here pip finds nothing (no index, no such package),
    so the function makes the venv, then fails at its first pip install."""
    venv = tmp_path / "venv"
    rc, res = first_contact(
        tmp_path, STEPS="install", VENV=str(venv), PIP_NO_INDEX="1", TORCH_GPU="mmprm-no-such-package==0"
    )
    log = (tmp_path / "out" / "logs" / "install.log").read_text()
    assert "missing file operand" not in log, log
    assert (venv / "bin" / "python").exists(), log
    install = res["steps"][0]
    assert install["status"] == "failed" and install["rc"] == 1 and "mmprm-no-such-package" in log, res
    # the install failed, so nothing after it was run on a half-made environment
    assert [s["status"] for s in res["steps"][1:]] == ["not_run"] * 4


@pytest.mark.slow
def test_a_step_that_runs_and_fails_is_recorded(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: mmprm env may pass here")
    pythonpath = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    rc, res = first_contact(tmp_path, PYTHON=sys.executable, STEPS="env", PYTHONPATH=pythonpath)
    env = res["steps"][1]
    assert rc == 1 and env["status"] == "failed" and env["rc"] == 1 and env["seconds"] > 0, res
    assert "CPU build" in (tmp_path / "out" / "logs" / "env.log").read_text()
    assert [s["status"] for i, s in enumerate(res["steps"]) if i != 1] == ["not_run"] * 4


def test_every_step_command_is_a_function_or_a_program():
    """Each `step NAME LIMIT CMD` names a function the script defines or a program (the
    interpreter, make): a name that is neither would exit 127 on the GPU machine."""
    for script in (FIRST_CONTACT, LEASE):
        text = script.read_text()
        functions = {line.split("(")[0] for line in text.splitlines() if line.endswith("() {")}
        for line in text.splitlines():
            if line.startswith("step "):
                command = line.split()[3]
                assert command in functions or command in {'"$py"', "make"}, (script.name, line)


# ---- benchmarks/timeboxed.sh ------------------------------------------------------------------


def timeboxed(tmp_path: Path, body: str, budget: int, **env: str) -> tuple[int, dict]:
    script = tmp_path / "steps.sh"
    script.write_text(
        f"set -uo pipefail\nsource {TIMEBOXED}\nSTEPS=${{STEPS:-a b c d}}\n"
        f'steps_begin "{tmp_path}/logs" "{tmp_path}/summary.json" {budget} test\n{body}\nsteps_end\n'
    )
    run = subprocess.run(["bash", str(script)], env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1, run.stdout + run.stderr
    assert json.loads((tmp_path / "summary.json").read_text()) == json.loads(lines[0])
    return run.returncode, json.loads(lines[0])


def test_a_function_step_runs_under_timeout_with_its_exported_variables(tmp_path):
    body = """
export GREETING=hello
greet() { echo "not json"; echo "{\\"said\\": \\"$GREETING $1\\", \\"ok\\": true}"; }
step a 20 greet world
step b 20 no-such-program-here
step c 20 bash -c 'echo {broken json; exit 3'
"""
    rc, res = timeboxed(tmp_path, body, 60)
    a, b, c = res["steps"]
    assert a["status"] == "ok" and a["rc"] == 0 and a["result"] == {"said": "hello world", "ok": True}
    assert b["status"] == "failed" and b["rc"] == 127 and "no such program or function" in b["why"]
    assert c["status"] == "failed" and c["rc"] == 3 and c["result"] is None and c["why"] == "{broken json"
    assert rc == 1 and res["failed"] == ["b", "c"] and res["ok"] is False


def test_limits_shrink_to_the_budget_and_no_time_fails(tmp_path):
    body = """
step a 100 sleep 0
step b 100 sleep 30
step c 100 sleep 0
steps_block "b did not pass"
step d 100 sleep 0
"""
    t0 = time.time()
    rc, res = timeboxed(tmp_path, body, 7)
    a, b, c, d = res["steps"]
    assert 6 <= a["limit_s"] <= 7 and a["status"] == "ok"  # the step's 100 s cut to the budget left
    assert b["status"] == "timeout" and b["rc"] == 124 and b["limit_s"] <= 7 and "limit" in b["why"]
    assert c["status"] == "no_time" and c["limit_s"] < 5  # the budget is spent: not run, and a failure
    assert d["status"] == "blocked" and d["why"] == "b did not pass"
    assert rc == 1 and res["failed"] == ["b", "c", "d"] and time.time() - t0 < 20


def test_dry_run_and_not_run_by_name_pass(tmp_path):
    body = 'step a 10 sleep 1\nstep_not_run vllm "cannot travel"\nstep z 10 sleep 1'
    rc, res = timeboxed(tmp_path, body, 60, DRY_RUN="1")
    a, vllm, z = res["steps"]
    assert a["status"] == "dry_run" and a["why"] == "sleep 1" and a["limit_s"] == 10
    assert vllm == {
        "name": "vllm",
        "status": "not_run",
        "rc": None,
        "seconds": 0.0,
        "limit_s": 0,
        "why": "cannot travel",
    }
    assert z["status"] == "not_run" and z["why"] == "not in STEPS"
    assert rc == 0 and res["ok"] is True


# ---- benchmarks/gpu_lease_check.sh --------------------------------------------------------------


def test_lease_dry_run_lists_the_steps_limits_and_what_is_not_run(tmp_path):
    rc, res, _ = run_script(LEASE, tmp_path / "out", DRY_RUN="1")
    assert rc == 0 and res["budget_s"] == 450
    names = [s["name"] for s in res["steps"]]
    assert names == LEASE_STEPS + LEASE_NOT_RUN
    for s in res["steps"]:
        assert s["status"] == ("dry_run" if s["name"] in LEASE_STEPS else "not_run"), s
    for s in res["steps"][len(LEASE_STEPS) :]:
        assert s["why"] and ("wheel" in s["why"]), s  # said by name, with why
    # the call that starts it, with the machine's start and the transfers, stays under 10 minutes
    assert sum(s["limit_s"] for s in res["steps"]) <= 600


def test_lease_on_a_machine_without_a_gpu_stops_at_once_and_says_so(tmp_path):
    if shutil.which("nvidia-smi"):
        pytest.skip("nvidia-smi is here: this machine may have a GPU")
    out = tmp_path / "out"
    t0 = time.time()
    rc, res, run = run_script(LEASE, out)
    assert rc == 1 and time.time() - t0 < 30
    assert "no GPU is visible" in run.stderr
    gpu, *rest = res["steps"]
    assert gpu["status"] == "failed" and "no GPU is visible" in gpu["why"]
    assert [s["status"] for s in rest] == ["blocked"] * (len(LEASE_STEPS) - 1) + ["not_run"] * len(LEASE_NOT_RUN)
    # what comes back from a lease: at most 8 files, the logs in one archive
    files = sorted(p.name for p in out.iterdir())
    assert files == ["gpu.txt", "logs.tgz", "summary.json"]
    with tarfile.open(out / "logs.tgz") as tar:
        assert "logs/gpu.log" in tar.getnames()
    assert json.loads((out / "summary.json").read_text()) == res


def test_lease_check_starts_under_2000_characters():
    """The device tool's command line holds 2,000 characters: the call that starts the check."""
    command = "bash benchmarks/gpu_lease_check.sh"
    assert len(command) < 2000 and LEASE.exists()


@pytest.mark.slow
def test_lease_steps_run_for_real_on_cpu(tmp_path):
    """Every step that can start on CPU does, with each check's CPU flag: its command exists and
    runs to its own JSON line. The GPU-only checks say why they cannot run."""
    pytest.importorskip("deepspeed")
    out = tmp_path / "out"
    rc, res, run = run_script(
        LEASE,
        out,
        ALLOW_CPU="1",
        PYTHON=sys.executable,
        STEPS="env probe scoring annotate",
        BUDGET="590",
        OMP_NUM_THREADS="1",
    )
    steps = {s["name"]: s for s in res["steps"]}
    for name in ("env", "probe", "scoring", "annotate"):
        assert steps[name]["rc"] not in (None, 127) and steps[name]["result"] is not None, (steps[name], run.stderr)
    assert steps["env"]["result"]["torch"], steps["env"]
    assert steps["probe"]["status"] == "ok" and steps["probe"]["result"]["script"] == "gpu_probe", steps["probe"]
    assert steps["scoring"]["status"] == "ok" and steps["scoring"]["result"]["scoring_throughput"]["ok"]
    assert steps["annotate"]["status"] == "ok" and steps["annotate"]["result"]["prm_rows"] > 0, steps["annotate"]


def test_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    run = subprocess.run(
        ["shellcheck", "-x", "--shell=bash", "--severity=style", str(FIRST_CONTACT), str(LEASE), str(TIMEBOXED)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stdout


def test_make_gpu_check_with_an_own_python_installs_nothing():
    """A lent machine has no registry: `make gpu-check PYTHON=python3` must not reach for pip."""
    run = subprocess.run(["make", "-n", "gpu-check", "PYTHON=python3"], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "pip" not in run.stdout and "benchmarks/gpu_check.py" in run.stdout, run.stdout
