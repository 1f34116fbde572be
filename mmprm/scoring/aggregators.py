"""Step scores -> one solution score.

A PRM gives one probability per step; Best-of-N needs one number per candidate. Every aggregator
here is a pure function `list[float] -> float` where a higher value means "more likely correct".

Numerical rules, the same for every aggregator:

* Probabilities are clamped to `[EPS, 1 - EPS]` with `EPS = 1e-6` before any log or odds, so
  p = 0 and p = 1 give finite values (log(1e-6) ~ -13.8 per step) and no sentinel numbers.
* An empty candidate (no steps parsed) is scored as a solution whose probability of being
  correct is exactly 0, unclamped: 0.0 for the probability-scale aggregators (min, average, max,
  last, product, mean_odds) and -inf for the log-scale ones (sum_logpr, sum_logodds). Any
  candidate with at least one step scores strictly higher (product can underflow to 0.0 after
  ~50 steps at EPS and then ties with an empty candidate).
* Picking: the highest score wins, ties go to the lowest candidate index, and a candidate
  scored on a truncated prefix ranks last, below an empty one too
  (`mmprm.scoring.selection.pick_best`).

`MM_PRM_AGGREGATORS` (`aggregate(..., rules="mm_prm")`) are the same eight with MM-PRM's edge rules
instead (github:ModalMinds/MM-PRM@b914fd66c8efb3d6667610fba1f8fd1e55cde095:eval/prm/extract_calculate.py):
no clamping; an empty candidate scores 0 under every aggregator; a step with p = 0 adds -9999 to
`sum_logpr`, and p = 1 adds +9999 to `sum_logodds` and counts 9999 in `mean_odds`. MM-PRM's
`sum_logit` raises on p = 0; here that step adds -9999.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

EPS = 1e-6
"""Clamp for step probabilities: every p is read as min(max(p, EPS), 1 - EPS)."""

Aggregator = Callable[[Sequence[float]], float]


def _clamped(probs: Sequence[float]) -> list[float]:
    out = []
    for i, p in enumerate(probs):
        p = float(p)
        # NaN fails both comparisons, so it is caught here too.
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"step {i}: probability {p!r} is outside [0, 1]; pass sigmoid/softmax outputs")
        out.append(min(max(p, EPS), 1.0 - EPS))
    return out


def agg_min(probs: Sequence[float]) -> float:
    """Weakest step: a chain is as good as its worst link. Empty -> 0.0."""
    ps = _clamped(probs)
    return min(ps) if ps else 0.0


def agg_average(probs: Sequence[float]) -> float:
    """Mean step probability. Empty -> 0.0."""
    ps = _clamped(probs)
    return sum(ps) / len(ps) if ps else 0.0


def agg_max(probs: Sequence[float]) -> float:
    """Best step (a weak baseline: one good step hides the rest). Empty -> 0.0."""
    ps = _clamped(probs)
    return max(ps) if ps else 0.0


def agg_last(probs: Sequence[float]) -> float:
    """Last step, which in mmprm carries the final answer. Empty -> 0.0."""
    ps = _clamped(probs)
    return ps[-1] if ps else 0.0


def agg_product(probs: Sequence[float]) -> float:
    """Product of step probabilities (all steps right, if independent). Empty -> 0.0."""
    ps = _clamped(probs)
    return math.prod(ps) if ps else 0.0


def agg_sum_logpr(probs: Sequence[float]) -> float:
    """Sum of log p: the log of `product`, without its underflow. Empty -> -inf."""
    ps = _clamped(probs)
    return sum(math.log(p) for p in ps) if ps else -math.inf


def agg_sum_logodds(probs: Sequence[float]) -> float:
    """Sum of log(p / (1 - p)): confident-good steps add, doubtful steps subtract. Empty -> -inf."""
    ps = _clamped(probs)
    return sum(math.log(p) - math.log1p(-p) for p in ps) if ps else -math.inf


def agg_mean_odds(probs: Sequence[float]) -> float:
    """Mean of p / (1 - p); at most (1 - EPS) / EPS ~ 1e6 per step. Empty -> 0.0."""
    ps = _clamped(probs)
    return sum(p / (1.0 - p) for p in ps) / len(ps) if ps else 0.0


AGGREGATORS: dict[str, Aggregator] = {
    "min": agg_min,
    "average": agg_average,
    "max": agg_max,
    "last": agg_last,
    "product": agg_product,
    "sum_logpr": agg_sum_logpr,
    "sum_logodds": agg_sum_logodds,
    "mean_odds": agg_mean_odds,
}
"""Aggregator name -> fn(step probabilities) -> solution score (higher is better)."""


MM_PRM_SENTINEL = 9999.0
"""MM-PRM's stand-in for log(0) (as -9999) and for log-odds and odds of p = 1."""


