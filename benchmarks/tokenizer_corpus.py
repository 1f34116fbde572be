"""What a task-trained tiny tokenizer saves: `mmprm tiny-model --corpus` against the built-in one.

    python benchmarks/tokenizer_corpus.py            # ~2 min on 2 CPU cores
    python benchmarks/tokenizer_corpus.py --quick    # smoke test

Two tiny Qwen2-VL models of the demo's size (hidden 128, 4 layers, seed 0) differ only in their
tokenizer: the built-in corpus alone, or that corpus plus the SFT text of the demo's task
(`corpus_text`). Both tokenize the same rows of the demo's task (running sums over colour tiles,
30% of the solutions with one slip) with `tokenize_steps`, as PRM training does, and train a PRM
(value head) on the same batches: forward, backward and AdamW step, one thread. The sides alternate
for `--rounds` rounds; each keeps its median step time over its best round.

Prints ONE JSON line: tokens per row (mean) and seconds per step of each side, and the ratios
(built-in / task corpus).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1000, help="task rows the tokenizer trains on and the PRM reads")
    parser.add_argument("--steps", type=int, default=20, help="timed training steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="a smoke test: 200 rows, 3 steps, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.steps, args.rounds = 200, 3, 1

    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="mmprm-tokenizer-corpus-") as tmp:
        print(json.dumps(measure(args, Path(tmp))))


def measure(args: argparse.Namespace, work: Path) -> dict:
    """Both sides on the same rows and batches, in `work`; the JSON line as a dict."""
    import torch

    from mmprm.data.schema import load_image, read_jsonl
    from mmprm.data.synthetic import SyntheticConfig, add_slips, generate, write_split
    from mmprm.models import build_tiny_model, load_backbone
    from mmprm.models.prm import PRMSpec, build_prm
    from mmprm.models.tiny import corpus_text
    from mmprm.steps import tokenize_steps
    from mmprm.training.collate import collate_steps, model_input_keys

    task = SyntheticConfig(
        num_problems=args.rows, seed=0, ops=("+",), max_ops=4, templates=("running_sum",), marks=True
    )
    write_split(add_slips(generate(task), 0.3, seed=0), work, "train")
    rows = read_jsonl(work / "train_gold_steps.jsonl")  # the steps with their exact labels
    corpus = corpus_text(work / "train_sft.jsonl")

    sides = {}
    for name, extra in (("builtin", ()), ("task_corpus", corpus)):
        path = build_tiny_model("qwen2_vl", work / name, seed=0, hidden_size=128, num_layers=4, corpus=extra)
        backbone, processor = load_backbone(path)
        model = build_prm(backbone, processor, PRMSpec(head="value"))
        items = []
        for r in rows:
            images = [load_image(work / p) for p in r["images"]]
            items.append(tokenize_steps(processor, r["question"], r["steps"], images, labels=r["labels"]))
        pad = getattr(processor, "tokenizer", processor).pad_token_id or 0
        sides[name] = {"model": model, "items": items, "pad": pad, "times": []}

    # the same row order for both sides, length-sorted chunks as the recipe's grouping gives
    order = sorted(range(len(rows)), key=lambda i: len(sides["builtin"]["items"][i].input_ids))
    batches = [order[i : i + args.batch] for i in range(0, len(order) - args.batch + 1, args.batch)]
    for _ in range(args.rounds):
        for side in sides.values():
            model = side["model"].train()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            times = []
            for b in range(args.steps):
                batch = collate_steps([side["items"][i] for i in batches[b % len(batches)]], side["pad"])
                start = time.perf_counter()
                logits = model(
                    batch["input_ids"], batch["attention_mask"], batch["step_mask"], **model_input_keys(batch)
                )
                torch.nn.functional.binary_cross_entropy_with_logits(logits, batch["targets"]).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                times.append(time.perf_counter() - start)
            side["times"].append(statistics.median(times))

    out = {"rows": len(rows), "batch": args.batch, "steps": args.steps, "rounds": args.rounds}
    for name, side in sides.items():
        out[name] = {
            "tokens_per_row": round(statistics.mean(len(t.input_ids) for t in side["items"]), 1),
            "seconds_per_step": round(min(side["times"]), 4),
        }
    out["token_ratio"] = round(out["builtin"]["tokens_per_row"] / out["task_corpus"]["tokens_per_row"], 3)
    out["step_time_ratio"] = round(out["builtin"]["seconds_per_step"] / out["task_corpus"]["seconds_per_step"], 3)
    return out


if __name__ == "__main__":
    main()
