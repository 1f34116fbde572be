"""What grouped-query sdpa saves on CPU: transformers' repeated key/value heads against one grouped call.

    python benchmarks/gqa_attention.py            # ~2 min on 2 CPU cores
    python benchmarks/gqa_attention.py --quick    # smoke test

With a mask (every left-padded batch has one), transformers' sdpa copies each key/value head once
per query group before attending (`repeat_kv`): while decoding, the whole KV cache at every token
in every layer. `mmprm.models.attention.grouped_query_sdpa` (what `load_backbone` registers as
"sdpa") runs the CPU kernel's grouped call instead when no gradient is needed. Two measurements,
each side alternating for `--rounds` rounds and keeping its fastest:

- `rollouts`: `generate` on a left-padded batch of the demo's rollout prompts with the demo's model
  (a tiny Qwen2-VL, hidden 128, 4 layers, 8 query and 4 key/value heads; one thread), exactly
  `--tokens` new tokens (`min_new_tokens`), temperature 1 with the HF backend's sampler. The two
  sides must make the same tokens from the same logits, bitwise (checked; the run fails otherwise).
- `decode_attention_7b`: one attention call of one decoding step at Qwen2-VL-7B's shapes (28 query
  heads, 4 key/value heads of 128), `--rows` rows and `--cache` cached tokens, with a padding mask:
  the attention alone, where the copy grows with the group count (7 here, 2 in the demo's model).

Prints ONE JSON line: seconds of each side and the ratio (repeated / grouped) of each measurement.
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

from hf_sampling import demo_rollout_batch  # noqa: E402  (beside this script)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64, help="sequences per generate call (the demo's batch)")
    parser.add_argument("--tokens", type=int, default=96, help="new tokens per row")
    parser.add_argument("--cache", type=int, default=1024, help="cached tokens of the 7B-shaped attention call")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a smoke test: 8 rows, 8 tokens, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.tokens, args.cache, args.rounds = 8, 8, 128, 1

    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="mmprm-gqa-") as tmp:
        out = {"benchmark": "gqa_attention", "torch": torch.__version__}
        out["rollouts"] = rollouts(args, Path(tmp))
        out["decode_attention_7b"] = decode_attention_7b(args)
        print(json.dumps(out))


def sides():
    """name -> the function transformers runs as "sdpa": its own (repeated heads), or ours."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from mmprm.models.attention import grouped_query_sdpa

    return {"repeated": sdpa_attention_forward, "grouped": grouped_query_sdpa}


def rollouts(args: argparse.Namespace, work: Path) -> dict:
    import torch
    from transformers import AttentionInterface

    from mmprm.generation.hf import InverseCDFSampler

    # Prefixes of 0-3 steps, as the annotation's rollouts continue partial solutions: rows of
    # different lengths, so the batch is padded and carries a mask.
    model, processor, enc = demo_rollout_batch(work, args.rows, prefixes=True)
    common = {
        "max_new_tokens": args.tokens,
        "min_new_tokens": args.tokens,
        "pad_token_id": processor.tokenizer.pad_token_id,
        "do_sample": False,
        "output_logits": True,
        "return_dict_in_generate": True,
    }
    best = {name: float("inf") for name in sides()}
    made = {}
    for _ in range(args.rounds):
        for name, fn in sides().items():
            AttentionInterface.register("sdpa", fn)
            torch.manual_seed(0)
            start = time.perf_counter()
            with torch.no_grad():
                gen = model.generate(**enc, **common, logits_processor=[InverseCDFSampler(1.0, 0, 1.0)])
            best[name] = min(best[name], time.perf_counter() - start)
            made[name] = (gen.sequences, torch.stack(gen.logits))
    AttentionInterface.register("sdpa", sides()["grouped"])
    (seq_a, logits_a), (seq_b, logits_b) = made.values()
    if not (torch.equal(seq_a, seq_b) and torch.equal(logits_a, logits_b)):
        raise SystemExit("the grouped and the repeated heads made different tokens or logits")
    return {
        "rows": args.rows,
        "new_tokens": args.tokens,
        "prompt_tokens": enc["input_ids"].shape[1],
        "padded": bool((enc["attention_mask"] == 0).any()),
        "seconds": {name: round(s, 3) for name, s in best.items()},
        "ratio": round(best["repeated"] / best["grouped"], 2),
        "bitwise_equal": True,
    }


def decode_attention_7b(args: argparse.Namespace) -> dict:
    import torch

    heads, kv_heads, dim = 28, 4, 128  # Qwen2-VL-7B / Qwen2.5-VL-7B
    module = torch.nn.Module()
    module.num_key_value_groups = heads // kv_heads
    torch.manual_seed(0)
    query = torch.randn(args.rows, heads, 1, dim)
    key = torch.randn(args.rows, kv_heads, args.cache, dim)
    value = torch.randn(args.rows, kv_heads, args.cache, dim)
    mask = torch.zeros(args.rows, 1, 1, args.cache)
    mask[::2, ..., : args.cache // 4] = torch.finfo(torch.float32).min  # every other row left-padded
    best = {name: float("inf") for name in sides()}
    outs = {}
    for _ in range(args.rounds):
        for name, fn in sides().items():
            start = time.perf_counter()
            with torch.no_grad():
                outs[name] = fn(module, query, key, value, mask, scaling=dim**-0.5)[0]
            best[name] = min(best[name], time.perf_counter() - start)
    return {
        "rows": args.rows,
        "cached_tokens": args.cache,
        "heads": heads,
        "kv_heads": kv_heads,
        "seconds": {name: round(s, 4) for name, s in best.items()},
        "ratio": round(best["repeated"] / best["grouped"], 2),
        "bitwise_equal": torch.equal(outs["repeated"], outs["grouped"]),
    }


if __name__ == "__main__":
    main()