def _in_range(probs: Sequence[float]) -> list[float]:
    out = [float(p) for p in probs]
    _clamped(out)  # the same range check, its clamped values unused
    return out


def _mm_prm(step: Callable[[float], float], mean: bool = False) -> Aggregator:
    """A sum (or mean) of `step(p)` over the steps; 0 for an empty candidate."""

    def agg(probs: Sequence[float]) -> float:
        ps = _in_range(probs)
        if not ps:
            return 0.0
        total = sum(step(p) for p in ps)
        return total / len(ps) if mean else total

    return agg


def _mm_prm_logodds(p: float) -> float:
    if p == 1.0:
        return MM_PRM_SENTINEL
    return -MM_PRM_SENTINEL if p == 0.0 else math.log(p / (1.0 - p))


MM_PRM_AGGREGATORS: dict[str, Aggregator] = {
    "min": lambda probs: min(_in_range(probs), default=0.0),
    "average": _mm_prm(lambda p: p, mean=True),
    "max": lambda probs: max(_in_range(probs), default=0.0),
    "last": lambda probs: (_in_range(probs) or [0.0])[-1],
    "product": lambda probs: math.prod(ps) if (ps := _in_range(probs)) else 0.0,
    "sum_logpr": _mm_prm(lambda p: math.log(p) if p != 0.0 else -MM_PRM_SENTINEL),
    "sum_logodds": _mm_prm(_mm_prm_logodds),
    "mean_odds": _mm_prm(lambda p: p / (1.0 - p) if p != 1.0 else MM_PRM_SENTINEL, mean=True),
}
"""The aggregators of `AGGREGATORS` (same names) with MM-PRM's edge rules (module docstring)."""

EdgeRules = Literal["mmprm", "mm_prm"]


def register_aggregator(name: str, fn: Aggregator, mm_prm: Aggregator | None = None) -> None:
    """Add an aggregator under `name`: Best-of-N reports it beside the built-in ones, and every
    `aggregator` setting (bon_rerank's report.weighted_by, prm_search's search.aggregator) accepts it.

    Args:
        name: a new name.
        fn: step probabilities -> solution score, higher is better (mmprm's edge rules).
        mm_prm: the same under MM-PRM's edge rules (`aggregate(..., rules="mm_prm")`); default `fn`.

    Raises:
        ValueError: the name is taken.
    """
    if name in AGGREGATORS:
        raise ValueError(f"aggregator {name!r}: already registered; choose another name")
    AGGREGATORS[name] = fn
    MM_PRM_AGGREGATORS[name] = mm_prm or fn


def aggregate(name: str, probs: Sequence[float], rules: EdgeRules = "mmprm") -> float:
    """Score one candidate with the aggregator called `name` (raises on an unknown name), under
    mmprm's edge rules (clamped, empty -> lowest) or MM-PRM's (`MM_PRM_AGGREGATORS`)."""
    if name not in AGGREGATORS:
        raise ValueError(f"unknown aggregator {name!r}: choose one of {', '.join(AGGREGATORS)}")
    if rules not in ("mmprm", "mm_prm"):
        raise ValueError(f"edge rules {rules!r}: choose mmprm or mm_prm")
    return (MM_PRM_AGGREGATORS if rules == "mm_prm" else AGGREGATORS)[name](probs)
