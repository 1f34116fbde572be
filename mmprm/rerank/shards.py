"""Scored Best-of-N shards: one file per shard, merged into one and reported.

A shard file `scored.shard{i}-of-{c}.jsonl` holds one line per problem::

    {"id": "17", "candidates": [{"step_probs": [...], "answer": "12", "correct": true}, ...]}

`merge_scored` checks that every shard of the run is present before it merges, so a report is
never written from a partial run.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from mmprm.data.schema import read_jsonl, write_jsonl

_SHARD_RE = re.compile(r"scored\.shard(\d+)-of-(\d+)\.jsonl$")


def shard_path(out_dir: str | Path, index: int, count: int) -> Path:
    return Path(out_dir) / f"scored.shard{index}-of-{count}.jsonl"


def merge_scored(out_dir: str | Path) -> Path:
    """Merge all shard files of `out_dir` into `scored.jsonl` (problem order: by shard, then file order)."""
    out = Path(out_dir)
    shards = {}
    for p in out.glob("scored.shard*-of-*.jsonl"):
        m = _SHARD_RE.search(p.name)
        if m:
            shards[(int(m.group(1)), int(m.group(2)))] = p
    if not shards:
        raise FileNotFoundError(f"{out}: no scored.shard*-of-*.jsonl files (run recipes/bon_rerank.py with "
                                "shard.index=I shard.count=C first)")
    counts = {c for _, c in shards}
    if len(counts) != 1:
        raise ValueError(f"{out}: shard files from runs with different shard counts {sorted(counts)}; remove stale ones")
    count = counts.pop()
    missing = [i for i in range(count) if (i, count) not in shards]
    if missing:
        raise ValueError(f"{out}: shards {missing} of {count} are missing; rerun those shards before merging")
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i in range(count):
        for row in read_jsonl(shards[(i, count)]):
            if row["id"] in seen:
                raise ValueError(f"{shards[(i, count)]}: id={row['id']} appears in more than one shard")
            seen.add(row["id"])
            rows.append(row)
    merged = out / "scored.jsonl"
    write_jsonl(merged, rows)
    return merged


def report_from_scored(scored: str | Path, out_dir: str | Path, n_subsets: int = 32, resamples: int = 1000,
                       seed: int = 0, weighted_by: str = "min", title: str = "Best-of-N accuracy") -> dict[str, Any]:
    """Best-of-N report (report.json/md, bon_curve.png) from a scored file."""
    from mmprm.answers import answers_match
    from mmprm.rerank.report import bon_curve, write_report

    rows = read_jsonl(scored)
    problems = [row["candidates"] for row in rows]
    curve = bon_curve(problems, n_subsets=n_subsets, seed=seed, weighted_by=weighted_by,
                      same=lambda a, b: answers_match(a, b))
    return write_report(curve, out_dir, title=title, n_resamples=resamples, seed=seed)


def cli_merge_bon(argv: list[str]) -> int:
    """`mmprm merge-bon OUTPUT_DIR`: merge scored shards and write the Best-of-N report there."""
    ap = argparse.ArgumentParser(prog="mmprm merge-bon", description=cli_merge_bon.__doc__)
    ap.add_argument("output_dir")
    ap.add_argument("--n-subsets", type=int, default=32)
    ap.add_argument("--resamples", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--weighted-by", default="min")
    ap.add_argument("--title", default="Best-of-N accuracy")
    args = ap.parse_args(argv)
    try:
        merged = merge_scored(args.output_dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"mmprm merge-bon: {e}", file=sys.stderr)
        return 2
    report = report_from_scored(merged, args.output_dir, args.n_subsets, args.resamples, args.seed,
                                args.weighted_by, args.title)
    print(json.dumps({"merged": str(merged), "num_problems": report["num_problems"], "n_max": report["n_max"]}))
    return 0
