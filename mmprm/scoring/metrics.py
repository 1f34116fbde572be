"""Step-level PRM metrics: calibration, classification, ranking and first-error detection.

Every function takes per-solution lists, the shape `PRMScorer.score` returns and
`StepExample.labels` holds::

    scores = [[0.9, 0.8, 0.2], [0.95, 0.9]]   # predicted P(step correct)
    labels = [[1.0, 1.0, 0.0], [1.0, 0.7]]    # soft or hard labels in [0, 1]

Conventions: a step is *predicted correct* when its score is >= threshold (an error when
< threshold); a soft label counts as *correct* when it is >= 0.5. First-error indices are
0-based, None for a solution with no error. Ratios with an empty denominator are NaN
(documented per function), never a silent 0 or 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

EPS = 1e-6
"""Probabilities are clamped to [EPS, 1 - EPS] inside `bce` so a confident miss stays finite."""

LABEL_THRESHOLD = 0.5
"""A soft label >= this is a correct step."""


def _flat(scores: Sequence[Sequence[float]], labels: Sequence[Sequence[float]]) -> tuple[np.ndarray, np.ndarray]:
    """Flatten per-solution lists to (S,) arrays after checking they line up."""
    if len(scores) != len(labels):
        raise ValueError(f"{len(scores)} scored solutions but {len(labels)} labelled solutions")
    for i, (s, y) in enumerate(zip(scores, labels)):
        if len(s) != len(y):
            raise ValueError(f"solution {i}: {len(s)} step scores but {len(y)} step labels")
    for name, rows in (("score", scores), ("label", labels)):
        for i, row in enumerate(rows):
            for k, v in enumerate(row):
                # NaN fails both comparisons, so it is caught too.
                if not 0.0 <= float(v) <= 1.0:
                    raise ValueError(f"solution {i} step {k}: {name} {float(v)} is outside [0, 1]")
    p = np.asarray([float(v) for s in scores for v in s], dtype=float)
    t = np.asarray([float(v) for y in labels for v in y], dtype=float)
    return p, t


def bce(scores: Sequence[Sequence[float]], labels: Sequence[Sequence[float]]) -> float:
    """Mean binary cross-entropy against soft targets, -[t log p + (1-t) log(1-p)]; NaN if no steps."""
    p, t = _flat(scores, labels)
    if p.size == 0:
        return math.nan
    p = np.clip(p, EPS, 1 - EPS)
    return float(-(t * np.log(p) + (1 - t) * np.log1p(-p)).mean())


def brier(scores: Sequence[Sequence[float]], labels: Sequence[Sequence[float]]) -> float:
    """Mean squared error (p - t)^2 over steps; NaN if no steps."""
    p, t = _flat(scores, labels)
    return float(((p - t) ** 2).mean()) if p.size else math.nan


def step_accuracy(
    scores: Sequence[Sequence[float]], labels: Sequence[Sequence[float]], threshold: float = 0.5
) -> float:
    """Share of steps where (score >= threshold) equals (label >= 0.5); NaN if no steps."""
    p, t = _flat(scores, labels)
    if p.size == 0:
        return math.nan
    return float(((p >= threshold) == (t >= LABEL_THRESHOLD)).mean())


def step_f1(
    scores: Sequence[Sequence[float]], labels: Sequence[Sequence[float]], threshold: float = 0.5
) -> dict[str, float]:
    """F1 of the correct-step class, of the error-step class, and their mean (VisualProcessBench).

    F1 = 2TP / (2TP + FP + FN) per class; NaN when a class is absent from both truth and
    prediction (and then macro_f1 is NaN too).

    Returns:
        {"f1_correct", "f1_error", "macro_f1"}
    """
    p, t = _flat(scores, labels)
    pred, true = p >= threshold, t >= LABEL_THRESHOLD
    out = {}
    for name, pc, tc in (("f1_correct", pred, true), ("f1_error", ~pred, ~true)):
        tp, fp, fn = int((pc & tc).sum()), int((pc & ~tc).sum()), int((~pc & tc).sum())
        out[name] = 2 * tp / (2 * tp + fp + fn) if (2 * tp + fp + fn) else math.nan
    out["macro_f1"] = (out["f1_correct"] + out["f1_error"]) / 2
    return out


def auroc(scores: Sequence[Sequence[float]], labels: Sequence[Sequence[float]]) -> float:
    """Area under the ROC curve for telling correct steps (label >= 0.5) from errors.

    Exact Mann-Whitney statistic with average ranks for tied scores, so a tie between a correct
    and an erroneous step counts one half. NaN when only one class is present.
    """
    p, t = _flat(scores, labels)
    pos = t >= LABEL_THRESHOLD
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return math.nan
    order = np.argsort(p, kind="stable")
    sorted_p = p[order]
    ranks = np.empty(p.size)
    # Each run of equal scores gets the mean of the 1-based ranks it spans.
    starts = np.flatnonzero(np.r_[True, sorted_p[1:] != sorted_p[:-1]])
    ends = np.r_[starts[1:], p.size]
    for s, e in zip(starts, ends):
        ranks[order[s:e]] = (s + 1 + e) / 2
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def first_error(labels: Sequence[float]) -> int | None:
    """0-based index of the first step labelled an error (< 0.5), or None if all are correct."""
    return next((i for i, y in enumerate(labels) if float(y) < LABEL_THRESHOLD), None)


def predicted_first_error(scores: Sequence[float], threshold: float = 0.5) -> int | None:
    """0-based index of the first step scored below `threshold`, or None."""
    return next((i for i, s in enumerate(scores) if float(s) < threshold), None)


def _first_error_windows(
    scores: Sequence[Sequence[float]], first_errors: Sequence[int | None]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per solution, the thresholds t that predict its first error right: lo < t <= hi.

    With m = min of the scores before the true first error e (+inf when e = 0), the prediction
    is e exactly when p_e < t <= m; a correct solution is right when t <= min of all its scores.
    A NaN score (a step cut by truncation) leaves the prediction undecided wherever the scored
    steps do not decide it: the window is empty (a miss that stays counted), as ProcessBench counts
    an example it got no prediction for. Returns (lo, hi, is_error), each (M,).
    """
    if len(scores) != len(first_errors):
        raise ValueError(f"{len(scores)} scored solutions but {len(first_errors)} first-error indices")
    lo, hi, err = [], [], []
    for i, (s, e) in enumerate(zip(scores, first_errors)):
        s = [float(v) for v in s]
        if e is not None and not 0 <= e < len(s):
            raise ValueError(f"solution {i}: first error index {e} is outside its {len(s)} steps")
        err.append(e is not None)
        if any(math.isnan(v) for v in s[: len(s) if e is None else e + 1]):
            lo.append(math.inf)
            hi.append(-math.inf)
        elif e is None:
            lo.append(-math.inf)
            hi.append(min(s, default=math.inf))
        else:
            lo.append(s[e])
            hi.append(min(s[:e], default=math.inf))
    return np.asarray(lo, dtype=float), np.asarray(hi, dtype=float), np.asarray(err, dtype=bool)


