"""Best-of-N curve: accuracy of every aggregator and baseline against the number of candidates.

Input, per problem, a list of candidates, each a dict::

    {"step_probs": [0.9, 0.4, 0.8],   # PRM probability per step
     "answer": "12" | None,           # extracted final answer
     "correct": True,                 # answer verified against the gold answer
     "truncated": False}              # optional: scored steps are only a prefix (prm.max_length)

A truncated candidate's aggregate would read a middle step as `last` and fewer steps for `min`,
so it must not win on a partial score: PRM aggregators rank it last, below an empty candidate
too (`mmprm.scoring.selection.pick_best`; among only truncated candidates the lowest index wins), it weighs 0 in the weighted vote, and majority vote,
random and oracle, which never read scores, count it as usual. report.json/md count them.

Method. For N in {1, 2, 4, ..., n_max} (plus n_max itself), each problem's accuracy at N is
the mean over subsets of N of its candidates: every subset when there are at most
`n_subsets` (32) of them, else `n_subsets` seeded random subsets per problem; N = n_max is the
full set. In a subset, a PRM aggregator picks the highest aggregated score (ties -> lowest
candidate index); the baselines are random (exact expectation), majority vote, weighted vote
(sum of `weighted_by` scores, default min) and oracle (pass@N); see
`mmprm.scoring.selection`. Every aggregator scores under one set of edge rules (`edge_rules`):
mmprm's (clamped, an empty candidate lowest) or MM-PRM's (an empty candidate 0, +/-9999
sentinels; `mmprm.scoring.aggregators`); a truncated candidate ranks last under either. The curve is the mean over problems with a 95% percentile bootstrap
CI over problems (1000 seeded resamples, the same resamples for every method, so differences
are paired). Everything is deterministic for a fixed seed.

Outputs of `write_report`: report.json, report.md and bon_curve.png in one folder.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mmprm.scoring.aggregators import AGGREGATORS, MM_PRM_AGGREGATORS, EdgeRules, aggregate
from mmprm.scoring.selection import answer_groups, best_index, vote_accuracy
from mmprm.scoring.stats import paired_bootstrap, percentile_interval, resample_means

BASELINES = ("random", "majority", "weighted_vote", "oracle")
METHODS = (*AGGREGATORS, *BASELINES)
EDGE_RULES: dict[str, str] = {
    "mmprm": "mmprm's: step probabilities clamped to [1e-6, 1 - 1e-6], an empty candidate scores lowest",
    "mm_prm": (
        "MM-PRM's (eval/prm/extract_calculate.py): no clamping, an empty candidate scores 0, "
        "log(0) is -9999 and the log-odds and odds of p = 1 are 9999"
    ),
}
"""Edge-rule name (`mmprm.scoring.aggregators.EdgeRules`) -> how report.json/md state it."""


@dataclass
class BonCurve:
    """Per-problem accuracies behind a Best-of-N curve.

    per_problem[method][N] is a (P,) array: each problem's accuracy with N candidates.
    """

    num_problems: int
    n_max: int
    ns: list[int]
    per_problem: dict[str, dict[int, np.ndarray]]
    settings: dict[str, Any] = field(default_factory=dict)


def n_values(n_max: int) -> list[int]:
    """1, 2, 4, ... up to n_max, with n_max itself last. `n_values(6) == [1, 2, 4, 6]`."""
    if n_max < 1:
        raise ValueError(f"n_max must be >= 1, got {n_max}")
    ns = [2**k for k in range(n_max.bit_length())]
    return ns if ns[-1] == n_max else [*ns, n_max]


def check_candidate(c: Any) -> list[tuple[str, str]]:
    """Problems with one candidate dict as [(field, message)]; empty when it is valid."""
    if not isinstance(c, Mapping):
        return [("candidate", "must be an object {step_probs, answer, correct}")]
    errs = []
    probs = c.get("step_probs")
    if not isinstance(probs, (list, tuple, np.ndarray)):
        errs.append(("step_probs", "missing or not a list (one PRM probability per step; [] if no steps)"))
    else:
        for k, p in enumerate(probs):
            if isinstance(p, bool) or not isinstance(p, (int, float, np.floating)) or not 0.0 <= p <= 1.0:
                errs.append((f"step_probs[{k}]", f"{p!r} is not a probability in [0, 1] (store sigmoid outputs)"))
                break
    if "answer" not in c or not (c["answer"] is None or isinstance(c["answer"], str)):
        errs.append(("answer", "missing or not a string/null (the extracted final answer; null if none)"))
    if not isinstance(c.get("correct"), (bool, np.bool_)):
        errs.append(("correct", f"must be true or false, got {c.get('correct')!r}"))
    if not isinstance(c.get("truncated", False), (bool, np.bool_)):
        errs.append(("truncated", f"must be true or false (or absent), got {c.get('truncated')!r}"))
    return errs


def _candidate_arrays(
    problems: Sequence[Sequence[Mapping[str, Any]]],
    n_max: int,
    weighted_by: str,
    normalize: Callable[[str], str] | None,
    same: Callable[[str, str], bool] | None,
    edge_rules: EdgeRules = "mmprm",
) -> dict[str, np.ndarray]:
    """(P, n_max) arrays: one score matrix per aggregator, correct, truncated, answer groups, vote weights."""
    aggregators = MM_PRM_AGGREGATORS if edge_rules == "mm_prm" else AGGREGATORS
    scores = {name: np.empty((len(problems), n_max)) for name in AGGREGATORS}
    correct = np.zeros((len(problems), n_max), dtype=bool)
    truncated = np.zeros((len(problems), n_max), dtype=bool)
    groups = np.full((len(problems), n_max), -1, dtype=np.int64)
    for i, cands in enumerate(problems):
        cands = list(cands)[:n_max]
        for j, c in enumerate(cands):
            errs = check_candidate(c)
            if errs:
                fld, msg = errs[0]
                raise ValueError(f"problem {i} candidate {j}: {fld}: {msg}")
            truncated[i, j] = bool(c.get("truncated", False))
            for name, fn in aggregators.items():
                # A partial score must not win: `best_index` ranks a truncated candidate last; -inf keeps
                # its prefix score out of anything else that reads the matrix.
                scores[name][i, j] = -np.inf if truncated[i, j] else fn(c["step_probs"])
            correct[i, j] = bool(c["correct"])
        groups[i] = answer_groups([c["answer"] for c in cands], normalize, same)
    weights = np.where(truncated, 0.0, scores[weighted_by])
    if not (weights >= 0).all():
        raise ValueError(f"weighted_by={weighted_by!r} gives negative scores: use a probability-scale aggregator")
    return {"scores": scores, "correct": correct, "truncated": truncated, "groups": groups, "weights": weights}


def _subsets(rng: np.random.Generator, p: int, n_max: int, n: int, n_subsets: int) -> np.ndarray:
    """(P, K, n) sorted candidate indices: the full set, all combinations, or K random draws."""
    if n == n_max:
        return np.broadcast_to(np.arange(n_max), (p, 1, n))
    if math.comb(n_max, n) <= n_subsets:
        combos = np.asarray(list(itertools.combinations(range(n_max), n)))  # (K, n)
        return np.broadcast_to(combos, (p, *combos.shape))
    # A random permutation per (problem, draw); sorting keeps "lowest index wins" meaningful.
    return np.sort(rng.random((p, n_subsets, n_max)).argsort(-1)[..., :n], axis=-1)


_BLOCK = 2048  # problems per block in bon_curve


def bon_curve(
    problems: Sequence[Sequence[Mapping[str, Any]]],
    *,
    n_max: int | None = None,
    n_subsets: int = 32,
    seed: int = 0,
    weighted_by: str = "min",
    normalize: Callable[[str], str] | None = None,
    same: Callable[[str, str], bool] | None = None,
    ns: Sequence[int] | None = None,
    edge_rules: EdgeRules = "mmprm",
) -> BonCurve:
    """Per-problem Best-of-N accuracy of every method at every N.

    Args:
        problems: per problem, its candidates (dicts with step_probs, answer, correct).
        n_max: candidates per problem to use; default the smallest count over problems.
            Problems with more use their first n_max; fewer is an error.
        n_subsets: random subsets per problem and N (all subsets when there are fewer).
        seed: seed of the subset draws.
        weighted_by: aggregator whose scores weight `weighted_vote` (must be >= 0).
        normalize, same: answer equivalence for the votes (see `answer_groups`).
        ns: the subset sizes to compute, each in 1..n_max; default `n_values(n_max)`.
        edge_rules: how every aggregator treats empty candidates and p = 0 or 1: mmprm (clamped)
            or mm_prm (MM-PRM's sentinels; `mmprm.scoring.aggregators`).
    """
    if not problems:
        raise ValueError("bon_curve: no problems")
    aggregate(weighted_by, [], edge_rules)  # fails early on an unknown name or rules
    counts = [len(c) for c in problems]
    n_max = _check_n_max(counts, n_max)
    arr = _candidate_arrays(problems, n_max, weighted_by, normalize, same, edge_rules)
    rng = np.random.default_rng(seed)
    p = len(problems)
    ns = _check_ns(ns, n_max)
    # Every aggregator registered by now (`register_aggregator`), not only the built-in `METHODS`.
    methods = (*AGGREGATORS, *BASELINES)
    per_problem: dict[str, dict[int, np.ndarray]] = {m: {n: np.empty(p) for n in ns} for m in methods}
    for n in ns:
        # Problems in blocks (the draws are the same as for all at once: the generator's stream is
        # consumed in the same order), so the (block, K, n) subsets and (block, n, n) vote tensors
        # stay small at 100k problems x N=64.
        for lo in range(0, p, _BLOCK):
            hi = min(p, lo + _BLOCK)
            idx = _subsets(rng, hi - lo, n_max, n, n_subsets)  # (block, K, n)
            for method, acc in _block_accuracy(arr, idx, lo, hi, n_max).items():
                per_problem[method][n][lo:hi] = acc
    settings = {
        "n_subsets": n_subsets,
        "seed": seed,
        "weighted_by": weighted_by,
        "edge_rules": edge_rules,
        "truncated_problems": sum(c > n_max for c in counts),
        "tie_rule": "highest score, ties -> lowest candidate index; vote ties -> expected accuracy",
        "truncated_candidates": int(arr["truncated"].sum()),
        "candidates": p * n_max,
        "truncated_rule": "ranked last by every PRM aggregator, weight 0 in the weighted vote",
    }
    return BonCurve(p, n_max, ns, per_problem, settings)


def _check_n_max(counts: Sequence[int], n_max: int | None) -> int:
    """`n_max`, or the smallest candidate count when None; a problem with fewer candidates than
    n_max (or none) is a ValueError naming it."""
    if n_max is None:
        n_max = min(counts)
        if n_max == 0:
            raise ValueError(f"problem {counts.index(0)} has no candidates: drop it")
    if n_max < 1:
        raise ValueError(f"n_max must be >= 1, got {n_max}")
    for i, c in enumerate(counts):
        if c < n_max:
            raise ValueError(f"problem {i} has {c} candidates, need at least n_max={n_max}: drop it or lower n_max")
    return n_max


def _check_ns(ns: Sequence[int] | None, n_max: int) -> list[int]:
    """The subset sizes to compute, sorted without repeats: `n_values(n_max)` when None."""
    if ns is None:
        return n_values(n_max)
    bad = [n for n in ns if not 1 <= n <= n_max]
    if bad:
        raise ValueError(f"bon_curve: sizes {bad} are outside 1..n_max={n_max}")
    return sorted(set(ns))


def _block_accuracy(arr: dict[str, Any], idx: np.ndarray, lo: int, hi: int, n_max: int) -> dict[str, np.ndarray]:
    """Accuracy (block,) of every method on problems lo:hi, averaged over their candidate
    subsets `idx` (block, K, n); `arr` is `_candidate_arrays`' output."""
    k = idx.shape[1]

    def take(a: np.ndarray) -> np.ndarray:
        block = a[lo:hi, None, :]
        return np.take_along_axis(np.broadcast_to(block, (hi - lo, k, n_max)), idx, axis=-1)  # (block, K, n)

    out = {}
    corr, cut = take(arr["correct"]), take(arr["truncated"])
    for name, s in arr["scores"].items():
        pick = best_index(take(s), cut)[..., None]  # (block, K, 1)
        out[name] = np.take_along_axis(corr, pick, -1)[..., 0].mean(-1)
    out["random"] = corr.mean(-1).mean(-1)
    out["oracle"] = corr.any(-1).mean(-1)
    g, w = take(arr["groups"]), take(arr["weights"])
    # One subset draw at a time keeps the (block, n, n) vote tensors small for large N.
    out["majority"] = np.mean([vote_accuracy(g[:, j], np.ones_like(w[:, j]), corr[:, j]) for j in range(k)], axis=0)
    out["weighted_vote"] = np.mean([vote_accuracy(g[:, j], w[:, j], corr[:, j]) for j in range(k)], axis=0)
    return out


def summarize(curve: BonCurve, n_resamples: int = 1000, seed: int = 0) -> dict[str, Any]:
    """The report.json content: mean and 95% CI of every method at every N, plus the
    best aggregator at n_max against random (picked on the same data, so read it as a check,
    not an unbiased estimate)."""
    cells = [(name, n, acc) for name, by_n in curve.per_problem.items() for n, acc in by_n.items()]
    boot = resample_means(np.stack([acc for _, _, acc in cells]), n_resamples, seed)  # (B, cells)
    methods: dict[str, dict[str, dict[str, Any]]] = {}
    for k, (name, n, acc) in enumerate(cells):
        methods.setdefault(name, {})[str(n)] = {"mean": float(acc.mean()), "ci95": percentile_interval(boot[:, k])}
    top = str(curve.n_max)
    best = max(AGGREGATORS, key=lambda m: (methods[m][top]["mean"], -list(AGGREGATORS).index(m)))
    diff = paired_bootstrap(
        curve.per_problem[best][curve.n_max], curve.per_problem["random"][curve.n_max], n_resamples, seed
    )
    return {
        "num_problems": curve.num_problems,
        "n_max": curve.n_max,
        "truncated_candidates": curve.settings.get("truncated_candidates", 0),
        "methods": methods,
        "best_vs_random": {"method": best, "n": curve.n_max, **diff},
        "settings": {**curve.settings, "n_resamples": n_resamples, "bootstrap_seed": seed, "ns": curve.ns},
    }


def _markdown(report: dict[str, Any], title: str) -> str:
    ns = report["settings"]["ns"]
    lines = [
        f"# {title}",
        "",
        f"{report['num_problems']} problems, up to {report['n_max']} candidates each. Accuracy "
        "(mean over problems) with 95% bootstrap CI; N < n_max averages over "
        f"{report['settings']['n_subsets']} seeded candidate subsets (all subsets when fewer).",
        "",
    ]
    if report["settings"].get("truncated_problems"):
        lines += [
            f"**Candidate counts differ:** N goes up to {report['n_max']}; the "
            f"{report['settings']['truncated_problems']} problems with more use their first {report['n_max']} only.",
            "",
        ]
    lines += [
        "| method | " + " | ".join(f"N={n}" for n in ns) + " |",
        "|---|" + "---|" * len(ns),
    ]
    for name, by_n in report["methods"].items():
        cells = [f"{c['mean']:.3f} [{c['ci95'][0]:.3f}, {c['ci95'][1]:.3f}]" for c in (by_n[str(n)] for n in ns)]
        kind = " (baseline)" if name in BASELINES else ""
        lines.append(f"| {name}{kind} | " + " | ".join(cells) + " |")
    b = report["best_vs_random"]
    verdict = "beats" if b["ci95"][0] > 0 else "does not clearly beat"
    lines += [
        "",
        f"Best aggregator at N={b['n']}: **{b['method']}** {verdict} random: difference "
        f"{b['diff']:+.3f}, 95% CI [{b['ci95'][0]:+.3f}, {b['ci95'][1]:+.3f}] (paired bootstrap over problems).",
        "",
        f"Weighted vote weights: `{report['settings']['weighted_by']}` scores. Ties: {report['settings']['tie_rule']}.",
        "",
    ]
    rules = report["settings"].get("edge_rules", "mmprm")
    lines += [f"Edge rules of every aggregator: `{rules}`, {EDGE_RULES[rules]}.", ""]
    if report.get("truncated_candidates"):
        lines += [
            f"{report['truncated_candidates']} of {report['settings']['candidates']} candidates were truncated "
            "(steps past prm.max_length unscored): "
            f"{report['settings']['truncated_rule']}, so none wins on a partial score.",
            "",
        ]
    if report.get("extraction"):
        lines += [f"Answers extracted and judged by: {report['extraction']}.", ""]
    lines += [
        "![Best-of-N curve](bon_curve.png)",
        "",
    ]
    return "\n".join(lines)


def _plot(report: dict[str, Any], path: Path, title: str) -> None:
    # A bare Figure on the Agg canvas: no pyplot global state, works headless, leaves the
    # caller's backend alone.
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ns = report["settings"]["ns"]
    fig = Figure(figsize=(9, 5.2), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colors = matplotlib.colormaps["tab10"].colors  # aggregators take 0-7; baselines use 8, 9, gray, black
    markers = "o^vsDxP*"  # product and sum_logpr rank alike: distinct markers show both lines
    baseline_color = {"oracle": "black", "random": "0.5", "majority": colors[8], "weighted_vote": colors[9]}
    for k, (name, by_n) in enumerate(report["methods"].items()):
        y = [by_n[str(n)]["mean"] for n in ns]
        if name in BASELINES:
            ax.plot(ns, y, ls="--", marker="s", ms=4, lw=1.6, color=baseline_color[name], label=f"{name} (baseline)")
        else:
            ax.plot(
                ns,
                y,
                ls="-",
                marker=markers[k % len(markers)],
                ms=5,
                lw=1.6,
                color=colors[k % 8],
                label=name,
                alpha=0.9,
            )
    # The one comparison the report makes: shade the best aggregator's CI and random's.
    best = report["best_vs_random"]["method"]
    for name, color in ((best, colors[list(AGGREGATORS).index(best) % 8]), ("random", "0.5")):
        lo = [report["methods"][name][str(n)]["ci95"][0] for n in ns]
        hi = [report["methods"][name][str(n)]["ci95"][1] for n in ns]
        ax.fill_between(ns, lo, hi, color=color, alpha=0.12, lw=0)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns)
    ax.set_xticklabels([str(n) for n in ns])
    ax.set_xlabel("N (candidates per problem)")
    ax.set_ylabel("accuracy")
    ax.set_title(f"{title}\n{report['num_problems']} problems; shaded: 95% CI of {best} and random", fontsize=11)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=9, frameon=False)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")


