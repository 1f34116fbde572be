"""vLLM tier (`make test-vllm`): the recipes' real entry points with `backend=vllm`, as a user runs
them, next to the same command with `backend=hf` on the same toy policy.

- `recipes/mcts_annotate.py policy.backend=vllm`, text and multimodal: every problem gets a record,
  the records and the exported PRM rows have the HF run's schema.
- `recipes/bon_rerank.py policy.backend=vllm` (multimodal): N parsed candidates per problem,
  scored and reported; the candidates file has the HF run's schema.
Each run starts its own engine in a subprocess (about a minute on CPU), as the recipe does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from json_schema import schema_differences
from vllm_tier import ENGINE_CLOSED, VLLM_TIER

pytestmark = VLLM_TIER

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "recipes" / "configs" / "tiny"
ENV = {
    **os.environ,
    "PYTHONUNBUFFERED": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
}
VALID_STATUSES = {"annotated", "screened_all_correct", "screened_all_wrong"}


def run(recipe: str, *args: str) -> subprocess.CompletedProcess:
    res = subprocess.run(
        [sys.executable, str(REPO / "recipes" / recipe), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=ENV,
        timeout=900,
        check=False,
    )
    assert res.returncode == 0, f"{recipe} {' '.join(args)}\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
    if any(a.endswith("backend=vllm") for a in args):
        assert ENGINE_CLOSED in res.stdout + res.stderr, f"{recipe} left its vLLM engine to the interpreter's exit"
    return res


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def problems_file(tmp_path: Path, n: int, images: bool) -> Path:
    from mmprm.annotate.simulated import write_toy_problems

    return Path(write_toy_problems(str(tmp_path / "problems"), n=n, images=images))


@pytest.mark.parametrize("arch", ["qwen2", "qwen2_vl"])
def test_mcts_annotate_with_vllm_writes_the_hf_runs_records(vllm_toy_policy, tmp_path, arch):
    policy = vllm_toy_policy(arch)
    problems = problems_file(tmp_path, 4, images=arch != "qwen2")
    # 8 rollouts per estimate: the weak toy policy is right ~3 times in 4, so some root estimate is mixed.
    common = [
        "--config",
        str(CONFIGS / "mcts_annotate.yaml"),
        f"policy.path={policy}",
        f"data.problems_file={problems}",
        "policy.dtype=float32",
        "search.rollouts_per_estimate=8",
        "search.max_searches=6",
        "search.max_rollouts=48",
        "policy.sampling.max_new_tokens=64",
    ]
    outs = {}
    for backend in ("vllm", "hf"):
        out = tmp_path / backend
        extra = ["policy.vllm.kwargs.enforce_eager=true", "policy.vllm.max_model_len=1024"] if backend == "vllm" else []
        res = run("mcts_annotate.py", *common, f"policy.backend={backend}", f"output_dir={out}", *extra)
        assert "4 to annotate" in res.stderr
        outs[backend] = out
    trees = {b: sorted(read_jsonl(o / "trees.jsonl"), key=lambda r: r["id"]) for b, o in outs.items()}
    for backend, recs in trees.items():
        assert [r["id"] for r in recs] == ["toy-0", "toy-1", "toy-2", "toy-3"]
        assert {r["status"] for r in recs} <= VALID_STATUSES, [(r["status"], r.get("error")) for r in recs]
        summary = json.loads((outs[backend] / "summary.rank0-of-1.json").read_text())
        assert summary["generated_tokens"] > 0 and summary["engine"]["rollouts"] > 0
        assert summary["continuous"] == (backend == "vllm")  # engine.continuous: null, on for vllm only
    # Mixed rollouts somewhere: a search ran and located a first error.
    annotated = [r for r in trees["vllm"] if r["status"] == "annotated"]
    assert annotated and all(r["first_errors"] for r in annotated), [r["status"] for r in trees["vllm"]]
    assert schema_differences(trees["vllm"], trees["hf"]) == []
    rows = {b: read_jsonl(o / "prm_data.jsonl") for b, o in outs.items()}
    assert rows["vllm"] and schema_differences(rows["vllm"], rows["hf"]) == []
    assert (outs["vllm"] / "export_report.json").exists() and (outs["vllm"] / "export_report.png").exists()


def test_bon_generation_with_vllm_writes_the_hf_runs_candidates(vllm_toy_policy, tiny_models, tmp_path):
    from mmprm.models.loading import load_backbone
    from mmprm.models.prm import PRMSpec, build_prm, save_prm

    policy = vllm_toy_policy("qwen2_vl")
    backbone, processor = load_backbone(tiny_models("qwen2_vl"))
    prm = save_prm(build_prm(backbone, processor, PRMSpec()), processor, tmp_path / "prm")
    problems = problems_file(tmp_path, 3, images=True)
    common = [
        "--config",
        str(CONFIGS / "bon_rerank.yaml"),
        f"prm.path={prm}",
        "generate.enabled=true",
        f"policy.path={policy}",
        f"generate.problems_file={problems}",
        "generate.n=4",
        "policy.sampling.max_new_tokens=64",
        "report.resamples=50",
    ]
    outs = {}
    for backend in ("vllm", "hf"):
        out = tmp_path / backend
        extra = (
            ["policy.vllm.kwargs={enforce_eager: true, dtype: float32, max_model_len: 1024}"]
            if backend == "vllm"
            else []
        )
        run("bon_rerank.py", *common, f"policy.backend={backend}", f"output_dir={out}", *extra)
        outs[backend] = out
    cands = {b: read_jsonl(o / "candidates.jsonl") for b, o in outs.items()}
    for _backend, problems_out in cands.items():
        assert [p["id"] for p in problems_out] == ["toy-0", "toy-1", "toy-2"]
        assert all(len(p["candidates"]) == 4 for p in problems_out)
    vllm_cands = [c for p in cands["vllm"] for c in p["candidates"]]
    # The toy policy writes 3 steps and an answer; the PRM sees the steps with the answer attached.
    parsed = [c for c in vllm_cands if c["meta"]["complete"]]
    assert len(parsed) >= 9, [c["text"] for c in vllm_cands]
    assert all(c["steps"] and c["answer"] is not None for c in parsed)
    assert any(c["correct"] for c in vllm_cands)
    assert schema_differences(cands["vllm"], cands["hf"]) == []
    report = json.loads((outs["vllm"] / "report.json").read_text())
    assert report["n_max"] == 4


def test_a_policy_saved_through_load_backbone_keeps_its_video_processor(vllm_toy_policy):
    # The toy policy is loaded with load_backbone, trained and saved again, as policy_sft does:
    # where torchvision imports the processor loads whole, so vLLM can load what was saved.
    from mmprm.models.loading import load_processor

    policy = vllm_toy_policy("qwen2_vl")
    saved = json.loads((policy / "processor_config.json").read_text())
    assert "video_processor" in saved or (policy / "video_preprocessor_config.json").exists()
    assert not type(load_processor(policy)).__name__.endswith("ImageOnlyProcessor")
