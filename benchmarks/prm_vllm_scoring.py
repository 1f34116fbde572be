"""PRM scoring on vLLM (`scorer backend=vllm`) against our HF scorer, on the same candidates.

    .venv-vllm/bin/python benchmarks/prm_vllm_scoring.py            # make test-vllm builds .venv-vllm
    .venv-vllm/bin/python benchmarks/prm_vllm_scoring.py --quick    # smoke test
    python benchmarks/prm_vllm_scoring.py --device cuda --dtype bfloat16   # on a GPU

One tiny random-init Qwen2-VL at vLLM's head_dim wrapped as a token-pair PRM, saved and loaded the
way a user does (`save_prm`, `load_prm(backend=...)`). The candidates are those of
`benchmarks/prm_scoring_throughput.py` (one noise image per problem, a long question, N candidates
of 8 steps). Both scorers score the same examples end to end (tokenization and image preprocessing
included): the HF scorer with its shared-prefix path, the vLLM scorer through the engine's own
batching and prefix cache. Each is timed at its best of `--repeats` rounds, interleaved; the
engine's start-up is reported apart, not timed.

Prints ONE JSON line: steps scored per second for each, vllm/hf, the engine start-up seconds and
the largest score difference (the scores are the same function: float error only).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 problem, 4 candidates, small image (smoke test)")
    parser.add_argument("--problems", type=int, default=4)
    parser.add_argument("--n", type=int, default=16, help="candidates per problem (N of Best-of-N)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="the HF scorer's device (vLLM uses its platform's)")
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16, both scorers")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.5,
        help="vLLM's share of the GPU (the HF scorer holds the rest)",
    )
    args = parser.parse_args(argv)

    import torch
    from prm_scoring_throughput import make_problems, timed

    from mmprm import load_prm
    from mmprm.models.loading import load_backbone
    from mmprm.models.prm import PRMSpec, build_prm, save_prm
    from mmprm.models.tiny import VLLM_HEAD_DIM, build_tiny_model

    torch.manual_seed(0)
    n_problems, n, image_px, q_words, repeats = args.problems, args.n, 224, 150, args.repeats
    if args.quick:
        n_problems, n, image_px, q_words, repeats = 1, 4, 56, 20, 1
    dtype = getattr(torch, args.dtype)

    root = Path(tempfile.mkdtemp(prefix="prm_vllm_bench_"))
    base = build_tiny_model("qwen2_vl", root / "base", head_dim=VLLM_HEAD_DIM, vllm_ready=True, seed=0)
    backbone, processor = load_backbone(base, dtype=torch.float32)
    save_prm(build_prm(backbone, processor, PRMSpec()), processor, root / "prm")
    problems = make_problems(n_problems, n, steps=8, step_words=7, question_words=q_words, image_px=image_px)
    examples = [ex for group in problems for ex in group]
    n_steps = sum(len(ex["steps"]) for ex in examples)

    hf = load_prm(root / "prm", device=args.device, batch_size=16, dtype=dtype)
    start = time.perf_counter()
    vllm = load_prm(
        root / "prm",
        backend="vllm",
        batch_size=16,
        vllm_kwargs={
            "dtype": args.dtype,
            "max_model_len": 4096,
            "enforce_eager": args.device == "cpu",
            **({"gpu_memory_utilization": args.gpu_memory_utilization} if args.device.startswith("cuda") else {}),
        },
    )
    startup = time.perf_counter() - start
    vllm.score(examples[:1])  # the first request compiles and warms the engine
    try:
        best, out = timed({"hf": lambda: hf.score(examples), "vllm": lambda: vllm.score(examples)}, repeats)
    finally:
        vllm.close()
    diff = max(
        abs(a - b) for h, v in zip(out["hf"], out["vllm"]) for a, b in zip(h, v) if not (math.isnan(a) or math.isnan(b))
    )
    result = {
        "benchmark": "prm_vllm_scoring",
        "problems": n_problems,
        "candidates_per_problem": n,
        "steps": n_steps,
        "dtype": args.dtype,
        "hf_steps_per_s": round(n_steps / best["hf"], 1),
        "vllm_steps_per_s": round(n_steps / best["vllm"], 1),
        "vllm_over_hf": round(best["hf"] / best["vllm"], 3),
        "vllm_startup_s": round(startup, 1),
        "max_abs_score_diff": diff,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
