"""The demo pipeline, reduced: every stage is the real recipe; each output is checked, and the
trained PRM must rank steps better than an untrained one against exact ground truth."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_reduced_demo_pipeline(tmp_path):
    from mmprm.data.schema import load_examples, read_jsonl
    from mmprm.rerank.report import METHODS

    out = tmp_path / "demo"
    # smaller than `make demo` (2000/60/80 problems, N=4, 900 SFT steps) but the same recipes
    cmd = [
        sys.executable,
        "recipes/quickstart.py",
        "--config",
        "recipes/configs/tiny/quickstart.yaml",
        f"output_dir={out}",
        "task.train=2000",
        "task.annotate=60",
        "task.test=80",
        "n=4",
        "sft=[train.max_steps=900, train.lr=2e-3, train.warmup_steps=20, model.freeze_vision_tower=false, "
        "train.eval_every=900, train.save_every=900, train.eval_generations=16, train.max_new_tokens=100]",
        "annotate=[sampling.max_new_tokens=100, engine.concurrency=32, search.max_rollouts=64, search.max_searches=12, "
        "export.edges=step]",
        "prm=[train.max_steps=200, train.save_every=200, train.lr=5e-4, train.batch_size=16]",
        "bon=[generate.sampling.max_new_tokens=100, generate.batch_size=64, report.resamples=200]",
    ]
    res = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=1800, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for stage in ("data", "model", "policy", "annotate", "prm", "bon"):
        assert f"==> [{stage}] done" in res.stdout, stage

    # every stage's output is what the next stage (or a user) reads
    assert len(load_examples(out / "data" / "train_sft.jsonl")) == 2000
    assert (out / "policy" / "model.safetensors").exists()
    prm_rows = load_examples(out / "mcts" / "prm_data.jsonl", require_labels=True)
    assert prm_rows and all(0.0 <= x <= 1.0 for e in prm_rows for x in e.labels)
    trees = read_jsonl(out / "mcts" / "trees.jsonl")
    assert sorted(t["id"] for t in trees) == sorted(f"ann-{i:05d}" for i in range(60))
    assert (out / "prm" / "mmprm_prm.json").exists()
    bon = json.loads((out / "bon" / "report.json").read_text())
    assert bon["num_problems"] == 80 and bon["n_max"] == 4 and set(bon["methods"]) == set(METHODS)

    report = json.loads((out / "report.json").read_text())
    assert {s["stage"] for s in report["stages"]} >= {"data", "model", "policy", "annotate", "prm", "bon"}
    ev = report["step_eval"]
    assert ev["steps"] > 100
    # the bar: better than an untrained PRM at step-level AUROC against exact step labels
    # (right vs wrong step at the same step of the same problem: what reranking relies on)
    assert ev["auroc_trained"] > ev["auroc_untrained"], ev
    assert (out / "report.md").exists() and (out / "bon_curve.png").stat().st_size > 10_000
