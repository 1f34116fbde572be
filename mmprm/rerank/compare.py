"""Comparing reward models on one set of Best-of-N candidates: pick on dev, report on test.

Pure functions over `BonCurve`s (see `mmprm.rerank.report.bon_curve`): the aggregator is chosen
on a dev split and only then read on the test split, and two models are compared by a paired
bootstrap over the same test problems.

    dev = bon_curve(dev_candidates)      # one curve per split and model
    best = choose_on_dev(dev)            # e.g. "min"
    diff = compare_at(test_prm, best, test_orm, "last", n=8)   # {"diff", "ci95"}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mmprm.rerank.report import BonCurve
from mmprm.scoring.aggregators import AGGREGATORS
from mmprm.scoring.stats import paired_bootstrap


def choose_on_dev(dev: BonCurve, candidates: Sequence[str] = tuple(AGGREGATORS), n: int | None = None) -> str:
    """The aggregator with the highest mean dev accuracy at `n` (default n_max); ties -> earliest listed.

    Example: dev accuracies at N=8 min 0.50, average 0.55, last 0.55 -> "average".
    """
    n = dev.n_max if n is None else n
    if not candidates:
        raise ValueError("choose_on_dev: no candidate aggregators")
    missing = [m for m in candidates if m not in dev.per_problem or n not in dev.per_problem[m]]
    if missing:
        raise ValueError(f"choose_on_dev: the dev curve has no N={n} accuracies for {missing}")
    return max(candidates, key=lambda m: (float(dev.per_problem[m][n].mean()), -list(candidates).index(m)))


def compare_at(
    a: BonCurve, method_a: str, b: BonCurve, method_b: str, n: int, n_resamples: int = 1000, seed: int = 0
) -> dict[str, Any]:
    """Mean accuracy of a's `method_a` minus b's `method_b` at N=n, 95% paired bootstrap CI over problems.

    Both curves must be over the same problems in the same order (e.g. two reward models scoring
    one candidates file). Returns {"a", "b", "diff", "ci95"} with a's and b's mean accuracies.
    """
    if a.num_problems != b.num_problems:
        raise ValueError(f"compare_at: {a.num_problems} vs {b.num_problems} problems (score the same candidates)")
    acc_a, acc_b = a.per_problem[method_a][n], b.per_problem[method_b][n]
    return {
        "a": float(acc_a.mean()),
        "b": float(acc_b.mean()),
        **paired_bootstrap(acc_a, acc_b, n_resamples=n_resamples, seed=seed),
    }
