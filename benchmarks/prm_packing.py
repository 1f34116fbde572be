"""What tree packing saves in PRM training: rows one by one against one sequence per problem.

    python benchmarks/prm_packing.py            # ~2 min on 2 CPU cores
    python benchmarks/prm_packing.py --quick    # smoke test
    python benchmarks/prm_packing.py --run runs/demo   # the demo's own annotation and policy

An MCTS export has many rows per problem that share the prompt and their first steps.
`data.pack_trees=true` (`mmprm.training.packing`) trains on one sequence per problem in which every shared
token appears once, with an attention mask that keeps each row's view; the loss is the rows' loss.

Both sides run the training step of `recipes/prm_train.py` (its collators, the value head, the
soft-label loss, AdamW) on the same cached rows, in one process on one thread, with the demo's
model size (a tiny Qwen2-VL, hidden 128, 4 layers) and task (colour tiles, running sums). The rows
are shaped like an OmegaPRM export: per problem the gold path and, for every step, two paths that
go wrong there (a changed number) and carry on as written, with soft labels. Batches: 16 rows, or
2 packs (a pack is a problem's rows: about as many rows per batch). The sides alternate for
`--rounds` rounds of `--batches` batches; each keeps its fastest round. A third side runs the
same packs with the one masked kernel over the whole pack instead of attention by blocks of the
tree (`mmprm.training.packing.tree_attention`, what packed training does on CPU). A fourth runs
the blocks with autograd through their slices of the queries and keys, the backward before
`_AttentionByBlocks` wrote it out; its gradients are checked equal to the bit on the first batch.

Prints ONE JSON line: rows per second of each side, the ratio (packed / rows), the ratio of
attention by blocks to the full mask and to autograd through the blocks, and the share of row
tokens a packed batch still runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problems", type=int, default=200)
    parser.add_argument("--batches", type=int, default=40, help="batches per side per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a smoke test: 12 problems, 3 batches, 1 round")
    parser.add_argument(
        "--run",
        type=Path,
        help="a `make demo` output folder: train on its annotation (mcts/prm_data.jsonl), from its policy",
    )
    args = parser.parse_args()
    if args.quick:
        args.problems, args.batches, args.rounds = 12, 3, 1

    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="mmprm-prm-packing-") as tmp:
        print(json.dumps(measure(args, Path(tmp))))


def mcts_shaped_rows(problems: list, rng: random.Random) -> list[dict]:
    """Per problem: the gold path, and two paths per step that go wrong there and carry on."""
    from mmprm.data.synthetic import corrupt_step

    rows = []
    for p in problems:
        image = [f"images/bench_{p.id}.png"]
        rows.append(
            {
                "id": f"{p.id}/gold",
                "images": image,
                "question": p.question,
                "steps": p.steps,
                "labels": [1.0] * len(p.steps),
            }
        )
        for k in range(len(p.steps)):
            for branch in range(2):
                steps = p.steps[:k] + [corrupt_step(p.steps[k], rng)] + p.steps[k + 1 :]
                labels = [1.0] * k + [round(rng.uniform(0.0, 0.4), 3)] * (len(steps) - k)
                rows.append(
                    {
                        "id": f"{p.id}/{k}.{branch}",
                        "images": image,
                        "question": p.question,
                        "steps": steps,
                        "labels": labels,
                    }
                )
    return rows


def measure(args: argparse.Namespace, work: Path) -> dict:
    import torch

    from mmprm.data.schema import write_jsonl
    from mmprm.data.synthetic import SyntheticConfig, generate, write_split
    from mmprm.models import build_tiny_model, load_backbone
    from mmprm.models.prm import PRMSpec, build_prm
    from mmprm.scoring.losses import soft_bce_value
    from mmprm.training import packing
    from mmprm.training.collate import model_input_keys
    from mmprm.training.data import PackedPRMCollator, PRMCollator, load_tokenized, plan_tree_packs
    from mmprm.training.packing import run_tokens, tree_attention
    from mmprm.training.run import BatchStream

    if args.run:  # the demo's own rows: real MCTS trees, larger than the shaped ones below
        rows_file, model_dir = args.run / "mcts" / "prm_data.jsonl", args.run / "policy"
        with rows_file.open() as f:
            rows = [json.loads(line) for line in f]
        n_problems = len({r["images"][0] for r in rows})
    else:
        task = SyntheticConfig(
            num_problems=args.problems, seed=0, ops=("+",), max_ops=4, marks=True, templates=("running_sum",)
        )
        problems = generate(task)
        write_split(problems, work, "bench")
        rows = mcts_shaped_rows(problems, random.Random(0))
        rows_file, n_problems = work / "prm_data.jsonl", len(problems)
        write_jsonl(rows_file, rows)
        model_dir = build_tiny_model("qwen2_vl", work / "model", seed=0, hidden_size=128, num_layers=4)

    backbone, processor = load_backbone(model_dir)
    model = build_prm(backbone, processor, PRMSpec(head="value"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    settings = {
        "max_length": 256,
        "step_token": model.spec.step_token,
        "system": None,
        "label_mode": "soft",
        "hard_threshold": 0.5,
    }
    data, _ = load_tokenized(rows_file, "prm", processor, settings, work / "cache", 1, None)
    pad = processor.tokenizer.pad_token_id or 0
    by_row = PRMCollator(data, processor, pad, **settings)
    plan = plan_tree_packs(data, 4096)
    packed = PackedPRMCollator(by_row, plan.packs)
    sides = {
        "rows": (by_row, BatchStream(data.column("length"), 16, 0, True)),
        "packed": (packed, BatchStream(plan.lengths, 2, 0, True)),
        "packed_full_mask": (packed, BatchStream(plan.lengths, 2, 0, True)),
        "packed_autograd_blocks": (packed, BatchStream(plan.lengths, 2, 0, True)),
    }

    @contextlib.contextmanager
    def full_mask():
        """The one masked kernel over the whole pack, as before `mmprm.training.packing.tree_attention`."""
        packing.tree_attention = lambda *args: contextlib.nullcontext()
        try:
            yield
        finally:
            packing.tree_attention = tree_attention

    @contextlib.contextmanager
    def autograd_blocks():
        """Attention by blocks, its backward by autograd through the blocks' slices and gathers."""
        applies = packing._blocks_backward_applies
        packing._blocks_backward_applies = lambda *args: False
        try:
            yield
        finally:
            packing._blocks_backward_applies = applies

    def backward(name, batch) -> None:
        """The loss of BATCH on side NAME's attention, and its gradients."""
        context = {"packed_full_mask": full_mask, "packed_autograd_blocks": autograd_blocks}.get(name)
        with context() if context else contextlib.nullcontext():
            logits = model(batch["input_ids"], batch["attention_mask"], batch["step_mask"], **model_input_keys(batch))
        soft_bce_value(logits, batch["targets"], batch.get("step_weights")).backward()

    def train_step(name, collate, indices) -> tuple[int, int]:
        batch, items = collate(indices)
        backward(name, batch)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return len(items), run_tokens(batch)

    def grads_of(name, indices) -> dict[str, torch.Tensor]:
        backward(name, sides[name][0](indices)[0])
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.zero_grad(set_to_none=True)
        return grads

    first = sides["packed"][1].next()
    written, through = grads_of("packed", first), grads_of("packed_autograd_blocks", first)
    if written.keys() != through.keys() or not all(torch.equal(written[n], through[n]) for n in written):
        raise SystemExit("prm_packing: the written-out backward of the blocks differs from autograd's")
    for name, (collate, stream) in sides.items():  # warm-up: the prompt cache, first-call allocations
        train_step(name, collate, stream.next())
    best = {name: 0.0 for name in sides}
    tokens = {name: 0 for name in sides}
    for _ in range(args.rounds):
        for name, (collate, stream) in sides.items():
            done = ran = 0
            start = time.perf_counter()
            for _ in range(args.batches):
                n_rows, n_tokens = train_step(name, collate, stream.next())
                done, ran = done + n_rows, ran + n_tokens
            best[name] = max(best[name], done / (time.perf_counter() - start))
            tokens[name] += ran
    return {
        "benchmark": "prm_packing",
        "rows_from": str(args.run / "mcts" / "prm_data.jsonl") if args.run else "shaped",
        "problems": n_problems,
        "rows": len(rows),
        "rows_per_problem": round(len(rows) / n_problems, 2),
        "packed_token_share": round(plan.ratio, 3),
        "rows_per_s": {name: round(v, 1) for name, v in best.items()},
        "ratio": round(best["packed"] / best["rows"], 2),
        "ratio_blocks_vs_full_mask": round(best["packed"] / best["packed_full_mask"], 2),
        "ratio_written_backward_vs_autograd": round(best["packed"] / best["packed_autograd_blocks"], 2),
        "gradients_equal": True,  # checked above, on the first packed batch
    }


if __name__ == "__main__":
    main()
