"""What collating ahead saves: PRM training steps with the batches collated inline and on a
background thread (`mmprm.training.run.Prefetcher`, `train.prefetch_batches`).

    python benchmarks/prm_prefetch.py            # ~2 min on 2 CPU cores
    python benchmarks/prm_prefetch.py --quick    # smoke test

The data and model are benchmarks/prm_collate.py's: the demo's task, `--paths` solutions per
problem sharing the problem's image, tokenized into the on-disk cache as `recipes/prm_train.py`
does, and the demo-sized tiny Qwen2-VL PRM (hidden 128, 4 layers, value head). Both sides train on
the same `BatchStream` batches with the recipe's collator (prompt cache on): collate, forward,
backward, AdamW step. The model computes on one thread, so the machine's second core stands in
for what a GPU step leaves free: the CPU that collates. `inline` collates each batch before its
step, as the recipes did; `prefetch` submits the next batch when a step starts, as the recipes do.
Batches must come out equal, or the script stops. The sides alternate for `--rounds` rounds; each
keeps its best round's median step time.

Prints ONE JSON line: the median seconds per step of each side and the ratio (inline / prefetch).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problems", type=int, default=200)
    parser.add_argument("--paths", type=int, default=8, help="rows per problem (solutions sharing its image)")
    parser.add_argument("--steps", type=int, default=40, help="timed training steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="a smoke test: 20 problems, 4 steps, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.problems, args.steps, args.rounds = 20, 4, 1

    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="mmprm-prm-prefetch-") as tmp:
        print(json.dumps(measure(args, Path(tmp))))


def measure(args: argparse.Namespace, work: Path) -> dict:
    import torch
    from prm_collate import write_paths

    from mmprm.models import build_tiny_model, load_backbone
    from mmprm.models.prm import PRMSpec, build_prm
    from mmprm.training.collate import model_input_keys
    from mmprm.training.data import PRMCollator, load_tokenized
    from mmprm.training.run import BatchStream, Prefetcher

    path = write_paths(args, work)
    backbone, processor = load_backbone(
        build_tiny_model("qwen2_vl", work / "model", seed=0, hidden_size=128, num_layers=4)
    )
    spec = PRMSpec(head="value")
    model = build_prm(backbone, processor, spec)
    settings = {
        "max_length": 1024,
        "step_token": spec.step_token,
        "system": None,
        "label_mode": "soft",
        "hard_threshold": 0.5,
    }
    data, stats = load_tokenized(path, "prm", processor, settings, cache_dir=work / "cache", num_proc=1)
    stream = BatchStream(data.column("length"), args.batch, 0, True)
    batches = [stream.next() for _ in range(args.steps)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step(batch: dict) -> None:
        values = model(batch["input_ids"], batch["attention_mask"], batch["step_mask"], **model_input_keys(batch))
        values.float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    def run(ahead: bool) -> tuple[float, list[dict]]:
        # a fresh collator per round: each side meets every prompt for the first time alike
        collate = PRMCollator(data, processor, 0, source=str(path), **settings)
        prefetch = Prefetcher(collate, enabled=ahead)
        times, seen = [], []
        for k, indices in enumerate(batches):
            start = time.perf_counter()
            prefetch.submit(batches[k : k + 2])  # this step's batch and the next
            batch, _ = prefetch.get(indices)
            step(batch)
            times.append(time.perf_counter() - start)
            if k < 2:
                seen.append(batch)
        prefetch.close()
        return statistics.median(times), seen

    rounds: dict[str, list[float]] = {"inline": [], "prefetch": []}
    for _ in range(args.rounds):
        for name in rounds:
            seconds, seen = run(name == "prefetch")
            rounds[name].append(seconds)
            if name == "inline":
                reference = seen
            elif any(not torch.equal(a[key], b[key]) for a, b in zip(reference, seen) for key in a):
                raise SystemExit("the prefetched batches differ from the inline ones")
    inline, ahead = min(rounds["inline"]), min(rounds["prefetch"])
    return {
        "benchmark": "prm_prefetch",
        "rows": stats["kept"],
        "batch": args.batch,
        "steps": args.steps,
        "cpus": os.cpu_count(),
        "step_s": {"inline": round(inline, 4), "prefetch": round(ahead, 4)},
        "step_ratio": round(inline / ahead, 2),
    }


if __name__ == "__main__":
    main()