def _first_error_scores(
    error_hits: np.ndarray, correct_hits: np.ndarray, n_error: int, n_correct: int
) -> dict[str, np.ndarray]:
    """ProcessBench accuracies and F1 from hit counts per class (arrays of one shape, or scalars)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        error_acc = np.asarray(error_hits) / n_error
        correct_acc = np.asarray(correct_hits) / n_correct
        # Both accuracies 0 give 0/0: NaN, as ProcessBench's numpy F1 prints it; a missing class
        # makes its accuracy NaN and F1 NaN too.
        f1 = 2 * error_acc * correct_acc / (error_acc + correct_acc)
    return {"error_acc": error_acc, "correct_acc": correct_acc, "f1": f1}


def first_error_f1(
    scores: Sequence[Sequence[float]], first_errors: Sequence[int | None], threshold: float = 0.5
) -> dict[str, float]:
    """ProcessBench-style first-error identification.

    The predicted first error is the first step with score < threshold. On erroneous solutions
    a hit is predicted index == true index; on fully correct ones a hit is no predicted error.

    Args:
        scores: per solution, the step scores.
        first_errors: per solution, the true 0-based first error index or None
            (see `first_error` to derive it from step labels).
        threshold: error threshold.

    Returns:
        {"error_acc", "correct_acc", "f1"}: f1 is their harmonic mean, NaN when both are 0 (as
        ProcessBench's code gives it); a class with no solutions gives NaN accuracy and NaN f1.
    """
    lo, hi, err = _first_error_windows(scores, first_errors)
    hit = (lo < threshold) & (threshold <= hi)
    out = _first_error_scores((hit & err).sum(), (hit & ~err).sum(), err.sum(), (~err).sum())
    return {k: float(v) for k, v in out.items()}


def _window_hits(lo: np.ndarray, hi: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """Per threshold t, how many windows hold it (lo < t <= hi): #(lo < t) - #(hi < t) over the
    non-empty windows, by binary search, so a dev split of any size needs no (T, M) table."""
    keep = lo < hi
    lo_sorted, hi_sorted = np.sort(lo[keep]), np.sort(hi[keep])
    return np.searchsorted(lo_sorted, thresholds, side="left") - np.searchsorted(hi_sorted, thresholds, side="left")


def best_threshold(scores: Sequence[Sequence[float]], first_errors: Sequence[int | None]) -> float:
    """Threshold that maximises first-error F1 on a dev split (pick it on dev, report on test).

    Every distinct outcome is covered exactly: the candidates are 0, the midpoints between
    consecutive distinct scores, and just above 1. Ties go to the candidate closest to 0.5.
    Needs both erroneous and correct solutions in the split.
    """
    lo, hi, err = _first_error_windows(scores, first_errors)
    if err.all() or not err.any():
        raise ValueError("best_threshold needs both erroneous and fully correct solutions in the dev split")
    u = np.unique([float(v) for s in scores for v in s])
    cand = np.r_[0.0, (u[1:] + u[:-1]) / 2, np.nextafter(1.0, 2.0)]  # (T,)
    error_hits, correct_hits = _window_hits(lo[err], hi[err], cand), _window_hits(lo[~err], hi[~err], cand)
    f1 = _first_error_scores(error_hits, correct_hits, err.sum(), (~err).sum())["f1"]
    f1 = np.nan_to_num(f1, nan=0.0)  # no hit in either class is the worst outcome, not a gap
    best = np.flatnonzero(f1 == f1.max())
    return float(cand[best[np.argmin(np.abs(cand[best] - 0.5))]])


def best_step_threshold(scores: Sequence[Sequence[float]], labels: Sequence[Sequence[float]]) -> float:
    """Threshold that maximises step macro F1 (`step_f1`) on a dev split (VisualProcessBench's metric).

    The candidates are those of `best_threshold`: 0, the midpoints between consecutive distinct
    scores, and just above 1; ties go to the candidate closest to 0.5. Needs both correct and
    erroneous steps in the split.
    """
    p, t = _flat(scores, labels)
    good = t >= LABEL_THRESHOLD
    if good.all() or not good.any():
        raise ValueError("best_step_threshold needs both correct and erroneous steps in the dev split")
    u = np.unique(p)
    cand = np.r_[0.0, (u[1:] + u[:-1]) / 2, np.nextafter(1.0, 2.0)]  # (T,)
    # Steps predicted correct at t are those scoring >= t: count them per class by binary search.
    pos, neg = np.sort(p[good]), np.sort(p[~good])
    tp = pos.size - np.searchsorted(pos, cand, side="left")  # correct steps predicted correct, (T,)
    fp = neg.size - np.searchsorted(neg, cand, side="left")  # error steps predicted correct
    fn, tn = pos.size - tp, neg.size - fp
    f1_correct = 2 * tp / (2 * tp + fp + fn)  # denominators > 0: both classes are present
    f1_error = 2 * tn / (2 * tn + fn + fp)
    macro = (f1_correct + f1_error) / 2
    best = np.flatnonzero(macro == macro.max())
    return float(cand[best[np.argmin(np.abs(cand[best] - 0.5))]])


def step_metrics(
    scores: Sequence[Sequence[float]], labels: Sequence[Sequence[float]], threshold: float = 0.5
) -> dict[str, float]:
    """All step-level metrics of one split in one flat dict (for eval reports)."""
    firsts = [first_error(y) for y in labels]
    out = {
        "bce": bce(scores, labels),
        "brier": brier(scores, labels),
        "step_accuracy": step_accuracy(scores, labels, threshold),
        "auroc": auroc(scores, labels),
        **step_f1(scores, labels, threshold),
    }
    fe = first_error_f1(scores, firsts, threshold)
    out.update({f"first_error_{k}": v for k, v in fe.items()})
    out["threshold"] = float(threshold)
    return out


def stratified_auroc(scores: Sequence[float], labels: Sequence[float], strata: Sequence[Any]) -> float:
    """AUROC counting only (correct, error) pairs that share a stratum.

    With strata = (problem, step index), it asks what a reranker needs - is this step's score
    above a wrong step's at the same point of another candidate for the same problem - and is
    blind to what a pooled AUROC mixes in (later steps are wrong more often; some problems are
    harder). Ties count one half. NaN when no stratum holds both classes.

    Example: strata a: correct 0.9, error 0.4; b: correct 0.2, error 0.3 -> (1 + 0) / 2 = 0.5.
    """
    groups: dict[Any, tuple[list[float], list[float]]] = {}
    for s, y, k in zip(scores, labels, strata):
        pos, neg = groups.setdefault(k, ([], []))
        (pos if y >= LABEL_THRESHOLD else neg).append(float(s))
    wins = pairs = 0.0
    for pos, neg in groups.values():
        if not pos or not neg:
            continue
        n = np.asarray(neg)
        for p in pos:
            wins += float((p > n).sum()) + 0.5 * float((p == n).sum())
        pairs += len(pos) * len(neg)
    return wins / pairs if pairs else math.nan
