"""The real sbatch files in launch/slurm/, submitted to a real 2-node Slurm cluster on loopback.

The cluster (tests/slurm_cluster.py) is munged + slurmctld + two slurmd on 127.0.0.1, each
node with 2 CPUs and 2 stand-in GPUs. Probe scripts check what the sbatch files hand to each
rank (world size, machine rank, shard index, GPU binding) without the recipes; the recipe
tests run the real recipes through the same files and turn on as soon as each recipe exists.
All slow tier, and run only when asked (`make test-cluster` or MMPRM_SYSTEM_TESTS=1, which let the
fixture apt-get install slurm-wlm and munge); otherwise skipped with the reason.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ports import free_port
from slurm_cluster import APT_PACKAGES, SLURM_BINARIES, JobResult, SlurmCluster, ensure_debian_packages

from mmprm.config import load_config, parse_cli
from mmprm.training.run import CHECKPOINT_DONE

REPO = Path(__file__).resolve().parents[1]
SLURM_DIR = REPO / "launch" / "slurm"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# Small, quiet, single-threaded jobs: two "nodes" share this machine's few cores.
JOB_ENV = {
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
    "MAIN_PROCESS_IP": "127.0.0.1",  # node names n1/n2 do not resolve
    "ACCELERATE_USE_CPU": "true",  # no real GPU: without it each process would train alone
    "MIXED_PRECISION": "no",
    "MMPRM_ROOT": str(REPO),
    "PYTHON": sys.executable,
}

# Records what accelerate gave this process; the all-reduce proves the processes are one group.
TRAIN_PROBE = """\
import json, os, sys
import torch
from accelerate import Accelerator
acc = Accelerator()
total = acc.reduce(torch.tensor([float(acc.process_index + 1)]), reduction="sum").item()
out = os.environ["PROBE_OUT"]
rec = {"rank": acc.process_index, "world": acc.num_processes, "type": str(acc.distributed_type),
       "sum": total, "node": os.environ.get("SLURMD_NODENAME"), "argv": sys.argv[1:]}
with open(os.path.join(out, f"rank{acc.process_index}.json"), "w") as f:
    json.dump(rec, f)
acc.end_training()
if os.environ.get("PROBE_FAIL_RANK") == str(acc.process_index):
    sys.exit(7)
"""

# Stands in for mcts_annotate.py / bon_rerank.py: records its rank, arguments and GPU.
WORKER_PROBE = """\
import json, os, sys
rank = int(os.environ["SLURM_PROCID"])
out = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("output_dir="))
rec = {"rank": rank, "ntasks": int(os.environ["SLURM_NTASKS"]), "node": os.environ["SLURMD_NODENAME"],
       "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"), "cpus": os.environ.get("SLURM_CPUS_PER_TASK"),
       "argv": sys.argv[1:]}
with open(os.path.join(out, f"worker{rank}.json"), "w") as f:
    json.dump(rec, f)
print("worker", rank, "done")
sys.exit(5 if os.environ.get("PROBE_FAIL_RANK") == str(rank) else 0)
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    if sys.platform != "linux":
        pytest.skip("the loopback Slurm cluster needs Linux")
    if os.geteuid() != 0:
        pytest.skip("the loopback Slurm cluster runs its daemons as root; run as root (CI does)")
    reason = ensure_debian_packages(SLURM_BINARIES, APT_PACKAGES)
    if reason:
        pytest.skip(reason)
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as c:
        yield c


# One worker per node with 1 CPU: the nodes here have 2, below the worker scripts' default of 8.
TWO_WORKERS = ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1"]


def submit(
    cluster: SlurmCluster,
    script: str,
    sbatch_args: list[str],
    env: dict[str, str],
    tmp: Path,
    args: list[str] = (),
    timeout: float = 300,
) -> tuple[JobResult, str]:
    """Submit launch/slurm/SCRIPT with `sbatch --wait`; returns (result, the job's own output).

    Each job rendezvouses on a port the kernel picked (train.sbatch's default, 20000 + job id, is
    the same in every run of this cluster, and another run on the machine may hold it). A job still
    running after `timeout` is cancelled and the test fails with its output and rank logs.
    """
    out = tmp / f"{script}.out"

    def job_output() -> str:
        return out.read_text(errors="replace") if out.exists() else "(no job output)"

    try:
        res = cluster.sbatch(
            ["--time=10", f"--output={out}", *sbatch_args, str(SLURM_DIR / script), *args],
            env={**JOB_ENV, "MAIN_PROCESS_PORT": str(free_port()), **env},
            timeout=timeout,
            cwd=tmp,
        )
    except subprocess.TimeoutExpired as e:
        said = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
        timed_out = JobResult(-1, said, "")
        job = re.search(r"Submitted batch job (\d+)", timed_out.stdout)
        if job:
            cluster.run(["scancel", job.group(1)], timeout=30)
        log_dir = Path(env["LOG_DIR"]) if "LOG_DIR" in env else None
        pytest.fail(
            f"{script} still running after {timeout:.0f} s, cancelled:\n{report(timed_out, job_output(), log_dir)}"
        )
    return res, job_output()


