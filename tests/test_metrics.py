"""Step-level metrics against hand-computed values."""

import math

import numpy as np
import pytest

from mmprm.scoring.metrics import (
    auroc,
    bce,
    best_step_threshold,
    best_threshold,
    brier,
    first_error,
    first_error_f1,
    predicted_first_error,
    step_accuracy,
    step_f1,
    step_metrics,
)

SCORES = [[0.9, 0.2], [0.6]]
LABELS = [[1.0, 0.0], [0.7]]


def test_bce_soft_targets():
    # -ln 0.9, -ln 0.8, -(0.7 ln 0.6 + 0.3 ln 0.4)
    want = (0.1053605157 + 0.2231435513 + 0.6324651562) / 3
    assert bce(SCORES, LABELS) == pytest.approx(want, rel=1e-8)
    # A confident miss is clamped at 1e-6: -ln(1e-6).
    assert bce([[0.0]], [[1.0]]) == pytest.approx(13.815510557964274)
    assert math.isnan(bce([], []))


def test_brier_and_step_accuracy():
    assert brier(SCORES, LABELS) == pytest.approx((0.01 + 0.04 + 0.01) / 3)
    assert step_accuracy(SCORES, LABELS) == 1.0
    # At 0.7 the 0.6 step is predicted wrong, but its 0.7 label counts as correct.
    assert step_accuracy(SCORES, LABELS, threshold=0.7) == pytest.approx(2 / 3)
    # The threshold is inclusive: score == threshold is predicted correct.
    assert step_accuracy([[0.5]], [[1.0]], threshold=0.5) == 1.0


def test_shape_and_range_errors():
    with pytest.raises(ValueError, match="solution 1: 1 step scores but 2 step labels"):
        brier([[0.5], [0.5]], [[1.0], [1.0, 0.0]])
    with pytest.raises(ValueError, match="2 scored solutions but 1 labelled"):
        brier([[0.5], [0.5]], [[1.0]])
    with pytest.raises(ValueError, match=r"solution 0 step 0: label 2.0 is outside \[0, 1\]"):
        brier([[0.5]], [[2.0]])


def test_step_f1_both_classes():
    # pred correct: T T T F ; truth correct: T T F F
    s, y = [[0.9, 0.8, 0.7, 0.1]], [[1, 1, 0, 0]]
    out = step_f1(s, y)
    assert out["f1_correct"] == pytest.approx(4 / 5)  # tp 2, fp 1, fn 0
    assert out["f1_error"] == pytest.approx(2 / 3)  # tp 1, fp 0, fn 1
    assert out["macro_f1"] == pytest.approx((4 / 5 + 2 / 3) / 2)
    # No error steps anywhere and none predicted: error-class F1 is undefined.
    none = step_f1([[0.9, 0.8]], [[1, 1]])
    assert none["f1_correct"] == 1.0 and math.isnan(none["f1_error"]) and math.isnan(none["macro_f1"])


def test_auroc_exact_and_ties():
    assert auroc([[0.1, 0.4, 0.35, 0.8]], [[0, 0, 1, 1]]) == pytest.approx(0.75)
    # Ties across classes count one half: pairs (0.5,0.5)x2 -> 1, (0.9, .)x2 -> 2; 3/4.
    assert auroc([[0.5, 0.5], [0.5, 0.9]], [[1, 0], [0, 1]]) == pytest.approx(0.75)
    assert auroc([[0.3, 0.3, 0.3]], [[1, 0, 1]]) == pytest.approx(0.5)
    assert math.isnan(auroc([[0.2, 0.9]], [[1, 1]]))


def test_auroc_matches_pairwise_count():
    rng = np.random.default_rng(1)
    s = np.round(rng.random(300), 1)  # many ties
    y = (rng.random(300) < 0.4).astype(float)
    pos, neg = s[y == 1], s[y == 0]
    pairs = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    assert auroc([s.tolist()], [y.tolist()]) == pytest.approx(pairs / (len(pos) * len(neg)))


def test_first_error_helpers():
    assert first_error([1.0, 0.7, 0.3, 1.0]) == 2
    assert first_error([1.0, 0.5]) is None
    assert predicted_first_error([0.9, 0.5, 0.4], threshold=0.5) == 2
    assert predicted_first_error([0.9], threshold=0.5) is None


# A: error at 1 found; B: error at 2 missed at 0.5; C: correct, kept; D: correct, false alarm at 0.
FE_SCORES = [[0.9, 0.3, 0.8], [0.9, 0.8, 0.7], [0.9, 0.9], [0.4, 0.9]]
FE_TRUE = [1, 2, None, None]


def test_first_error_f1_hand_computed():
    out = first_error_f1(FE_SCORES, FE_TRUE, threshold=0.5)
    assert out == {"error_acc": 0.5, "correct_acc": 0.5, "f1": 0.5}
    out = first_error_f1(FE_SCORES, FE_TRUE, threshold=0.75)  # now B's 0.7 is caught
    assert out["error_acc"] == 1.0 and out["correct_acc"] == 0.5
    assert out["f1"] == pytest.approx(2 * 1.0 * 0.5 / 1.5)
    # Only erroneous solutions: correct_acc and f1 are undefined.
    only_err = first_error_f1(FE_SCORES[:2], FE_TRUE[:2], threshold=0.5)
    assert only_err["error_acc"] == 0.5 and math.isnan(only_err["correct_acc"]) and math.isnan(only_err["f1"])
    with pytest.raises(ValueError, match="solution 0: first error index 3 is outside its 3 steps"):
        first_error_f1(FE_SCORES[:1], [3])


