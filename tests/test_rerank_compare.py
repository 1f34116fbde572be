"""Picking the aggregator on dev and comparing two reward models on the same test problems."""

import numpy as np
import pytest

from mmprm.rerank.compare import choose_on_dev, compare_at
from mmprm.rerank.report import BonCurve


def _curve(per_method: dict[str, list[float]], n: int = 2) -> BonCurve:
    return BonCurve(
        num_problems=len(next(iter(per_method.values()))),
        n_max=n,
        ns=[1, n],
        per_problem={m: {n: np.asarray(v, dtype=float)} for m, v in per_method.items()},
    )


def test_choose_on_dev_takes_the_highest_dev_mean_and_breaks_ties_by_order():
    dev = _curve({"min": [1, 0, 0, 0], "average": [1, 1, 0, 0], "last": [0, 1, 1, 0]})
    # min 0.25, average 0.5, last 0.5: the tie goes to the one listed first
    assert choose_on_dev(dev, ["min", "average", "last"]) == "average"
    assert choose_on_dev(dev, ["min", "last", "average"]) == "last"
    with pytest.raises(ValueError, match="no N=4"):
        choose_on_dev(dev, ["min"], n=4)


def test_compare_at_is_the_paired_mean_difference_with_its_interval():
    a = _curve({"min": [1, 1, 0, 1]})
    b = _curve({"last": [1, 0, 0, 0]})
    out = compare_at(a, "min", b, "last", n=2, n_resamples=2000, seed=0)
    # per-problem differences 0, 1, 0, 1: mean 0.5; a resample mean is k/4 for k = 0..4
    assert (out["a"], out["b"], out["diff"]) == (0.75, 0.25, 0.5)
    lo, hi = out["ci95"]
    assert 0.0 <= lo <= 0.5 <= hi <= 1.0 and {lo * 4, hi * 4} <= {0.0, 1.0, 2.0, 3.0, 4.0}
    # identical per-problem accuracies: the difference and its interval are exactly zero
    assert compare_at(a, "min", a, "min", n=2)["ci95"] == [0.0, 0.0]
    with pytest.raises(ValueError, match="same candidates"):
        compare_at(a, "min", _curve({"last": [1, 0]}), "last", n=2)