def report(res: JobResult, job_out: str, log_dir: Path | None = None) -> str:
    """Everything a failed assertion should show: sbatch's answer, the job output, rank logs."""
    parts = [f"sbatch rc={res.returncode}\n{res.stdout}{res.stderr}", f"--- job output\n{job_out[-3000:]}"]
    for log in sorted(log_dir.glob("*.log")) if log_dir and log_dir.is_dir() else []:
        parts.append(f"--- {log.name}\n{log.read_text(errors='replace')[-2500:]}")
    return "\n".join(parts)


# -- the cluster itself -------------------------------------------------------------------------


def test_two_nodes_answer_srun(cluster):
    res = cluster.run(
        ["srun", "--nodes=2", "--ntasks-per-node=1", "--label", "printenv", "SLURMD_NODENAME"], timeout=60
    )
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.split()) == ["0:", "1:", "n1", "n2"]


def test_one_gpu_per_task(cluster, tmp_path):
    # The binding annotate/bon rely on: --gpus-per-task=1 gives each task its own device.
    script = tmp_path / "bind.sh"
    script.write_text("#!/bin/bash\nsrun bash -c 'echo $SLURMD_NODENAME:$CUDA_VISIBLE_DEVICES'\n")
    res = cluster.sbatch(
        ["--nodes=2", "--ntasks-per-node=2", "--gpus-per-task=1", f"--output={tmp_path}/b.out", str(script)], timeout=60
    )
    assert res.returncode == 0, res.stderr
    assert sorted((tmp_path / "b.out").read_text().split()) == ["n1:0", "n1:1", "n2:0", "n2:1"]


def test_failing_job_exit_code_comes_back(cluster, tmp_path):
    script = tmp_path / "fail.sh"
    script.write_text("#!/bin/bash\nsrun --nodes=2 true\nexit 3\n")
    res = cluster.sbatch(["--nodes=2", f"--output={tmp_path}/f.out", str(script)], timeout=60)
    assert res.returncode == 3, res


def test_impossible_job_is_refused_not_left_pending(cluster, tmp_path):
    script = tmp_path / "big.sh"
    script.write_text("#!/bin/bash\ntrue\n")
    res = cluster.sbatch(["--nodes=3", f"--output={tmp_path}/big.out", str(script)], timeout=30)
    assert res.returncode != 0 and "Node count specification invalid" in res.stderr


# -- train.sbatch -------------------------------------------------------------------------------


def _probe_job(tmp_path: Path, config_text: str, **env: str) -> tuple[Path, dict[str, str]]:
    """A config with `config_text` and the environment that runs TRAIN_PROBE through train.sbatch
    (DDP, logs in tmp_path/logs, each rank's probe JSON in tmp_path), plus `env`."""
    probe = tmp_path / "probe.py"
    probe.write_text(TRAIN_PROBE)
    config = tmp_path / "cfg.yaml"
    config.write_text(config_text)
    return config, {
        "RECIPE": str(probe),
        "CONFIG": str(config),
        "ACCEL_CONFIG": "launch/accelerate/ddp.yaml",
        "LOG_DIR": str(tmp_path / "logs"),
        "PROBE_OUT": str(tmp_path),
        **env,
    }


