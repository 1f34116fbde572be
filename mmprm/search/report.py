"""Search report: accuracy with bootstrap intervals and cost per search setting, and the
equal-budget comparison with Best-of-N and majority vote (table + accuracy-vs-tokens PNG).

Inputs are plain rows (what `recipes/prm_search.py` writes):

    search rows, per setting:  {"id", "correct": bool, "stats": {"generated_tokens", "prm_sequences", "seconds"}}
    Best-of-N rows:            {"id", "candidates": [{"step_probs", "answer", "correct", "tokens"}, ...]}

Best-of-N at N is `mmprm.rerank.report.bon_curve` (each problem's accuracy averaged over subsets
of N of its candidates; the PRM pick uses the search's aggregator); its generated tokens at N are
N times the problem's mean tokens per candidate (the expected cost of a random subset of N). All
intervals are 95% percentile bootstraps over problems with the same resamples for every method, so
a difference between two methods is paired (`paired_bootstrap`). A search setting is matched to
the Best-of-N size whose mean generated tokens per problem are closest.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mmprm.scoring.stats import bootstrap_mean, paired_bootstrap


def bon_points(
    bon_rows: Sequence[Mapping[str, Any]], ns: Sequence[int], aggregator: str, n_subsets: int = 32, seed: int = 0
) -> dict[str, dict[int, dict[str, np.ndarray]]]:
    """Per-problem accuracy and generated tokens of PRM Best-of-N and majority vote at each N.

    Returns {"bon_prm": {N: {"acc": (P,), "tokens": (P,)}}, "majority": {...}, "single": {1: ...}}
    in the row order; "single" is one sampled solution (the expected accuracy of a random pick).
    """
    from mmprm.answers import answers_match
    from mmprm.rerank.report import bon_curve

    n_max = max(ns)
    problems = [row["candidates"][:n_max] for row in bon_rows]
    curve = bon_curve(
        problems,
        n_max=n_max,
        n_subsets=n_subsets,
        seed=seed,
        weighted_by="min",
        same=lambda a, b: answers_match(a, b),
        ns=ns,
    )
    per_candidate = np.asarray([np.mean([c["tokens"] for c in cands]) for cands in problems])  # (P,)
    out: dict[str, dict[int, dict[str, np.ndarray]]] = {
        "bon_prm": {},
        "majority": {},
        "single": {1: {"acc": curve.per_problem["random"][n_max], "tokens": per_candidate}},
    }
    for n in ns:
        out["bon_prm"][n] = {"acc": curve.per_problem[aggregator][n], "tokens": per_candidate * n}
        out["majority"][n] = {"acc": curve.per_problem["majority"][n], "tokens": per_candidate * n}
    return out


def search_report(
    search_runs: Mapping[str, Sequence[Mapping[str, Any]]],
    bon_rows: Sequence[Mapping[str, Any]] | None = None,
    bon_ns: Sequence[int] = (4, 8, 16),
    aggregator: str = "min",
    n_resamples: int = 1000,
    seed: int = 0,
) -> dict[str, Any]:
    """The report.json content (pure: rows in, numbers out).

    Args:
        search_runs: setting label -> per-problem rows (same problems, same order, in every run).
        bon_rows: Best-of-N candidates of the same problems, or None for no comparison.
        bon_ns: Best-of-N sizes to compare at (each at most the candidates per problem).
        aggregator: the PRM aggregator Best-of-N picks with (the search's).
    """
    methods: dict[str, dict[str, Any]] = {}
    per_problem: dict[str, np.ndarray] = {}
    ids: list[str] | None = None
    for label, rows in search_runs.items():
        ids, rows = _align_rows(rows, ids, f"search run {label!r}")
        per_problem[label], methods[label] = _search_method(rows, n_resamples, seed)
    truncated = None
    if bon_rows is not None:
        ids, bon_rows = _align_rows(bon_rows, ids, "Best-of-N rows")
        n_max = max(bon_ns)
        truncated = sum(bool(c.get("truncated")) for r in bon_rows for c in r["candidates"][:n_max])
        for label, acc, method in _bon_methods(bon_rows, bon_ns, aggregator, n_resamples, seed):
            per_problem[label], methods[label] = acc, method
    return {
        "num_problems": len(ids or []),
        "aggregator": aggregator,
        "methods": methods,
        "matched": _equal_budget_matches(methods, per_problem, n_resamples, seed),
        "settings": {
            "n_resamples": n_resamples,
            "seed": seed,
            "bon_ns": list(bon_ns),
            "bon_truncated_candidates": truncated,
            "tokens": "generated tokens of the policy's text (EOS and prompts not counted)",
        },
    }


def _align_rows(
    rows: Sequence[Mapping[str, Any]], ids: list[str] | None, what: str
) -> tuple[list[str], list[Mapping[str, Any]]]:
    """(ids, rows in that id order): `ids` is the first run's problem order (None: take this run's).

    Shards and resumed runs may order rows differently, so every run is aligned on the first
    one's ids; a run that covers other problems, or repeats one, is a ValueError naming `what`.
    """
    by_id = {str(r["id"]): r for r in rows}
    if ids is None:
        ids = list(by_id)
    if set(by_id) != set(ids) or len(by_id) != len(rows):
        raise ValueError(f"{what}: covers other problems than the first run (or repeats one): rerun it")
    return ids, [by_id[i] for i in ids]


def _search_method(rows: Sequence[Mapping[str, Any]], n_resamples: int, seed: int) -> tuple[np.ndarray, dict[str, Any]]:
    """(per-problem accuracy (P,), report entry) of one search setting: accuracy with its
    interval, mean cost per problem, the share of searches that finished, and nodes cut."""
    acc = np.asarray([float(bool(r["correct"])) for r in rows])
    st = [r["stats"] for r in rows]
    return acc, {
        "kind": "search",
        **bootstrap_mean(acc, n_resamples, seed),
        "tokens_per_problem": float(np.mean([s["generated_tokens"] for s in st])),
        "prm_sequences_per_problem": float(np.mean([s["prm_sequences"] for s in st])),
        "seconds_per_problem": float(np.mean([s["seconds"] for s in st])),
        "finished_share": float(np.mean([bool(r.get("complete")) for r in rows])),
        "cut_nodes": int(sum(s.get("cut_nodes", 0) for s in st)),
    }


def _bon_methods(
    bon_rows: Sequence[Mapping[str, Any]], bon_ns: Sequence[int], aggregator: str, n_resamples: int, seed: int
) -> list[tuple[str, np.ndarray, dict[str, Any]]]:
    """(label, per-problem accuracy (P,), report entry) of PRM Best-of-N and majority vote at
    each N, and of one sample, in `bon_points` order."""
    out = []
    for kind, by_n in bon_points(bon_rows, bon_ns, aggregator, seed=seed).items():
        for n, pts in by_n.items():
            label = {
                "bon_prm": f"Best-of-N (PRM {aggregator}) N={n}",
                "majority": f"majority vote N={n}",
                "single": "one sample",
            }[kind]
            method = {
                "kind": kind,
                "n": n,
                **bootstrap_mean(pts["acc"], n_resamples, seed),
                "tokens_per_problem": float(pts["tokens"].mean()),
                "prm_sequences_per_problem": float(n if kind == "bon_prm" else 0),
            }
            out.append((label, pts["acc"], method))
    return out


def _equal_budget_matches(
    methods: Mapping[str, Mapping[str, Any]], per_problem: Mapping[str, np.ndarray], n_resamples: int, seed: int
) -> list[dict[str, Any]]:
    """Each search setting against the PRM Best-of-N size closest in generated tokens (on a log
    scale), with the paired bootstrap of their accuracy difference; [] without Best-of-N."""
    matches = []
    bon_labels = [m for m, v in methods.items() if v["kind"] == "bon_prm"]
    for label, v in methods.items():
        if v["kind"] != "search" or not bon_labels:
            continue
        near = min(
            bon_labels,
            key=lambda b: (
                abs(math.log(methods[b]["tokens_per_problem"] + 1) - math.log(v["tokens_per_problem"] + 1)),
                b,
            ),
        )
        matches.append(
            {
                "search": label,
                "bon": near,
                "search_tokens": v["tokens_per_problem"],
                "bon_tokens": methods[near]["tokens_per_problem"],
                "search_acc": v["mean"],
                "bon_acc": methods[near]["mean"],
                **paired_bootstrap(per_problem[label], per_problem[near], n_resamples, seed),
            }
        )
    return matches


def _markdown(report: dict[str, Any], title: str) -> str:
    lines = [
        f"# {title}",
        "",
        f"{report['num_problems']} problems; accuracy with 95% bootstrap interval over problems; cost per "
        f"problem: generated tokens (policy text, prompts not counted), PRM-scored sequences, wall seconds.",
        "",
        "| method | accuracy [95% CI] | gen. tokens / problem | PRM sequences / problem | s / problem |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, m in sorted(report["methods"].items(), key=lambda kv: kv[1]["tokens_per_problem"]):
        secs = f"{m['seconds_per_problem']:.2f}" if "seconds_per_problem" in m else "-"
        lines.append(
            f"| {name} | {m['mean']:.3f} [{m['ci95'][0]:.3f}, {m['ci95'][1]:.3f}] | "
            f"{m['tokens_per_problem']:.0f} | {m['prm_sequences_per_problem']:.1f} | {secs} |"
        )
    if report["matched"]:
        lines += [
            "",
            "## Equal budget: search vs Best-of-N with the same PRM",
            "",
            "Each search setting against the Best-of-N size with the closest generated tokens; the difference "
            "is paired over problems (95% bootstrap CI; above zero = search wins).",
            "",
            "| search | tokens | Best-of-N | tokens | search acc | BoN acc | diff [95% CI] |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for m in report["matched"]:
            lines.append(
                f"| {m['search']} | {m['search_tokens']:.0f} | {m['bon']} | {m['bon_tokens']:.0f} | "
                f"{m['search_acc']:.3f} | {m['bon_acc']:.3f} | {m['diff']:+.3f} "
                f"[{m['ci95'][0]:+.3f}, {m['ci95'][1]:+.3f}] |"
            )
    cut = {name: m["cut_nodes"] for name, m in report["methods"].items() if m.get("cut_nodes")}
    truncated = report["settings"].get("bon_truncated_candidates")
    if cut or truncated:
        lines += [
            "",
            "Cut by the PRM's `prm.max_length` (their last steps unscored; raise it to score them): "
            + "; ".join(
                [f"{name}: {n} search nodes, never kept or chosen" for name, n in cut.items()]
                + ([f"Best-of-N: {truncated} candidates, ranked last by the PRM"] if truncated else [])
            )
            + ".",
        ]
    lines += ["", "![accuracy vs generated tokens](search_vs_bon.png)", ""]
    return "\n".join(lines)


def _plot(report: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    methods = report["methods"]
    for kind, style, name in (
        ("bon_prm", "o-", f"Best-of-N (PRM, {report['aggregator']})"),
        ("majority", "s--", "majority vote"),
        ("single", "kx", "one sample"),
    ):
        pts = sorted((m for m in methods.values() if m["kind"] == kind), key=lambda m: m["tokens_per_problem"])
        if pts:
            x = [m["tokens_per_problem"] for m in pts]
            y = [m["mean"] for m in pts]
            err = [[m["mean"] - m["ci95"][0] for m in pts], [m["ci95"][1] - m["mean"] for m in pts]]
            ax.errorbar(x, y, yerr=err, fmt=style, capsize=3, label=name)
            for m, xi, yi in zip(pts, x, y) if kind != "single" else ():
                ax.annotate(f"N={m['n']}", (xi, yi), textcoords="offset points", xytext=(4, -12), fontsize=7)
    markers = {"beam": "^", "dvts": "D", "best_first": "*"}
    for label, m in methods.items():
        if m["kind"] == "search":
            ax.errorbar(
                [m["tokens_per_problem"]],
                [m["mean"]],
                yerr=[[m["mean"] - m["ci95"][0]], [m["ci95"][1] - m["mean"]]],
                fmt=markers.get(label.split()[0], "x"),
                markersize=9,
                capsize=3,
                label=label,
            )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("generated tokens per problem (log scale)")
    ax.set_ylabel("accuracy")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_search_report(report: dict[str, Any], out_dir: str | Path, title: str = "PRM-guided search") -> Path:
    """report.json, report.md and search_vs_bon.png in `out_dir`; returns the markdown path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, out / "search_vs_bon.png", title)
    md = out / "report.md"
    md.write_text(_markdown(report, title))
    return md
