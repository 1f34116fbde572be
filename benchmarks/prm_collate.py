"""What the PRM collator's prompt cache saves: a training step with and without it.

    python benchmarks/prm_collate.py            # ~2 min on 2 CPU cores
    python benchmarks/prm_collate.py --quick    # smoke test

An OmegaPRM export holds several paths per problem, each with the problem's question and image
(the demo's averages 7.9 rows per problem). `PRMCollator` tokenizes each row with its real
images every batch; with the cache it keeps each problem's tokenized prompt and image tensors
(bounded, least recently used out) and tokenizes only the steps of the rows that follow
(`extend_steps`). The rows here are the demo's task (running sums over colour tiles): `--paths`
solutions per problem, 30% of them with one slip, sharing the problem's image file, tokenized
into the on-disk cache by `load_tokenized` as `recipes/prm_train.py` does. Both sides read the same
shuffled batches (`BatchStream`, as training draws them) and train the same tiny Qwen2-VL PRM of
the demo's size (hidden 128, 4 layers, value head): collate, forward, backward, AdamW step, one
thread. Batches must come out equal, or the script stops. The sides alternate for `--rounds`
rounds; each keeps its median over its best round (the cached side's first round meets most
prompts for the first time; its ratio is printed too).

Prints ONE JSON line: collate and whole-step seconds of each side (median per batch), and the
ratios (uncached / cached).
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
    with tempfile.TemporaryDirectory(prefix="mmprm-prm-collate-") as tmp:
        print(json.dumps(measure(args, Path(tmp))))


def write_paths(args: argparse.Namespace, work: Path) -> Path:
    """`args.paths` solutions per problem, all pointing at the problem's one image, as one JSONL."""
    from mmprm.data.schema import read_jsonl
    from mmprm.data.synthetic import SyntheticConfig, add_slips, generate, write_split

    task = SyntheticConfig(
        num_problems=args.problems, seed=0, ops=("+",), max_ops=4, templates=("running_sum",), marks=True
    )
    problems = generate(task)
    write_split(problems, work, "train")  # the images, once
    rows = []
    for k in range(args.paths):
        folder = work / f"paths{k}"
        write_split(add_slips(problems, 0.3, seed=k), folder, "train")
        for r in read_jsonl(folder / "train_gold_steps.jsonl"):
            r["id"] = f"{r['id']}/path{k}"
            r["images"] = [str(work / "images" / Path(p).name) for p in r["images"]]
            rows.append(r)
    rows.sort(key=lambda r: r["id"])  # an export's order: a problem's paths together
    path = work / "prm_data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def measure(args: argparse.Namespace, work: Path) -> dict:
    """Both sides on the same batches, in `work`; the JSON line as a dict."""
    import torch

    from mmprm.models import build_tiny_model, load_backbone
    from mmprm.models.prm import PRMSpec, build_prm
    from mmprm.training.collate import model_input_keys
    from mmprm.training.data import PRMCollator, load_tokenized
    from mmprm.training.run import BatchStream

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
    sides = {
        "uncached": PRMCollator(data, processor, 0, source=str(path), prompt_cache_mb=0, **settings),
        "cached": PRMCollator(data, processor, 0, source=str(path), **settings),
    }
    first = [side(batches[0])[0] for side in sides.values()]
    for key in first[0]:
        if not torch.equal(first[0][key], first[1][key]):
            raise SystemExit(f"the cached collator's {key} differs from the uncached one's")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def run(collate: PRMCollator) -> tuple[float, float]:
        collate_s, step_s = [], []
        for indices in batches:
            start = time.perf_counter()
            batch, _ = collate(indices)
            collated = time.perf_counter()
            values = model(batch["input_ids"], batch["attention_mask"], batch["step_mask"], **model_input_keys(batch))
            values.float().pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            collate_s.append(collated - start)
            step_s.append(time.perf_counter() - start)
        return statistics.median(collate_s), statistics.median(step_s)

    rounds = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, collate in sides.items():
            rounds[name].append(run(collate))
    (uc, us), (cc, cs) = (min(rounds[name], key=lambda t: t[1]) for name in sides)
    return {
        "benchmark": "prm_collate",
        "rows": stats["kept"],
        "rows_per_problem": args.paths,
        "batch": args.batch,
        "steps": args.steps,
        "cached_prompts": len(sides["cached"].prompts.entries),
        "cache_mb": round(sides["cached"].prompts.bytes / 2**20, 2),
        "collate_s": {"uncached": round(uc, 4), "cached": round(cc, 4)},
        "step_s": {"uncached": round(us, 4), "cached": round(cs, 4)},
        "collate_ratio": round(uc / cc, 2),
        "step_ratio": round(us / cs, 2),
        # the first round meets most prompts for the first time (a cold cache)
        "first_round_step_ratio": round(rounds["uncached"][0][1] / rounds["cached"][0][1], 2),
    }


if __name__ == "__main__":
    main()