def test_train_sbatch_runs_one_process_group_across_two_nodes(cluster, tmp_path):
    config, env = _probe_job(tmp_path, "x: 1\n", OVERRIDES="a.b=1")
    logs = tmp_path / "logs"
    res, out = submit(cluster, "train.sbatch", ["--nodes=2", "--gpus-per-node=1"], env, tmp_path, args=["c=2"])
    assert res.returncode == 0, report(res, out, logs)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2]
    assert {r["node"] for r in ranks} == {"n1", "n2"}  # one process per node, not two on one
    assert all(r["type"] == "DistributedType.MULTI_CPU" and r["sum"] == 3.0 for r in ranks)
    assert ranks[0]["argv"] == ["--config", str(config), "resume_from_checkpoint=latest", "a.b=1", "c=2"]
    assert sorted(p.name for p in logs.glob("*.log")) == [
        f"mmprm-train-{job}-node{n}.log" for job in [_job_id(res)] for n in (0, 1)
    ]
    assert "on 2 node(s) x 1 = 2 processes" in out


def test_train_sbatch_defaults_resume_and_scratch_output_but_user_overrides_win(cluster, tmp_path):
    scratch, ckpt = tmp_path / "scratch", tmp_path / "ckpt"
    config, env = _probe_job(tmp_path, "output_dir: runs/x\n", SCRATCH=str(scratch))
    res, out = submit(
        cluster,
        "train.sbatch",
        ["--nodes=1", "--gpus-per-node=1"],
        env,
        tmp_path,
        args=[f"resume_from_checkpoint={ckpt}"],
    )
    assert res.returncode == 0, report(res, out, tmp_path / "logs")
    argv = json.loads((tmp_path / "rank0.json").read_text())["argv"]
    defaults = ["resume_from_checkpoint=latest", f"output_dir={scratch}/runs/x"]
    assert argv == ["--config", str(config), *defaults, f"resume_from_checkpoint={ckpt}"]
    # the recipe's own parser: the last override of a key wins, so the user's resume path is kept
    cfg = load_config(_RunDirs, *parse_cli(argv))
    assert (cfg.resume_from_checkpoint, cfg.output_dir) == (str(ckpt), f"{scratch}/runs/x")


@dataclasses.dataclass
class _RunDirs:
    """The two keys train.sbatch sets by default, as the recipes declare them."""

    output_dir: str = "runs/prm"
    resume_from_checkpoint: str | None = None


def test_train_sbatch_fails_when_one_rank_fails(cluster, tmp_path):
    _, env = _probe_job(tmp_path, "x: 1\n", PROBE_FAIL_RANK="1")
    res, out = submit(cluster, "train.sbatch", ["--nodes=2", "--gpus-per-node=1"], env, tmp_path)
    assert res.returncode != 0, report(res, out, tmp_path / "logs")
    assert "train.sbatch: done" not in out


def test_train_sbatch_names_a_missing_config(cluster, tmp_path):
    env = {"CONFIG": str(tmp_path / "nope.yaml"), "ACCEL_CONFIG": "launch/accelerate/ddp.yaml"}
    res, out = submit(cluster, "train.sbatch", ["--nodes=1", "--gpus-per-node=1"], env, tmp_path)
    assert res.returncode == 2
    assert f"train.sbatch: {tmp_path / 'nope.yaml'} not found" in out


# -- annotate.sbatch / bon_rerank.sbatch with probe workers -------------------------------------


@pytest.mark.parametrize("script", ["annotate.sbatch", "bon_rerank.sbatch"])
def test_worker_scripts_give_each_rank_its_share_and_gpu(cluster, tmp_path, script):
    probe = tmp_path / "worker.py"
    probe.write_text(WORKER_PROBE)
    config = tmp_path / "cfg.yaml"
    config.write_text("x: 1\n")
    out_dir, logs = tmp_path / "out", tmp_path / "logs"
    env = {"RECIPE": str(probe), "CONFIG": str(config), "OUTPUT_DIR": str(out_dir), "LOG_DIR": str(logs), "MERGE": "0"}
    # the nodes here have 2 CPUs, below the scripts' default of 8 per worker: the flag overrides it
    res, out = submit(
        cluster, script, ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=2"], env, tmp_path, args=["k=v"]
    )
    assert res.returncode == 0, report(res, out, logs)
    workers = [json.loads((out_dir / f"worker{r}.json").read_text()) for r in (0, 1)]
    assert [w["ntasks"] for w in workers] == [2, 2]
    assert {w["node"] for w in workers} == {"n1", "n2"} and all(w["gpus"] == "0" for w in workers)
    assert all(w["cpus"] == "2" for w in workers)  # srun handed the job's --cpus-per-task to each worker
    for r, w in enumerate(workers):
        expected = ["--config", str(config), f"output_dir={out_dir}"]
        if script == "bon_rerank.sbatch":
            expected += [f"shard.index={r}", "shard.count=2"]
        assert w["argv"] == expected + ["k=v"]
    assert len(list(logs.glob("*-rank[01].log"))) == 2