def test_best_threshold_tie_and_unique():
    # Windows: t in (0.3, 0.4] and t in (0.7, 0.8] both give F1 2/3; the tie goes to the
    # candidate closest to 0.5, the midpoint 0.35.
    assert best_threshold(FE_SCORES, FE_TRUE) == pytest.approx(0.35)
    # E: error at 1 with score 0.6 is caught only for t in (0.6, 0.95]: now 0.75 wins alone.
    scores, true = FE_SCORES + [[0.95, 0.6]], FE_TRUE + [1]
    t = best_threshold(scores, true)
    assert t == pytest.approx(0.75)
    assert first_error_f1(scores, true, t)["f1"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="both erroneous and fully correct"):
        best_threshold(FE_SCORES[:2], FE_TRUE[:2])


def test_best_threshold_beats_a_fine_grid():
    rng = np.random.default_rng(2)
    scores = [rng.random(rng.integers(1, 6)).round(2).tolist() for _ in range(60)]
    true = [None if rng.random() < 0.4 else int(rng.integers(0, len(s))) for s in scores]
    best = first_error_f1(scores, true, best_threshold(scores, true))["f1"]
    grid = max(first_error_f1(scores, true, t)["f1"] for t in np.linspace(0, 1.001, 1002))
    assert best >= grid - 1e-12


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_best_threshold_equals_scoring_every_candidate(seed):
    """The binary-search counts pick what first_error_f1 at each candidate picks (max F1, ties
    closest to 0.5); scores on a 0.1 grid make ties, empty windows and first-step errors."""
    rng = np.random.default_rng(seed)
    scores = [rng.random(rng.integers(1, 6)).round(1).tolist() for _ in range(200)]
    true = [None if rng.random() < 0.4 else int(rng.integers(0, len(s))) for s in scores]
    u = np.unique([v for s in scores for v in s])
    cand = np.r_[0.0, (u[1:] + u[:-1]) / 2, np.nextafter(1.0, 2.0)]
    f1 = np.array([first_error_f1(scores, true, t)["f1"] for t in cand])
    best = np.flatnonzero(f1 == f1.max())
    assert best_threshold(scores, true) == cand[best[np.argmin(np.abs(cand[best] - 0.5))]]


def test_best_step_threshold_hand_values_and_grid():
    # Candidates 0, 0.4, 0.75, 0.85, 1+: only 0.75 splits 0.9, 0.8 (correct) from 0.7, 0.1 (errors).
    assert best_step_threshold([[0.9, 0.7], [0.8, 0.1]], [[1, 0], [1, 0]]) == pytest.approx(0.75)
    rng = np.random.default_rng(3)
    scores = [rng.random(rng.integers(1, 6)).round(2).tolist() for _ in range(60)]
    labels = [(rng.random(len(s)) < 0.6).astype(float).tolist() for s in scores]
    best = step_f1(scores, labels, best_step_threshold(scores, labels))["macro_f1"]
    grid = max(step_f1(scores, labels, t)["macro_f1"] for t in np.linspace(0, 1.001, 1002))
    assert best == pytest.approx(grid, abs=1e-12)
    with pytest.raises(ValueError, match="both correct and erroneous steps"):
        best_step_threshold([[0.3, 0.9]], [[1.0, 1.0]])


def test_step_metrics_bundle():
    out = step_metrics(FE_SCORES, [[1, 0, 0], [1, 1, 0], [1, 1], [1, 1]])
    assert out["first_error_f1"] == 0.5
    assert out["step_accuracy"] == pytest.approx(7 / 10)  # misses: 0.8 on an error, 0.7 on one, 0.4
    assert set(out) >= {"bce", "brier", "auroc", "macro_f1", "first_error_error_acc", "threshold"}


def test_stratified_auroc_hand_values():
    from mmprm.scoring.metrics import stratified_auroc

    # stratum a: correct 0.9 vs error 0.4 -> 1; stratum b: correct 0.2 vs error 0.3 -> 0
    assert stratified_auroc([0.9, 0.4, 0.2, 0.3], [1, 0, 1, 0], ["a", "a", "b", "b"]) == 0.5
    # a tie counts one half; a stratum with one class adds no pairs
    assert stratified_auroc([0.5, 0.5, 0.7], [1, 0, 1], ["a", "a", "c"]) == 0.5
    # pooled AUROC gives 0.75 here (0.2 < 0.8 across strata); within strata it is perfect
    assert stratified_auroc([0.2, 0.1, 0.9, 0.8], [1, 0, 1, 0], [1, 1, 2, 2]) == 1.0
    assert math.isnan(stratified_auroc([0.1, 0.2], [1, 1], ["a", "a"]))
