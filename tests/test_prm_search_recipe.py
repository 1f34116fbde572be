"""recipes/prm_search.py end to end on a tiny VLM toy policy: kill -9 and resume, shards, report."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "prm_search.py"
YAML = REPO / "recipes" / "configs" / "tiny" / "prm_search.yaml"
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
       "PYTHONPATH": str(REPO)}


def run(args, timeout=600):
    res = subprocess.run([sys.executable, str(RECIPE), *args], capture_output=True, text=True, cwd=REPO, env=ENV,
                         timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-4000:]
    return res


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def inputs(tiny_models, tmp_path_factory):
    from mmprm.annotate.simulated import train_toy_policy, write_toy_problems
    from mmprm.models.loading import load_backbone
    from mmprm.models.prm import PRMSpec, build_prm, save_prm

    root = tmp_path_factory.mktemp("prm_search")
    policy = train_toy_policy(str(tiny_models("qwen2_vl")), str(root / "policy"), steps=150)
    backbone, processor = load_backbone(policy)
    prm = save_prm(build_prm(backbone, processor, PRMSpec()), processor, root / "prm")
    return policy, prm, write_toy_problems(str(root / "problems"), n=6)


def test_bad_config_fails_before_models_load(tmp_path):
    res = subprocess.run([sys.executable, str(RECIPE), "--config", str(YAML), "searches=[{method: beam, "
                          "aggregator: mean}]"], capture_output=True, text=True, cwd=REPO, env=ENV, timeout=120)
    assert res.returncode == 2 and "aggregator" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.slow
def test_kill_resume_shards_and_report(inputs, tmp_path):
    policy, prm, problems = inputs
    out = tmp_path / "out"
    base = ["--config", str(YAML), f"policy.path={policy}", f"prm={prm}", f"problems_file={problems}",
            f"output_dir={out}", "batch_problems=1", "bon.n=[2,4]", "report.resamples=200",
            "searches=[{method: beam, width: 2, expansions: 2, max_steps: 5}, {method: dvts, width: 2, expansions: 2, max_steps: 5}]"]
    beam = out / "beam_W2xM2" / "results.shard0-of-1.jsonl"

    # kill -9 once the first problem is written, then rerun the same command
    proc = subprocess.Popen([sys.executable, str(RECIPE), *base], cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and (not beam.exists() or not beam.read_text().strip()):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with open(beam, "a") as f:
        f.write('{"id": "toy-torn", "answ')  # a row torn mid-write, as a kill during the write leaves it
    done_before = [json.loads(x)["id"] for x in beam.read_text().splitlines()[:-1]]
    assert 1 <= len(done_before) < 6
    res = run(base)
    assert f"{len(done_before)} problems already done" in res.stdout and "torn last row" in res.stderr
    rows = lines(beam)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == 6 and ids[: len(done_before)] == done_before

    # what a user opens: per-problem rows with the whole tree, the report, the plot, tree pictures
    from mmprm.search.core import SearchTree

    for r in rows:
        tree = SearchTree.from_json(r["tree"])
        assert tree.chosen is not None and r["stats"]["generated_tokens"] > 0
        if r["complete"]:
            assert r["steps"] and len(r["step_probs"]) == len(r["steps"])
            assert r["correct"] == (r["answer"] == "5")  # the toy question's answer
    report = json.loads((out / "report.json").read_text())
    assert report["num_problems"] == 6
    assert {"beam W2xM2", "dvts W2xM2", "Best-of-N (PRM min) N=4", "majority vote N=2"} <= set(report["methods"])
    beam_acc = sum(r["correct"] for r in rows) / 6
    assert report["methods"]["beam W2xM2"]["mean"] == pytest.approx(beam_acc)
    assert [m["search"] for m in report["matched"]] == ["beam W2xM2", "dvts W2xM2"]
    assert (out / "search_vs_bon.png").stat().st_size > 5000 and "Equal budget" in (out / "report.md").read_text()
    assert len(list((out / "trees").glob("*.png"))) == 2
    bon = lines(out / "bon" / "candidates.shard0-of-1.jsonl")
    assert len(bon) == 6 and all(len(r["candidates"]) == 4 for r in bon)

    # a rerun after completion searches nothing and duplicates nothing
    res = run(base)
    assert "6 problems already done, 0 to search" in res.stdout and len(lines(beam)) == 6

    # two shards into another folder: the first leaves no report, the second writes it
    sharded = [a if not a.startswith("output_dir=") else f"output_dir={tmp_path / 'sharded'}" for a in base]
    res = run([*sharded, "shard.index=0", "shard.count=2"])
    assert "report is written when all 2 shards are" in res.stdout
    assert not (tmp_path / "sharded" / "report.json").exists()
    run([*sharded, "shard.index=1", "shard.count=2"])
    assert json.loads((tmp_path / "sharded" / "report.json").read_text())["num_problems"] == 6
