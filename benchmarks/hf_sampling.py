"""What the HF backend's sampler saves: `generate` with its own sampler against `InverseCDFSampler`.

    python benchmarks/hf_sampling.py            # ~1 min on 2 CPU cores
    python benchmarks/hf_sampling.py --quick    # smoke test

`transformers`' sampler draws with `torch.multinomial`, which on CPU draws one exponential per
vocabulary entry per row at every decode step. `mmprm.generation.hf.InverseCDFSampler`
draws one uniform per row (inverse CDF) from the same distribution. Both sides here decode the
same left-padded batch of rollout prompts (the demo's task and model size: a tiny Qwen2-VL,
hidden 128, 4 layers, one thread) for exactly `--tokens` new tokens (`min_new_tokens`, so both
run the same number of steps), with no cut (temperature 1, as the demo samples) and with MM-PRM's
top-k 50 / top-p 0.9 cut. The sides alternate for `--rounds` rounds; each keeps its fastest.

Prints ONE JSON line: seconds per decode step of each side and the ratio (generate's / ours),
per setting.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64, help="sequences per generate call (the demo's batch)")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per row")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a smoke test: 8 rows, 8 tokens, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.tokens, args.rounds = 8, 8, 1

    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="mmprm-hf-sampling-") as tmp:
        print(json.dumps(measure(args, Path(tmp))))


def demo_model_and_problems(work: Path, problems: int) -> tuple:
    """(model, processor, problems): the demo's model (a tiny Qwen2-VL, hidden 128, 4 layers,
    random init, saved in WORK) and PROBLEMS problems of the demo's task."""
    from mmprm.data.synthetic import SyntheticConfig, generate
    from mmprm.models import build_tiny_model, load_backbone

    model, processor = load_backbone(
        build_tiny_model("qwen2_vl", work / "model", seed=0, hidden_size=128, num_layers=4)
    )
    return model, processor, generate(SyntheticConfig(num_problems=problems, seed=0, ops=("+",), max_ops=4, marks=True))


def demo_rollout_batch(work: Path, rows: int, prefixes: bool = False) -> tuple:
    """(model, processor, encoded batch): the demo's model (`demo_model_and_problems`) and ROWS
    rollout prompts of the demo's task, left-padded. With `prefixes`, row i continues a partial
    solution of i % 4 steps, as the annotation's rollouts do."""
    from mmprm.generation.base import rollout_prompt

    model, processor, problems = demo_model_and_problems(work, rows)
    model.eval()
    processor.tokenizer.padding_side = "left"
    steps = [[f"step {k}" for k in range(i % 4)] if prefixes else [] for i in range(rows)]
    texts = [rollout_prompt(processor, p.question, 1, s, "tags") for p, s in zip(problems, steps)]
    enc = processor(text=texts, images=[[p.image] for p in problems], padding=True, return_tensors="pt")
    return model, processor, enc


def measure(args: argparse.Namespace, work: Path) -> dict:
    import torch

    from mmprm.generation.hf import InverseCDFSampler

    model, processor, enc = demo_rollout_batch(work, args.rows)
    tokenizer = processor.tokenizer
    common = {"max_new_tokens": args.tokens, "min_new_tokens": args.tokens, "pad_token_id": tokenizer.pad_token_id}

    def sides(top_k: int, top_p: float) -> dict:
        return {
            "generate": {"do_sample": True, "temperature": 1.0, "top_k": top_k, "top_p": top_p},
            "inverse_cdf": {
                "do_sample": False,
                "temperature": None,
                "top_k": None,
                "top_p": None,
                "logits_processor": [InverseCDFSampler(1.0, top_k, top_p)],
            },
        }

    out = {
        "benchmark": "hf_sampling",
        "rows": args.rows,
        "new_tokens": args.tokens,
        "vocab": model.config.get_text_config().vocab_size,
    }
    for setting, (top_k, top_p) in {"no_cut": (0, 1.0), "top_k50_top_p0.9": (50, 0.9)}.items():
        best = {name: float("inf") for name in ("generate", "inverse_cdf")}
        for _ in range(args.rounds):
            for name, kwargs in sides(top_k, top_p).items():
                torch.manual_seed(0)
                start = time.perf_counter()
                with torch.no_grad():
                    gen = model.generate(**enc, **common, **kwargs)
                best[name] = min(best[name], time.perf_counter() - start)
                if gen.shape[1] - enc["input_ids"].shape[1] != args.tokens:
                    raise SystemExit(
                        f"{name} made {gen.shape[1] - enc['input_ids'].shape[1]} tokens, not {args.tokens}"
                    )
        out[setting] = {
            "step_s": {name: round(s / args.tokens, 5) for name, s in best.items()},
            "ratio": round(best["generate"] / best["inverse_cdf"], 2),
        }
    return out


if __name__ == "__main__":
    main()