def test_annotate_sbatch_failed_worker_fails_job_and_says_resume(cluster, tmp_path):
    probe = tmp_path / "worker.py"
    probe.write_text(WORKER_PROBE)
    config = tmp_path / "cfg.yaml"
    config.write_text("x: 1\n")
    env = {
        "RECIPE": str(probe),
        "CONFIG": str(config),
        "OUTPUT_DIR": str(tmp_path / "out"),
        "LOG_DIR": str(tmp_path / "logs"),
        "PROBE_FAIL_RANK": "1",
    }
    res, out = submit(cluster, "annotate.sbatch", TWO_WORKERS, env, tmp_path)
    assert res.returncode == 1, report(res, out, tmp_path / "logs")
    assert "submit the same command again to resume" in out
    # The healthy worker still finished its share (no --kill-on-bad-exit), so a rerun redoes less.
    assert (tmp_path / "out" / "worker0.json").exists()


# -- the real recipes through the same files (on as soon as each recipe exists) -----------------


def _need(*paths: str) -> None:
    for p in paths:
        if not (REPO / p).exists():
            pytest.skip(f"recipe {p} not present yet")


def _job_id(res: JobResult) -> str:
    return re.search(r"Submitted batch job (\d+)", res.stdout).group(1)


@pytest.fixture(scope="module")
def tiny_inputs(tmp_path_factory: pytest.TempPathFactory):
    """prepare(config) -> a work dir holding the inputs that tiny config's header says to make.

    Runs the commands listed after "Make the inputs first:" (once each across configs, so the
    shared tiny model is built once); jobs then run with MMPRM_ROOT set to that dir.
    """
    workdir = tmp_path_factory.mktemp("tiny_inputs")
    for name in ("recipes", "launch"):  # headers name repo paths (recipes/prm_train.py ...)
        (workdir / name).symlink_to(REPO / name)
    done: set[str] = set()

    def prepare(config: Path) -> Path:
        for cmd in _header_commands(config):
            if " ".join(cmd) in done:
                continue
            argv = [sys.executable, *cmd[1:]] if cmd[0] == "python" else cmd
            res = subprocess.run(
                argv, cwd=workdir, capture_output=True, text=True, timeout=300, env={**os.environ, **JOB_ENV}
            )
            assert res.returncode == 0, f"{config} header command {' '.join(cmd)!r} failed:\n{res.stderr[-2000:]}"
            done.add(" ".join(cmd))
        return workdir

    return prepare


def _header_commands(config: Path) -> list[list[str]]:
    """The commands a config's header comment lists after "Make the inputs first:"."""
    header = []
    for line in config.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line.lstrip("#").strip())
    start = next((i for i, text in enumerate(header) if "Make the inputs first" in text), None)
    assert start is not None, f"{config}: header has no 'Make the inputs first:' block"
    commands, current = [], ""
    for text in header[start + 1 :]:
        if not current and not text.startswith(("mmprm ", "python ")):
            break  # the command block ends at the first line that is not a command
        current += text.rstrip("\\").strip() + " "
        if not text.endswith("\\"):
            commands.append(current.split())
            current = ""
    assert commands, f"{config}: no commands after 'Make the inputs first:'"
    return commands


def test_prm_train_on_two_nodes(cluster, tmp_path, tiny_models):
    _need("recipes/prm_train.py", "tests/toy_data.py")
    from toy_data import write_toy_prm_data

    train = write_toy_prm_data(tmp_path / "data", 16, 0)
    ev = write_toy_prm_data(tmp_path / "data", 8, 1, name="eval.jsonl")
    config = tmp_path / "prm.yaml"
    config.write_text(
        f"model:\n  name_or_path: {tiny_models('qwen2_vl')}\ndata:\n  train_file: {train}\n"
        f"  eval_file: {ev}\n  max_length: 256\n"
    )
    out_dir, logs = tmp_path / "prm", tmp_path / "logs"
    overrides = (
        f"output_dir={out_dir} train.max_steps=4 train.batch_size=2 train.log_every=1 "
        "train.eval_every=4 train.save_every=4 train.report_to=none"
    )
    env = {
        "RECIPE": "recipes/prm_train.py",
        "CONFIG": str(config),
        "ACCEL_CONFIG": "launch/accelerate/ddp.yaml",
        "LOG_DIR": str(logs),
        "OVERRIDES": overrides,
    }
    res, out = submit(cluster, "train.sbatch", ["--nodes=2", "--gpus-per-node=1"], env, tmp_path)
    assert res.returncode == 0, report(res, out, logs)
    assert (out_dir / "mmprm_prm.json").exists()
    # accelerate saves one RNG state per process: two files means one 2-process group.
    states = sorted(p.name for p in (out_dir / "checkpoints" / "step_4").glob("random_states_*.pkl"))
    assert states == ["random_states_0.pkl", "random_states_1.pkl"], report(res, out, logs)
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "train"] == [1, 2, 3, 4]