def _atomic_write(path: Path, text: str) -> None:
    from mmprm.data.schema import atomic_write

    with atomic_write(path) as f:
        f.write(text)


def category_breakdown(curve: BonCurve, metas: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Accuracy at n_max of every method per value of each column the problems' benchmark breaks
    its results down by (`meta["breakdown"]`, e.g. MathVerse's problem version).

    metas: per problem of `curve`, in order, its `meta`. A list-valued column (MathVista's skills)
    counts a problem under each of its values. Returns {column: {value: {"problems": k,
    method: accuracy}}}; empty when no problem names a breakdown.
    """
    from mmprm.data.eval_sets import breakdown_groups

    if len(metas) != curve.num_problems:
        raise ValueError(f"{len(metas)} metas for {curve.num_problems} problems")
    n = curve.n_max
    return {
        col: {
            v: {"problems": len(idx), **{m: float(acc[n][idx].mean()) for m, acc in curve.per_problem.items()}}
            for v, idx in values.items()
        }
        for col, values in breakdown_groups(metas).items()
    }


def _breakdown_markdown(report: dict[str, Any]) -> list[str]:
    lines = []
    methods = list(report["methods"])
    for col, values in report.get("by_category", {}).items():
        lines += [
            f"## By {col} (N={report['n_max']})",
            "",
            f"| {col} | problems | " + " | ".join(methods) + " |",
            "|---|---|" + "---|" * len(methods),
        ]
        lines += [
            f"| {v} | {row['problems']} | " + " | ".join(f"{row[m]:.3f}" for m in methods) + " |"
            for v, row in values.items()
        ]
        lines.append("")
    return lines


def write_report(
    curve: BonCurve,
    out_dir: str | Path,
    title: str = "Best-of-N accuracy",
    n_resamples: int = 1000,
    seed: int = 0,
    metas: Sequence[Mapping[str, Any]] | None = None,
    extraction: str | None = None,
) -> dict[str, Any]:
    """Write report.json, report.md and bon_curve.png to `out_dir`; return the JSON dict.

    With `metas` (each problem's `meta`), the report adds accuracy by each column the benchmark
    breaks its results down by (`category_breakdown`). `extraction` (how the verdicts' answers were
    extracted) is stated in both files.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = summarize(curve, n_resamples, seed)
    breakdown = category_breakdown(curve, metas) if metas is not None else {}
    if breakdown:
        report["by_category"] = breakdown
    if extraction is not None:
        report["extraction"] = extraction
    _atomic_write(out / "report.json", json.dumps(report, indent=2) + "\n")
    _atomic_write(out / "report.md", "\n".join([_markdown(report, title), *_breakdown_markdown(report)]))
    _plot(report, out / "bon_curve.png", title)
    return report


def read_candidates(path: str | Path) -> list[list[dict[str, Any]]]:
    """Read a candidates JSONL, one problem per line: `{"id": ..., "candidates": [...]}`.

    Every line is checked first; raises `DataError` listing `FILE:LINE: id=...: field: what`.
    """
    from mmprm.data.schema import iter_jsonl, raise_if_bad, row_id

    problems: list[list[dict[str, Any]]] = []
    bad: list[str] = []
    for lineno, row, err in iter_jsonl(path):
        if err:
            bad.append(f"{path}:{lineno}: id=?: line: {err}")
            continue
        rid, cands = row_id(row), row.get("candidates")
        if not isinstance(cands, list) or not cands:
            bad.append(
                f"{path}:{lineno}: id={rid}: candidates: missing or empty (a list of "
                "{step_probs, answer, correct} objects)"
            )
            continue
        for j, c in enumerate(cands):
            bad += [f"{path}:{lineno}: id={rid}: candidates[{j}].{fld}: {msg}" for fld, msg in check_candidate(c)]
        problems.append(cands)
    raise_if_bad(path, bad, len(problems))
    return problems


def cli_bon_report(argv: list[str]) -> int:
    """`mmprm bon-report --candidates C.jsonl --out DIR`: Best-of-N curve from scored candidates."""
    ap = argparse.ArgumentParser(prog="mmprm bon-report", description=cli_bon_report.__doc__)
    ap.add_argument(
        "--candidates",
        required=True,
        help="JSONL, one problem per line: {id, candidates: [{step_probs, answer, correct}]}",
    )
    ap.add_argument("--out", required=True, help="folder for report.json, report.md, bon_curve.png")
    ap.add_argument("--n-max", type=int, default=None)
    ap.add_argument("--n-subsets", type=int, default=32)
    ap.add_argument("--resamples", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--weighted-by", default="min", choices=[m for m in AGGREGATORS if m not in ("sum_logpr", "sum_logodds")]
    )
    ap.add_argument(
        "--answer-match",
        default="strip",
        choices=["strip", "math"],
        help="vote grouping: exact after strip, or mmprm.answers.answers_match",
    )
    ap.add_argument(
        "--edge-rules",
        default="mmprm",
        choices=list(EDGE_RULES),
        help="aggregators' edge rules: mmprm (clamped) or mm_prm (MM-PRM's: empty -> 0, +/-9999)",
    )
    ap.add_argument("--title", default="Best-of-N accuracy")
    args = ap.parse_args(argv)
    same = None
    if args.answer_match == "math":
        from mmprm.answers import answers_match

        same = answers_match
    try:
        problems = read_candidates(args.candidates)
        curve = bon_curve(
            problems,
            n_max=args.n_max,
            n_subsets=args.n_subsets,
            seed=args.seed,
            weighted_by=args.weighted_by,
            same=same,
            edge_rules=args.edge_rules,
        )
    except ValueError as e:
        print(f"mmprm bon-report: {e}", file=sys.stderr)
        return 2
    report = write_report(curve, args.out, args.title, args.resamples, args.seed)
    b = report["best_vs_random"]
    print(
        f"wrote {args.out}/report.json, report.md, bon_curve.png; best {b['method']} vs random at "
        f"N={b['n']}: {b['diff']:+.3f} [{b['ci95'][0]:+.3f}, {b['ci95'][1]:+.3f}]"
    )
    return 0
