"""vLLM tier (`make test-vllm`): PRM step scores from vLLM's pooling runner (`scorer backend=vllm`)
equal the HF scorer's, side by side on the same PRM directory and the same examples.

Tiny random-init PRMs at vLLM's head_dim (Qwen2 text, Qwen2-VL and InternVL with images), both
heads (token pair; value head with a bias off zero), float32: every step score within 1e-4, and a
candidate cut by max_length is cut at the same step (NaN after it) on both. Then the Best-of-N
recipe end to end with `prm.backend=vllm` on real MATH-V candidates against the same run on HF.
"""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_tier import ENGINE_CLOSED, VLLM_TIER, vllm_server

pytestmark = VLLM_TIER

REPO = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-4
ENGINE = {"dtype": "float32", "enforce_eager": True, "max_model_len": 1024}


@pytest.fixture(scope="module")
def vllm_prms(tmp_path_factory):
    """(arch, head) -> a random-init PRM on a vLLM-ready tiny preset (value bias 0.75)."""
    import torch

    from mmprm.models.loading import load_backbone
    from mmprm.models.prm import PRMSpec, build_prm, save_prm
    from mmprm.models.tiny import VLLM_HEAD_DIM, build_tiny_model

    root = tmp_path_factory.mktemp("vllm_prms")
    made: dict[tuple[str, str], Path] = {}

    def get(arch: str, head: str) -> Path:
        if (arch, head) not in made:
            base = root / f"{arch}_base"
            if not base.exists():
                build_tiny_model(arch, base, head_dim=VLLM_HEAD_DIM, vllm_ready=True)
            backbone, processor = load_backbone(base, dtype=torch.float32)
            model = build_prm(backbone, processor, PRMSpec(head=head))
            if head == "value":
                torch.nn.init.constant_(model.value_head.bias, 0.75)
            made[arch, head] = save_prm(model, processor, root / f"{arch}_{head}")
        return made[arch, head]

    return get


def toy_examples(tmp_path: Path, images: bool) -> list[dict]:
    from mmprm.annotate.simulated import write_toy_problems
    from mmprm.data.problems import load_problems

    problems = load_problems(write_toy_problems(str(tmp_path / "problems"), n=2, images=images))
    long_steps = [f"Step {k}: the running total is {k * 3}." for k in range(1, 60)]
    rows = []
    for p in problems:
        for j, steps in enumerate(
            [["The bar starts at 2.", "It rises by 3.", "So 5."], ["The bar starts at 2.", "It is 6."], long_steps]
        ):
            rows.append({"id": f"{p.id}-{j}", "question": p.question, "images": p.images, "steps": steps})
    return rows


def assert_same_scores(vllm_scores: list[list[float]], hf_scores: list[list[float]]) -> None:
    assert len(vllm_scores) == len(hf_scores)
    for v, h in zip(vllm_scores, hf_scores):
        assert len(v) == len(h)
        assert [math.isnan(x) for x in v] == [math.isnan(x) for x in h]  # cut at the same step
        assert max((abs(a - b) for a, b in zip(v, h) if not math.isnan(a)), default=0.0) < TOLERANCE, (v, h)


@pytest.mark.parametrize(
    "arch,head",
    [
        ("qwen2", "token_pair"),
        ("qwen2", "value"),
        ("qwen2_vl", "token_pair"),
        ("qwen2_vl", "value"),
        ("internvl", "token_pair"),
    ],
)
def test_vllm_scores_equal_the_hf_scorers(vllm_prms, tmp_path, arch, head):
    import torch

    from mmprm.models.prm import load_prm

    prm = vllm_prms(arch, head)
    rows = toy_examples(tmp_path, images=arch != "qwen2")
    max_length = 256  # the third candidate of each problem runs past it
    hf = load_prm(prm, dtype=torch.float32, max_length=max_length).score(rows)
    scorer = load_prm(prm, backend="vllm", max_length=max_length, vllm_kwargs=ENGINE)
    try:
        scores = scorer.score(rows)
        alone = scorer.score(rows[:1], share_prefix=False)
    finally:
        scorer.close()
        gc.collect()
    assert_same_scores(scores, hf)
    assert alone == scores[:1]
    cut = [s for s in hf if any(math.isnan(x) for x in s)]
    assert len(cut) == 2 and all(not math.isnan(s[0]) for s in cut)  # the long ones, cut, not dropped
    if arch != "qwen2":  # the images reach vLLM: two problems, two images, different scores
        assert scores[0][0] != scores[3][0]


