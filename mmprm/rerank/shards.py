"""Scored Best-of-N shards: one file per shard, merged into one and reported.

A shard file `scored.shard{i}-of-{c}.jsonl` holds one line per problem::

    {"id": "17", "candidates": [{"step_probs": [...], "answer": "12", "correct": true}, ...]}

Shards are contiguous blocks of the problem list (`take_shard`), so merging them in shard order
gives the same file, in the same order, as one unsharded run. `merge_scored` checks that every
shard of the run is present before it merges, so a report is never written from a partial run.
The recipe also leaves `report_settings.json` (its `report` section) beside the shards, which
`mmprm merge-bon` uses so a sharded run reports exactly as an unsharded one would.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar, get_args

from mmprm.data.schema import atomic_write, iter_jsonl
from mmprm.scoring.aggregators import EdgeRules

_SHARD_RE = re.compile(r"scored\.shard(\d+)-of-(\d+)\.jsonl$")
SETTINGS_FILE = "report_settings.json"
T = TypeVar("T")


def shard_bounds(n: int, index: int, count: int) -> tuple[int, int]:
    """Rows [lo, hi) of shard `index` of `count` over `n` rows: contiguous, sizes differing by at most one.

    Blocks (not every count-th row) keep the merged file in input order:
    `shard_bounds(5, 0, 2) == (0, 2)` and `shard_bounds(5, 1, 2) == (2, 5)`.
    """
    if not 0 <= index < count:
        raise ValueError(f"shard index {index} is not in [0, count={count})")
    return index * n // count, (index + 1) * n // count


def take_shard(items: Sequence[T], index: int, count: int) -> list[T]:
    """Shard `index` of `count` of a list (`shard_bounds`): `take_shard(range(5), 1, 2) == [2, 3, 4]`."""
    lo, hi = shard_bounds(len(items), index, count)
    return list(items[lo:hi])


def shard_path(out_dir: str | Path, index: int, count: int) -> Path:
    return Path(out_dir) / f"scored.shard{index}-of-{count}.jsonl"


def merge_scored(out_dir: str | Path, count: int | None = None) -> Path:
    """Merge the shard files of `out_dir` into `scored.jsonl`, in shard order.

    Args:
        out_dir: the run's output folder.
        count: merge the shards of a `count`-shard run and ignore other files; None (merge-bon)
            requires all shard files there to come from one run.

    Raises:
        FileNotFoundError: no shard files. ValueError: a shard is missing, runs are mixed (shard
        counts or settings, `check_one_run`), or an id appears in two shards.
    """
    out = Path(out_dir)
    shards = {}
    for p in out.glob("scored.shard*-of-*.jsonl"):
        m = _SHARD_RE.search(p.name)
        if m and (count is None or int(m.group(2)) == count):
            shards[(int(m.group(1)), int(m.group(2)))] = p
    if not shards:
        raise FileNotFoundError(
            f"{out}: no scored.shard*-of-{count or '*'}.jsonl files (run recipes/bon_rerank.py "
            "with shard.index=I shard.count=C first)"
        )
    counts = {c for _, c in shards}
    if len(counts) != 1:
        raise ValueError(
            f"{out}: shard files from runs with different shard counts {sorted(counts)}; delete the stale ones"
        )
    count = counts.pop()
    missing = [i for i in range(count) if (i, count) not in shards]
    if missing:
        raise ValueError(
            f"{out}: shard(s) {missing} of {count} missing: run them (shard.index=I shard.count={count}) before merging"
        )
    check_one_run(out, [shards[(i, count)] for i in range(count)])
    # Rows are copied one at a time; memory holds the ids only.
    seen: set[str] = set()
    merged = out / "scored.jsonl"
    # A temp file of this call's own (`atomic_write`): two processes that merge at once never write
    # into one file, and a bad shard leaves no half-merged scored.jsonl behind.
    with atomic_write(merged) as dst:
        for i in range(count):
            for lineno, row, err in iter_jsonl(shards[(i, count)]):
                if err or row is None:
                    raise ValueError(f"{shards[(i, count)]}:{lineno}: {err} (a damaged shard: rerun it)")
                if row["id"] in seen:
                    raise ValueError(
                        f"{shards[(i, count)]}: id={row['id']} appears in more than one shard "
                        "(shards of different runs? rerun them into an empty folder)"
                    )
                seen.add(row["id"])
                dst.write(json.dumps(row, ensure_ascii=False) + "\n")
    return merged


def check_one_run(out: Path, files: list[Path]) -> None:
    """Refuse shards scored with other settings than the first shard with rows, as each recorded
    them beside its file (`<shard>.run.json`, bon_rerank): merged, they would report two PRMs or
    candidate sets as one run. A shard that sampled its own candidates may differ in that file's
    name only, and their sampling settings (`candidates.shard*.jsonl.run.json`) must match too."""
    from mmprm.config import ConfigError
    from mmprm.data.store import check_same_run

    def own(i: int) -> Path:  # the candidates file shard i samples for itself (bon_rerank's name)
        return out / f"candidates.shard{i}-of-{len(files)}.jsonl"

    def run_file(path: Path) -> Path:
        return path.with_name(path.name + ".run.json")

    ref: tuple[int, dict[str, Any]] | None = None
    for i, shard in enumerate(files):
        if not run_file(shard).exists() or shard.stat().st_size == 0:  # no rows: no scores to mix
            continue
        if ref is None:
            ref = i, json.loads(run_file(shard).read_text())
            continue
        j, expected = ref[0], dict(ref[1])
        try:
            if expected.get("candidates_file") == str(own(j).resolve()) and run_file(own(j)).exists():
                expected["candidates_file"] = str(own(i).resolve())
                sampled = json.loads(run_file(own(j)).read_text())
                check_same_run(run_file(own(i)), sampled, own(i), record=False)
            check_same_run(run_file(shard), expected, shard, record=False)
        except ConfigError as e:
            raise ValueError(f"{out}: not one run: {e} (was: this shard's, now: shard {j}'s)") from None


def report_from_scored(
    scored: str | Path,
    out_dir: str | Path,
    n_subsets: int = 32,
    resamples: int = 1000,
    seed: int = 0,
    weighted_by: str = "min",
    title: str = "Best-of-N accuracy",
    extraction: str | None = None,
    edge_rules: EdgeRules = "mmprm",
) -> dict[str, Any]:
    """Best-of-N report (report.json/md, bon_curve.png) from a scored file.

    Votes group answers with `mmprm.answers.answers_match` (so "1/2" and "0.5" agree). `extraction`
    names how the candidates' verdicts were extracted (rules, an LLM); the report says it.
    `edge_rules` (mmprm | mm_prm) are the aggregators' rules for empty candidates and p = 0 or 1.
    """
    from mmprm.answers import answers_match
    from mmprm.data.schema import iter_jsonl
    from mmprm.rerank.report import bon_curve, read_candidates, write_report

    problems = read_candidates(scored)  # every row checked first; DataError names the line
    curve = bon_curve(
        problems,
        n_subsets=n_subsets,
        seed=seed,
        weighted_by=weighted_by,
        same=lambda a, b: answers_match(a, b),
        edge_rules=edge_rules,
    )
    metas = [row.get("meta") or {} for _, row, _ in iter_jsonl(scored)]  # a benchmark's category columns
    if curve.settings["truncated_problems"]:
        shortest = next(
            str(row.get("id")) for (_, row, _), c in zip(iter_jsonl(scored), problems) if len(c) == curve.n_max
        )
        print(
            f"warning: {scored}: problems have different numbers of candidates; N goes up to the smallest, "
            f"{curve.n_max} (id={shortest}), and {curve.settings['truncated_problems']} problems use only their "
            f"first {curve.n_max}: give every problem the same N, or drop the short ones",
            file=sys.stderr,
        )
    return write_report(
        curve, out_dir, title=title, n_resamples=resamples, seed=seed, metas=metas, extraction=extraction
    )


def cli_merge_bon(argv: list[str]) -> int:
    """`mmprm merge-bon OUTPUT_DIR`: merge scored shards and write the Best-of-N report there.

    Report settings come from the run's report_settings.json; flags given here override them.
    """
    ap = argparse.ArgumentParser(prog="mmprm merge-bon", description=cli_merge_bon.__doc__)
    ap.add_argument("output_dir")
    ap.add_argument("--n-subsets", type=int)
    ap.add_argument("--resamples", type=int)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--weighted-by")
    ap.add_argument("--title")
    ap.add_argument("--edge-rules", choices=get_args(EdgeRules))
    args = ap.parse_args(argv)
    settings = {
        "n_subsets": 32,
        "resamples": 1000,
        "seed": 0,
        "weighted_by": "min",
        "title": "Best-of-N accuracy",
        "extraction": None,
        "edge_rules": "mmprm",
    }
    saved = Path(args.output_dir) / SETTINGS_FILE
    if saved.exists():
        settings.update({k: v for k, v in json.loads(saved.read_text()).items() if k in settings})
    settings.update({k: v for k, v in vars(args).items() if k in settings and v is not None})
    try:
        merged = merge_scored(args.output_dir)
        report = report_from_scored(merged, args.output_dir, **settings)
    except (FileNotFoundError, ValueError) as e:
        print(f"mmprm merge-bon: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"merged": str(merged), "num_problems": report["num_problems"], "n_max": report["n_max"]}))
    return 0


def benchmark_table(reports: dict[str, dict[str, Any]], n: int | None = None) -> dict[str, Any]:
    """MM-PRM's table from Best-of-N reports, one per benchmark: every method's accuracy at N with
    its 95% interval, per benchmark, and the mean over benchmarks.

    reports: benchmark name -> its report.json (`report_from_scored`). n: the N to tabulate;
    default the largest N every report has.
    """
    if not reports:
        raise ValueError("no reports to tabulate")
    methods = list(next(iter(reports.values()))["methods"])
    if n is None:
        # Each report computed its own N list (1, 2, 4, ..., n_max): the smallest n_max need not be in
        # another's list (8 has 1, 2, 4, 8; 6 has 1, 2, 4, 6), so take the largest N they all hold.
        common = set.intersection(*(set(map(int, r["methods"][methods[0]])) for r in reports.values()))
        if not common:
            raise ValueError("the reports share no N: pass --n with one every report has")
        n = max(common)
    rows: dict[str, Any] = {}
    for name, report in reports.items():
        if str(n) not in report["methods"][methods[0]]:
            raise ValueError(
                f"{name}: its report has no N={n} (N up to {report['n_max']}, settings.ns {report['settings']['ns']})"
            )
        rows[name] = {"problems": report["num_problems"], **{m: report["methods"][m][str(n)] for m in methods}}
    mean = {m: sum(r[m]["mean"] for r in rows.values()) / len(rows) for m in methods}
    return {"n": n, "methods": methods, "benchmarks": rows, "mean_over_benchmarks": mean}


def benchmark_table_markdown(table: dict[str, Any], links: dict[str, str] | None = None) -> str:
    """The table as markdown: benchmarks as rows, methods as columns, mean [95% CI]."""
    methods, links = table["methods"], links or {}
    lines = [
        f"# Best-of-{table['n']} by benchmark",
        "",
        f"Accuracy with N={table['n']} candidates per problem, mean over problems [95% bootstrap CI]. "
        "random is a single sample; oracle counts a problem solved when any candidate is correct. "
        "Each benchmark's own report has the whole N curve and its breakdown by category.",
        "",
        "| benchmark | problems | " + " | ".join(methods) + " |",
        "|---|---|" + "---|" * len(methods),
    ]
    for name, row in table["benchmarks"].items():
        cells = [f"{row[m]['mean']:.3f} [{row[m]['ci95'][0]:.3f}, {row[m]['ci95'][1]:.3f}]" for m in methods]
        label = f"[{name}]({links[name]})" if name in links else name
        lines.append(f"| {label} | {row['problems']} | " + " | ".join(cells) + " |")
    mean = table["mean_over_benchmarks"]
    lines.append("| mean over benchmarks | | " + " | ".join(f"{mean[m]:.3f}" for m in methods) + " |")
    return "\n".join(lines) + "\n"


def cli_bon_table(argv: list[str]) -> int:
    """`mmprm bon-table RUN_DIR... [--n N] [--out DIR]`: one table over Best-of-N runs, one per benchmark."""
    ap = argparse.ArgumentParser(prog="mmprm bon-table", description=cli_bon_table.__doc__)
    ap.add_argument("runs", nargs="+", help="Best-of-N output dirs (each with report.json); the dir name names the row")
    ap.add_argument("--n", type=int, help="N to tabulate (default: the largest N every run has)")
    ap.add_argument("--out", help="where table.md and table.json go (default: the runs' common parent)")
    args = ap.parse_args(argv)
    runs = [Path(r) for r in args.runs]
    missing = [str(r) for r in runs if not (r / "report.json").exists()]
    if missing:
        print(
            f"mmprm bon-table: no report.json in {', '.join(missing)} (finish or merge those runs first)",
            file=sys.stderr,
        )
        return 2
    reports = {r.name: json.loads((r / "report.json").read_text()) for r in runs}
    if len(reports) != len(runs):
        print(
            "mmprm bon-table: two runs share a folder name; name each run's folder after its benchmark", file=sys.stderr
        )
        return 2
    out = Path(args.out) if args.out else Path(os.path.commonpath([r.resolve() for r in runs]))
    try:
        table = benchmark_table(reports, args.n)
    except ValueError as e:
        print(f"mmprm bon-table: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    links = {r.name: os.path.relpath(r.resolve() / "report.md", out.resolve()) for r in runs}
    with atomic_write(out / "table.json") as f:
        f.write(json.dumps(table, indent=2) + "\n")
    with atomic_write(out / "table.md") as f:
        f.write(benchmark_table_markdown(table, links))
    print(f"wrote {out / 'table.md'} and {out / 'table.json'} ({len(reports)} benchmarks, N={table['n']})")
    return 0
