"""recipes/mcts_annotate.py: config, fail-fast errors, and the real entry point end to end
(tiny VLM policy through the HF backend, kill -9 + rerun, output accepted by prm_train)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mmprm.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "mcts_annotate.py"
YAML = REPO / "recipes" / "configs" / "tiny" / "mcts_annotate.yaml"
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def recipe_module():
    spec = importlib.util.spec_from_file_location("mcts_annotate_recipe", RECIPE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the file executes
    spec.loader.exec_module(mod)
    return mod


def test_shipped_tiny_yaml_parses_with_overrides():
    mod = recipe_module()
    cfg = load_config(
        mod.AnnotateConfig, YAML, ["search.max_rollouts=64", "engine.concurrency=3", "rank=1", "world_size=2"]
    )
    assert cfg.policy.path and cfg.data.problems_file and cfg.output_dir
    assert cfg.search.max_rollouts == 64 and cfg.engine.concurrency == 3 and (cfg.rank, cfg.world_size) == (1, 2)
    defaults = mod.AnnotateConfig().search
    assert (defaults.c_puct, defaults.alpha, defaults.beta, defaults.length_scale) == (0.125, 0.5, 0.9, 2000.0)
    assert (defaults.rollouts_per_estimate, defaults.max_searches, defaults.max_rollouts) == (16, 200, 1000)
    sampling = mod.AnnotateConfig().policy.sampling
    assert (sampling.temperature, sampling.top_k, sampling.top_p) == (1.0, 50, 0.9)
    # MM-PRM's cap (a rollout cut there is unfinished, never an error label); tiny configs set their own
    assert sampling.max_new_tokens == 4096 and cfg.policy.sampling.max_new_tokens == 128
    with pytest.raises(ConfigError, match="search.max_rollouts .* must be >= search.rollouts_per_estimate"):
        load_config(mod.AnnotateConfig, YAML, ["search.max_rollouts=4"])
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(mod.AnnotateConfig, YAML, ["search.cpuct=1"])
    assert mod.AnnotateConfig().engine.continuous is None  # null: on for vllm, off for hf
    assert load_config(mod.AnnotateConfig, YAML, ["policy.backend=vllm", "engine.continuous=true"]).engine.continuous
    with pytest.raises(ConfigError, match="engine.continuous=true needs policy.backend=vllm"):
        load_config(mod.AnnotateConfig, YAML, ["policy.backend=hf", "engine.continuous=true"])
    assert mod.AnnotateConfig().engine.request_timeout_s == 1800.0
    with pytest.raises(ConfigError, match=r"engine.request_timeout_s: 0(\.0)? must be > 0 seconds"):
        load_config(mod.AnnotateConfig, YAML, ["engine.request_timeout_s=0"])


def test_bad_inputs_fail_before_any_model_loads(tmp_path, capsys):
    mod = recipe_module()
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"id": "1", "question": "Q"}\n')
    assert mod.main(["--config", str(YAML), f"data.problems_file={bad}", f"output_dir={tmp_path}/o"]) == 2
    assert f"{bad}:1: id=1: answer: missing" in capsys.readouterr().err
    assert mod.main(["--config", str(YAML), "policy.path="]) == 2
    assert "policy.path is required" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_problem_draws_the_same_rollouts_on_one_rank_or_two(tmp_path):
    """vLLM seeds each probe by its problem and place (probe_seed), so the recipe gives every rank the
    same base seed: 1 and 2 ranks write the same records. Run through the recipe's sampling, engine,
    verifier and tree files, on the simulated policy (seeded per request as vLLM is)."""
    from mmprm.annotate.engine import TreeFile, iter_records, shard, tree_file_name
    from mmprm.annotate.simulated import GOLD, SimulatedPolicy, random_problems
    from mmprm.data.problems import Problem

    mod = recipe_module()
    cfg = load_config(mod.AnnotateConfig, YAML, ["policy.backend=vllm", "engine.concurrency=2"])
    sims = random_problems(6, seed=5)
    problems = [Problem(pid, "q", GOLD) for pid in sims]

    def records(world: int) -> dict[str, dict]:
        out = tmp_path / f"world{world}"
        for rank in range(world):
            policy = SimulatedPolicy(sims, seed=mod.rank_sampling(cfg, rank).seed)
            engine = mod.make_engine(cfg, policy, mod.make_verifier(cfg, out, rank))
            trees = TreeFile(out / tree_file_name(rank, world), scan_dir=out)
            try:
                mod.annotate(engine, shard(problems, rank, world), trees, rank)
            finally:
                trees.close()
        recs = [r for f in sorted(out.glob("trees.rank*.jsonl")) for r in iter_records(f)]
        return {r["id"]: {k: v for k, v in r.items() if k != "seconds"} for r in recs}

    one, two = records(1), records(2)
    assert len(one) == len(problems) and one == two
    assert {r["status"] for r in one.values()} == {"annotated"} and sum(
        r["stats"]["rollouts"] for r in one.values()
    ) > 6 * 8


def test_hf_ranks_sample_their_own_streams():
    """HF generate seeds whole calls, not probes: there ranks keep apart seed streams."""
    mod = recipe_module()
    cfg = load_config(mod.AnnotateConfig, YAML, [])
    assert len({mod.rank_sampling(cfg, rank).seed for rank in range(4)}) == 4


def _run(args, **kw):
    return subprocess.run(
        [sys.executable, str(RECIPE), *args], capture_output=True, text=True, cwd=REPO, env=ENV, timeout=600, **kw
    )


@pytest.mark.slow
def test_tiny_vlm_end_to_end_kill_resume_and_prm_train_accepts_the_output(tmp_path):
    from mmprm.annotate.simulated import train_toy_policy, write_toy_problems
    from mmprm.models.tiny import build_tiny_model

    base = build_tiny_model("qwen2_vl", tmp_path / "tiny")
    policy = train_toy_policy(str(base), str(tmp_path / "policy"), steps=150)
    problems = write_toy_problems(str(tmp_path / "problems"), n=6)
    out = tmp_path / "out"
    args = [
        "--config",
        str(YAML),
        f"policy.path={policy}",
        f"data.problems_file={problems}",
        f"output_dir={out}",
        "engine.concurrency=2",
    ]
    trees = out / "trees.rank0-of-1.jsonl"

    # kill -9 once the first problem is committed, then rerun the very same command
    proc = subprocess.Popen(
        [sys.executable, str(RECIPE), *args], cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and (not trees.exists() or not trees.read_text().strip()):
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = [json.loads(line)["id"] for line in trees.read_text().splitlines()]
    assert 1 <= len(done_before) < 6
    res = _run(args)
    assert res.returncode == 0, res.stderr[-4000:]
    assert f"{len(done_before)} already done" in res.stderr
    records = [json.loads(line) for line in trees.read_text().splitlines()]
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)) == 6 and ids[: len(done_before)] == done_before
    assert {r["status"] for r in records} <= {"annotated", "screened_all_correct", "screened_all_wrong"}
    annotated = [r for r in records if r["status"] == "annotated"]
    assert annotated and all(r["first_errors"] for r in annotated)

    # merged trees, PRM data and the report
    assert len((out / "trees.jsonl").read_text().splitlines()) == 6
    report = json.loads((out / "export_report.json").read_text())
    assert report["paths"] > 0 and report["negative_paths"] > 0 and (out / "export_report.png").exists()
    summary = json.loads((out / "summary.rank0-of-1.json").read_text())
    assert summary["engine"]["rollouts_per_s"] > 0 and summary["generated_tokens"] > 0

    # a rerun after completion does nothing and duplicates nothing
    res = _run(args)
    assert res.returncode == 0 and "6 already done, 0 to annotate" in res.stderr
    assert len(trees.read_text().splitlines()) == 6

    # a gold answer edited since its tree was made: refused, not skipped as done with old labels
    rows = [json.loads(line) for line in Path(problems).read_text().splitlines()]
    rows[2]["answer"] = rows[2]["answer"] + "0"
    edited = Path(problems).with_name("edited.jsonl")  # beside it: image paths are relative
    edited.write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = trees.read_text()
    res = _run([*args[:3], f"data.problems_file={edited}", *args[4:]])
    assert res.returncode == 2 and "1 problem(s) changed" in res.stderr and f"id={rows[2]['id']}" in res.stderr
    assert trees.read_text() == before and json.loads((out / "config.json").read_text())["data"]["problems_file"] == (
        str(problems)
    )

    # a judge outage stops the run (exit 3) with transient records; the next run retries them
    out2 = tmp_path / "outage"
    judged = [
        *args[:-2],
        f"output_dir={out2}",
        "engine.concurrency=2",
        "verify.judge=true",
        "verify.judge_chat.url=http://127.0.0.1:9/v1",
        "verify.judge_chat.model=judge",
        "verify.judge_chat.max_retries=0",
        "engine.max_consecutive_failures=1",
    ]
    res = _run(judged)
    assert res.returncode == 3 and "problems in a row failed with transient errors" in res.stderr, res.stderr[-3000:]
    failed = [json.loads(line) for line in (out2 / "trees.rank0-of-1.jsonl").read_text().splitlines()]
    assert [r["error_kind"] for r in failed if r["status"] == "error"] == ["transient"]
    assert "EndpointUnavailable" in failed[-1]["message"] and not (out2 / "trees.jsonl").exists()
    res = _run([*args[:-2], f"output_dir={out2}", "engine.concurrency=2"])
    assert res.returncode == 0, res.stderr[-3000:]
    merged = [json.loads(line) for line in (out2 / "trees.jsonl").read_text().splitlines()]
    assert len(merged) == 6 and not any(r["status"] == "error" for r in merged)

    # the acceptance check: prm_train trains on the exported rows
    prm = subprocess.run(
        [
            sys.executable,
            str(REPO / "recipes" / "prm_train.py"),
            f"model.name_or_path={base}",
            f"data.train_file={out / 'prm_data.jsonl'}",
            f"data.eval_file={out / 'prm_data.jsonl'}",
            f"output_dir={tmp_path / 'prm'}",
            "train.max_steps=2",
            "train.batch_size=4",
            "train.eval_every=2",
            "train.save_every=2",
            "data.max_length=256",
            "train.report_to=none",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=ENV,
        timeout=600,
    )
    assert prm.returncode == 0, prm.stderr[-4000:]
    assert (tmp_path / "prm" / "model.safetensors").exists()


def test_a_second_worker_on_the_same_output_dir_and_rank_stops_at_once(tmp_path, capsys):
    from mmprm.annotate.engine import TreeFile, tree_file_name

    mod = recipe_module()
    problems = tmp_path / "p.jsonl"
    problems.write_text(
        "".join(json.dumps({"id": str(i), "question": "1 + 1?", "answer": "2"}) + "\n" for i in range(4))
    )
    out = tmp_path / "out"
    policy = tmp_path / "policy"  # passes the path check; the lock stops the run before any weight loads
    policy.mkdir()
    (policy / "config.json").write_text("{}")
    first = TreeFile(out / tree_file_name(0, 1))  # a live worker (a double submission, a requeue)
    try:
        code = mod.main(
            [
                "--config",
                str(YAML),
                f"data.problems_file={problems}",
                f"output_dir={out}",
                f"policy.path={policy}",
            ]
        )
    finally:
        first.close()
    err = capsys.readouterr().err
    assert code == 3 and f"in use by another worker (pid {os.getpid()} on " in err
    assert (out / tree_file_name(0, 1)).read_text() == ""  # it annotated nothing
