"""What sequence packing saves in policy SFT: rows padded to their batch against packs of whole rows.

    python benchmarks/sft_packing.py            # ~3 min on 2 CPU cores
    python benchmarks/sft_packing.py --quick    # smoke test

The data is the demo's SFT split (`make demo`: recipes/quickstart.py with
recipes/configs/tiny/quickstart.yaml; its `make_data` writes train_sft.jsonl, `--rows` of them used
here) and its model (the tiny Qwen2-VL of that config, tokenizer trained on the same rows, seed 0).
Every side runs the training step of `recipes/policy_sft.py` (its collators, its loss
`token_loss_sum`, AdamW) on the same cached rows, in one process on one thread:
"padded" takes batches of `--batch-size` rows, grouped by length as `train.group_by_length` does;
"packed" takes one pack a step (`data.pack_sequences=true`, `data.pack_tokens` = `--batch-size`
times the mean row length, so a step holds about as many rows); "padded_unsorted" takes batches
of rows in random order (`train.group_by_length=false`), the padding packing removes when rows are
not grouped. The sides alternate, each starting a round in turn, for `--rounds` rounds of one
epoch each (every row once); each keeps its fastest round.

Prints ONE JSON line: rows per second of each side, the ratios (packed / padded, packed /
padded_unsorted), the share of each side's tokens that are padding, and `same_rows`: forward and
backward of the same rows of next-to-equal length padded and packed, padded time / packed time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def recipe(name: str):
    """A recipe script as a module (recipes are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"{name}_for_benchmark", REPO / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=400, help="demo SFT rows to train on (the demo has 4,000)")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per padded batch (the demo's per rank)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a smoke test: 48 rows, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.rounds = 48, 1

    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="mmprm-sft-packing-") as tmp:
        print(json.dumps(measure(args, Path(tmp))))


def demo_data(work: Path, rows: int) -> tuple[Path, Path]:
    """The demo's SFT rows (its first `rows`) and its tiny model, as `make demo` builds them."""
    from mmprm.config import load_config
    from mmprm.models.tiny import build_tiny_model, corpus_text

    quickstart = recipe("quickstart")
    cfg = load_config(quickstart.QuickstartConfig, REPO / "recipes" / "configs" / "tiny" / "quickstart.yaml")
    quickstart.make_data(cfg, work / "data")
    train = work / "data" / "train_sft.jsonl"
    lines = train.read_text().splitlines()[:rows]
    (work / "data" / "bench_sft.jsonl").write_text("".join(line + "\n" for line in lines))
    model = build_tiny_model(
        cfg.arch,
        work / "model",
        seed=cfg.seed,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        corpus=corpus_text(train) if cfg.tokenizer_corpus else (),
    )
    return work / "data" / "bench_sft.jsonl", model


def measure(args: argparse.Namespace, work: Path) -> dict:
    import torch

    from mmprm.models.loading import load_backbone
    from mmprm.training.data import SFTCollator, load_tokenized
    from mmprm.training.run import BatchStream

    policy_sft = recipe("policy_sft")
    rows_file, model_dir = demo_data(work, args.rows)
    model, processor = load_backbone(model_dir)  # sdpa, the demo's attention
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    settings = {"max_length": 256, "system": None}  # recipes/configs/tiny/policy_sft.yaml
    data, _ = load_tokenized(rows_file, "sft", processor, settings, work / "cache", 1, None)
    pad = processor.tokenizer.pad_token_id or 0
    by_row = SFTCollator(data, processor, pad, source=str(rows_file), **settings)
    lengths = data.column("length")
    pack_tokens = max(settings["max_length"], round(args.batch_size * sum(lengths) / len(lengths)))
    packed, pack_lengths, _ = policy_sft.pack_sequences(by_row, pack_tokens, lambda _: None)
    sides = {
        "padded": (by_row, BatchStream(lengths, args.batch_size, 0, True)),
        "packed": (packed, BatchStream(pack_lengths, 1, 0, True)),
        "padded_unsorted": (by_row, BatchStream(lengths, args.batch_size, 0, False)),
    }

    def train_step(collate, indices) -> tuple[int, int, int]:
        batch, items = collate(indices)
        loss, n = policy_sft.token_loss_sum(model, batch)
        (loss / max(1, n)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return len(items), int(batch["attention_mask"].sum()), batch["input_ids"].numel()

    for collate, stream in sides.values():  # warm-up: first-call allocations
        train_step(collate, stream.next())
    best = {name: 0.0 for name in sides}
    tokens = {name: 0.0 for name in sides}
    real = {name: 0 for name in sides}
    run = {name: 0 for name in sides}
    names = list(sides)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # each side first in turn
            collate, stream = sides[name]
            # a whole epoch of batches: every row once (packs differ in rows, batches in length)
            n_batches = -(-len(stream.lengths) // stream.batch_size)
            done = ran = 0
            start = time.perf_counter()
            for _ in range(n_batches):
                n_rows, n_real, n_run = train_step(collate, stream.next())
                done, ran, run[name] = done + n_rows, ran + n_real, run[name] + n_run
            seconds = time.perf_counter() - start
            real[name] += ran
            if done / seconds > best[name]:
                best[name], tokens[name] = done / seconds, ran / seconds
    same = same_rows(policy_sft, model, by_row, lengths, args.batch_size, args.rounds)
    return {
        "benchmark": "sft_packing",
        "rows": len(lengths),
        "mean_row_tokens": round(sum(lengths) / len(lengths), 1),
        "batch_rows": args.batch_size,
        "pack_tokens": pack_tokens,
        "rows_per_pack": round(len(lengths) / len(pack_lengths), 2),
        "padding_share": {name: round(1 - real[name] / max(1, run[name]), 3) for name in sides},
        "rows_per_s": {name: round(v, 1) for name, v in best.items()},
        "tokens_per_s": {name: round(v) for name, v in tokens.items()},
        "ratio": round(best["packed"] / best["padded"], 2),
        "ratio_vs_unsorted": round(best["packed"] / best["padded_unsorted"], 2),
        "same_rows": same,
    }


def same_rows(policy_sft, model, by_row, lengths, batch_size: int, rounds: int) -> dict:
    """Forward and backward of the same rows padded and packed, batches of `batch_size` rows of
    next-to-equal length (sorted: little padding to remove): padded time / packed time, what
    packing costs or saves beyond removing padding, and the padded side's padding share."""
    from mmprm.training.data import collate_sft
    from mmprm.training.packing import collate_sequence_packs

    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    groups = [order[k : k + batch_size] for k in range(0, len(order) - batch_size + 1, batch_size)]
    items = [by_row.items(g) for g in groups[len(groups) // 2 :][:8]]  # mid-length rows
    sides = {"padded": [collate_sft(t, by_row.pad_id) for t in items]}
    sides["packed"] = [collate_sequence_packs([t], by_row.pad_id) for t in items]
    best = {name: float("inf") for name in sides}
    for _ in range(rounds):
        for name, batches in sides.items():
            start = time.perf_counter()
            for batch in batches:
                loss, n = policy_sft.token_loss_sum(model, dict(batch))
                (loss / n).backward()
                model.zero_grad(set_to_none=True)
            best[name] = min(best[name], time.perf_counter() - start)
    padding = 1 - sum(int(b["attention_mask"].sum()) for b in sides["padded"]) / sum(
        b["input_ids"].numel() for b in sides["padded"]
    )
    return {"ratio": round(best["padded"] / best["packed"], 2), "padding_share": round(padding, 3)}


if __name__ == "__main__":
    main()