def test_an_image_that_vllm_expands_differently_is_refused(vllm_prms, tmp_path):
    """An engine whose image processing disagrees with ours would misplace every step: refused."""
    from mmprm.models.prm import load_prm

    rows = toy_examples(tmp_path, images=True)[:1]
    scorer = load_prm(
        vllm_prms("qwen2_vl", "token_pair"),
        backend="vllm",
        vllm_kwargs={**ENGINE, "mm_processor_kwargs": {"min_pixels": 4 * 28 * 28, "max_pixels": 4 * 28 * 28}},
    )
    try:
        with pytest.raises(ValueError, match=r"id=toy-0-0: vLLM expanded its images"):
            scorer.score(rows)
    finally:
        scorer.close()
        gc.collect()


def test_bon_rerank_with_the_vllm_scorer_writes_the_hf_runs_scores(vllm_prms, real_data, tmp_path):
    from mmprm.models.prm import load_prm
    from mmprm.rerank.candidates import from_mathv, write_candidates

    problems = from_mathv(real_data / "mathv", limit=4)
    candidates = tmp_path / "mathv_bon.jsonl"
    write_candidates(candidates, problems)
    prm = vllm_prms("qwen2_vl", "token_pair")
    # a max_length that cuts the longer half of the candidates yet fits every prompt and first step
    hf = load_prm(prm)
    inputs = [x for p in problems for x in p.prm_inputs() if x["steps"]]
    first = max(len(hf.tokenize({**x, "steps": x["steps"][:1]}).input_ids) for x in inputs)
    whole = sorted(len(hf.tokenize(x).input_ids) for x in inputs)
    max_length = max(first, whole[len(whole) // 2])
    assert whole[-1] > max_length
    scored = {}
    for backend in ("vllm", "hf"):
        out = tmp_path / backend
        args = [
            "--config",
            str(REPO / "recipes" / "configs" / "tiny" / "bon_rerank.yaml"),
            f"prm.path={prm}",
            f"candidates_file={candidates}",
            f"output_dir={out}",
            f"prm.max_length={max_length}",  # cut on both backends alike
            f"prm.backend={backend}",
            "prm.vllm.kwargs={enforce_eager: true, dtype: float32, max_model_len: 1024}",
            "report.resamples=50",
        ]
        res = subprocess.run(
            [sys.executable, str(REPO / "recipes" / "bon_rerank.py"), *args],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"},
            timeout=900,
            check=False,
        )
        assert res.returncode == 0, f"{backend}\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
        if backend == "vllm":
            assert ENGINE_CLOSED in res.stdout + res.stderr, "bon_rerank left its vLLM scorer to the interpreter's exit"
        scored[backend] = [json.loads(line) for line in (out / "scored.jsonl").read_text().splitlines()]
    assert [p["id"] for p in scored["vllm"]] == [p["id"] for p in scored["hf"]]
    cands = {b: [c for p in run for c in p["candidates"]] for b, run in scored.items()}
    assert [c.get("truncated", False) for c in cands["vllm"]] == [c.get("truncated", False) for c in cands["hf"]]
    assert any(c.get("truncated") for c in cands["hf"])  # truncation was exercised
    assert_same_scores([c["step_probs"] for c in cands["vllm"]], [c["step_probs"] for c in cands["hf"]])
    report = {b: json.loads((tmp_path / b / "report.json").read_text()) for b in scored}
    assert report["vllm"]["n_max"] == report["hf"]["n_max"]


def test_a_prm_served_by_vllm_serve_scores_as_the_hf_scorer(vllm_prms, tmp_path):
    """`mmprm export-vllm` then `vllm serve` as docs/serving.md says; the client is the same scorer."""

    import torch

    from mmprm.models.prm import load_prm
    from mmprm.models.vllm_prm import export_for_vllm

    prm = vllm_prms("qwen2", "value")
    served = export_for_vllm(prm, tmp_path / "served")
    args = ["--model", str(served), "--runner", "pooling", "--convert", "classify"]
    args += ["--pooler-config", json.dumps({"task": "token_classify"})]
    args += ["--enforce-eager", "--max-model-len", "1024", "--dtype", "float32"]
    with vllm_server(sys.executable, args, tmp_path / "vllm.log") as url:
        rows = toy_examples(tmp_path, images=False)
        hf = load_prm(prm, dtype=torch.float32, max_length=256).score(rows)
        client = load_prm(prm, backend="vllm", max_length=256, vllm_kwargs={"server_url": url})
        assert client.max_model_len == 1024  # read from the server
        assert_same_scores(client.score(rows), hf)
        with pytest.raises(ValueError, match=r"id=x: has images, and a served PRM scores text only"):
            client.score([{"id": "x", "question": "q", "images": [blank_image(tmp_path)], "steps": ["a."]}])


def blank_image(tmp_path: Path) -> str:
    """A small image file."""
    from PIL import Image

    Image.new("RGB", (28, 28)).save(tmp_path / "blank.png")
    return str(tmp_path / "blank.png")


def test_the_vllm_scoring_benchmark_prints_its_ratio():
    res = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "prm_vllm_scoring.py"), "--quick"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        timeout=900,
        check=False,
    )
    lines = [line for line in res.stdout.splitlines() if line.startswith("{")]
    assert res.returncode == 0 and len(lines) == 1, res.stdout[-2000:] + res.stderr[-3000:]
    bench = json.loads(lines[0])
    assert bench["vllm_over_hf"] > 0 and bench["hf_steps_per_s"] > 0 and bench["vllm_steps_per_s"] > 0
    assert bench["max_abs_score_diff"] < TOLERANCE