def test_prm_train_requeued_at_time_limit_resumes(cluster, tmp_path, tiny_models):
    """The time-limit notice (USR1 to the batch shell) makes the run save and the job requeue; the
    rerun resumes from the step the notice came in and finishes."""
    _need("recipes/prm_train.py", "tests/toy_data.py")
    from toy_data import write_toy_prm_data

    train = write_toy_prm_data(tmp_path / "data", 16, 0)
    config = tmp_path / "prm.yaml"
    config.write_text(
        f"model:\n  name_or_path: {tiny_models('qwen2_vl')}\ndata:\n  train_file: {train}\n  max_length: 256\n"
    )
    out_dir, logs, job_out = tmp_path / "prm", tmp_path / "logs", tmp_path / "train.sbatch.out"
    # Enough steps (tens of seconds here) that the first run is still training when the notice
    # comes right after its first checkpoint.
    steps = 400
    overrides = (
        f"output_dir={out_dir} train.max_steps={steps} train.batch_size=2 train.log_every=1 "
        "train.save_every=5 train.keep_checkpoints=2 train.report_to=none"
    )
    env = {
        **JOB_ENV,
        "MAIN_PROCESS_PORT": str(free_port()),
        "RECIPE": "recipes/prm_train.py",
        "CONFIG": str(config),
        "ACCEL_CONFIG": "launch/accelerate/ddp.yaml",
        "LOG_DIR": str(logs),
        "OVERRIDES": overrides,
    }
    sub = cluster.run(
        [
            "sbatch",
            "--parsable",
            "--time=10",
            "--nodes=2",
            "--gpus-per-node=1",
            f"--output={job_out}",
            str(SLURM_DIR / "train.sbatch"),
        ],
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]

    def job_text() -> str:
        return job_out.read_text(errors="replace") if job_out.exists() else "(no job output)"

    def wait_for(check, what: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                cluster.run(["scancel", job], timeout=30)
                pytest.fail(f"{what} not seen after {timeout:.0f} s:\n{report(sub, job_text(), logs)}")
            time.sleep(0.2)

    wait_for(lambda: any((out_dir / "checkpoints").glob(f"step_*/{CHECKPOINT_DONE}")), "a first checkpoint")
    # What --signal=B:USR1@300 sends before the time limit: USR1 to the batch shell only.
    sig = cluster.run(["scancel", "--batch", "--signal=USR1", job], timeout=30)
    assert sig.returncode == 0, sig.stderr
    wait_for(lambda: "train.sbatch: done" in job_text(), "the requeued run's end")
    wait_for(
        lambda: cluster.run(["squeue", "-h", "-j", job], timeout=30).stdout.strip() == "", "the job leaving squeue"
    )

    text = job_text()
    assert f"requeued job {job}" in text and "restart 1," in text, report(sub, text, logs)
    node0 = (logs / f"mmprm-train-{job}-node0.log").read_text(errors="replace")  # both runs: appended
    resumed = re.search(r"resumed from (\S+) at step (\d+)", node0)
    assert resumed, report(sub, text, logs)
    step = int(resumed.group(2))
    assert 5 <= step < steps and Path(resumed.group(1)).name == f"step_{step}"
    # the notice reached the training processes: they saved the step they were on, none is redone
    stopped = re.search(r"stopping at step (\d+) on the save notice", node0)
    assert stopped and int(stopped.group(1)) == step, report(sub, text, logs)
    assert (out_dir / "mmprm_prm.json").exists(), report(sub, text, logs)
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "train"] == list(range(1, steps + 1))