@pytest.mark.parametrize(
    "case", ["qwen2_5_math_prm", "math_shepherd", "rlhflow", "mm_prm", "visualprm", "mm_prm_internlm2"]
)
def test_released_prms_score_on_vllm_as_on_hf(tmp_path, case):
    """A released PRM's shape on vLLM: Qwen2.5-Math-PRM as vLLM's own `Qwen2ForProcessRewardModel`
    (two logits per token); Math-Shepherd, RLHFlow and the InternVL ones (MM-PRM, VisualPRM, with a
    figure; MM-PRM-8B's InternLM2 shape too, with its rebuilt sentencepiece tokenizer) exported as
    token-pair classifiers. The step scores equal the HF scorer's, which equal the authors'
    procedures (test_released_prms)."""
    import torch
    from released_checkpoints import (
        build_internlm2_internvl_prm,
        build_internvl_prm,
        build_math_shepherd,
        build_qwen_math_prm,
        build_rlhflow,
        examples,
        image_examples,
    )

    from mmprm import load_prm
    from mmprm.models.tiny import VLLM_HEAD_DIM

    # case: (convention, builder, what the builder takes beyond head_dim, rows)
    cases = {
        "qwen2_5_math_prm": ("qwen2_5_math_prm", build_qwen_math_prm, {}, examples),
        "math_shepherd": ("math_shepherd", build_math_shepherd, {}, examples),
        "rlhflow": ("rlhflow", build_rlhflow, {}, examples),
        "mm_prm": ("mm_prm", build_internvl_prm, {"vllm_ready": True}, image_examples),
        "visualprm": ("visualprm", build_internvl_prm, {"vllm_ready": True}, image_examples),
        "mm_prm_internlm2": ("mm_prm", build_internlm2_internvl_prm, {"vllm_ready": True}, image_examples),
    }
    convention, build, settings, make_rows = cases[case]
    built = build(tmp_path / case, head_dim=VLLM_HEAD_DIM, **settings)
    path, rows = (built[0] if isinstance(built, tuple) else built), make_rows()
    hf = load_prm(path, convention=convention, dtype=torch.float32).score(rows)
    scorer = load_prm(path, convention=convention, backend="vllm", vllm_kwargs=ENGINE)
    try:
        scores = scorer.score(rows)
    finally:
        scorer.close()
        gc.collect()
    assert_same_scores(scores, hf)