def test_policy_sft_on_two_nodes(cluster, tmp_path, tiny_inputs):
    _need("recipes/policy_sft.py", "recipes/configs/tiny/policy_sft.yaml")
    config = REPO / "recipes" / "configs" / "tiny" / "policy_sft.yaml"
    workdir = tiny_inputs(config)
    out_dir, logs = tmp_path / "policy", tmp_path / "logs"
    overrides = (
        f"output_dir={out_dir} train.max_steps=2 train.batch_size=2 train.eval_every=2 "
        "train.save_every=2 train.eval_generations=2 train.max_new_tokens=8 train.report_to=none"
    )
    env = {
        "RECIPE": str(REPO / "recipes" / "policy_sft.py"),
        "CONFIG": str(config),
        "ACCEL_CONFIG": str(REPO / "launch" / "accelerate" / "ddp.yaml"),
        "LOG_DIR": str(logs),
        "OVERRIDES": overrides,
        "MMPRM_ROOT": str(workdir),
    }
    res, out = submit(cluster, "train.sbatch", ["--nodes=2", "--gpus-per-node=1"], env, tmp_path)
    assert res.returncode == 0, report(res, out, logs)
    states = sorted(p.name for p in (out_dir / "checkpoints" / "step_2").glob("random_states_*.pkl"))
    assert states == ["random_states_0.pkl", "random_states_1.pkl"], report(res, out, logs)


def test_mcts_annotate_two_workers_merge_and_resume(cluster, tmp_path, tiny_inputs):
    _need("recipes/mcts_annotate.py", "recipes/configs/tiny/mcts_annotate.yaml")
    config = REPO / "recipes" / "configs" / "tiny" / "mcts_annotate.yaml"
    workdir = tiny_inputs(config)
    out_dir, logs = tmp_path / "annotate", tmp_path / "logs"
    env = {
        "RECIPE": str(REPO / "recipes" / "mcts_annotate.py"),
        "CONFIG": str(config),
        "OUTPUT_DIR": str(out_dir),
        "LOG_DIR": str(logs),
        "MMPRM_ROOT": str(workdir),
    }
    res, out = submit(cluster, "annotate.sbatch", TWO_WORKERS, env, tmp_path)
    assert res.returncode == 0, report(res, out, logs)
    from mmprm.annotate.engine import tree_file_name

    shards = [out_dir / tree_file_name(r, 2) for r in (0, 1)]
    assert all(s.exists() and s.read_text().strip() for s in shards), report(res, out, logs)
    merged = [json.loads(line) for line in (out_dir / "trees.jsonl").read_text().splitlines()]
    ids = [m["id"] for m in merged]
    assert len(ids) == len(set(ids)) == sum(len(s.read_text().splitlines()) for s in shards)
    # Resume: the same command again finds every problem done and adds nothing.
    res, out = submit(cluster, "annotate.sbatch", TWO_WORKERS, env, tmp_path)
    assert res.returncode == 0, report(res, out, logs)
    again = [json.loads(line)["id"] for line in (out_dir / "trees.jsonl").read_text().splitlines()]
    assert sorted(again) == sorted(ids)


def test_bon_rerank_two_shards_and_merge(cluster, tmp_path, tiny_inputs):
    _need("recipes/bon_rerank.py", "recipes/configs/tiny/bon_rerank.yaml")
    config = REPO / "recipes" / "configs" / "tiny" / "bon_rerank.yaml"
    workdir = tiny_inputs(config)
    out_dir, logs = tmp_path / "bon", tmp_path / "logs"
    env = {
        "RECIPE": str(REPO / "recipes" / "bon_rerank.py"),
        "CONFIG": str(config),
        "OUTPUT_DIR": str(out_dir),
        "LOG_DIR": str(logs),
        "MMPRM_ROOT": str(workdir),
    }
    res, out = submit(cluster, "bon_rerank.sbatch", TWO_WORKERS, env, tmp_path)
    assert res.returncode == 0, report(res, out, logs)
    assert len(list(logs.glob("*-rank[01].log"))) == 2
    from mmprm.rerank.shards import shard_path

    shards = [shard_path(out_dir, r, 2) for r in (0, 1)]
    assert all(s.exists() for s in shards), report(res, out, logs)
    scored = (out_dir / "scored.jsonl").read_text().splitlines()
    assert len(scored) == sum(len(s.read_text().splitlines()) for s in shards) > 0
    assert isinstance(json.loads((out_dir / "report.json").read_text()), dict)
