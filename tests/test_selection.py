"""Best-of-N selection rules and baselines, with hand-computed expectations."""

import math

import numpy as np
import pytest

from mmprm.scoring.selection import (
    answer_groups,
    majority_vote,
    oracle,
    pick_best,
    random_pick_accuracy,
    vote_accuracy,
    weighted_vote,
)


def test_pick_best_highest_then_lowest_index():
    assert pick_best([0.2, 0.9, 0.9]) == 1
    assert pick_best([-math.inf, -math.inf, -3.0]) == 2
    assert pick_best([-math.inf, -math.inf]) == 0
    with pytest.raises(ValueError, match="candidate 1 is NaN"):
        pick_best([0.1, float("nan")])
    with pytest.raises(ValueError, match="no candidates"):
        pick_best([])


def test_pick_best_ranks_a_truncated_candidate_last():
    # Candidate 0 was cut: its two scored steps give sum_logpr = log 0.9 + log 0.8 = -0.3285, far
    # above the empty candidate 1 (-inf), yet the complete (empty) one wins.
    prefix = math.log(0.9) + math.log(0.8)
    assert pick_best([prefix, -math.inf], truncated=[True, False]) == 1
    # The tie an index rule would break the wrong way: both at -inf, the truncated one first.
    assert pick_best([-math.inf, -math.inf], truncated=[True, False]) == 1
    assert pick_best([0.9, 0.2, 0.3], truncated=[True, False, False]) == 2
    # Only truncated candidates: the lowest index, whatever the scores.
    assert pick_best([0.2, 0.9], truncated=[True, True]) == 0
    with pytest.raises(ValueError, match="3 scores but 2 truncated flags"):
        pick_best([0.1, 0.2, 0.3], truncated=[True, False])


def test_random_and_oracle():
    assert random_pick_accuracy([True, False, False, True]) == 0.5
    assert random_pick_accuracy([False, False, True]) == pytest.approx(1 / 3)
    assert oracle([False, True, False]) == 1.0
    assert oracle([False, False]) == 0.0


def test_answer_groups_first_seen_order():
    assert answer_groups(["12", " 12", None, "7", "12 "]) == [0, 0, -1, 1, 0]
    assert answer_groups(["A", "a"], normalize=str.lower) == [0, 0]
    numeric = lambda x, y: float(x) == float(y)  # noqa: E731
    assert answer_groups(["2.0", "3", "2", None, "3.0"], same=numeric) == [0, 1, 0, -1, 1]


def test_majority_vote():
    # "12" has two votes (after stripping), the abstainer does not vote.
    assert majority_vote(["12", "7", " 12", None], [True, False, True, False]) == 1.0
    # Two-way tie: expected accuracy of picking either answer.
    assert majority_vote(["a", "b"], [True, False]) == 0.5
    # Three-way tie among answers, abstainers ignored.
    assert majority_vote(["a", "b", "c", None, None], [False, True, False, False, False]) == pytest.approx(1 / 3)
    # Nobody answered.
    assert majority_vote([None, None], [False, False]) == 0.0
    # An inconsistent verifier: the winning group counts by its share of correct members.
    assert majority_vote(["a", "a", "b"], [True, False, False]) == 0.5
    # Normalisation decides the groups: "A" and "a" split (3-way tie) unless lower-cased.
    answers, correct = ["A", "a", "b"], [True, True, False]
    assert majority_vote(answers, correct) == pytest.approx(2 / 3)
    assert majority_vote(answers, correct, normalize=str.lower) == 1.0
    with pytest.raises(ValueError, match="2 answers but 1 correct"):
        majority_vote(["a", "b"], [True])


def test_weighted_vote():
    answers, correct = ["a", "b", "b"], [True, False, False]
    assert majority_vote(answers, correct) == 0.0
    assert weighted_vote(answers, [0.9, 0.4, 0.4], correct) == 1.0  # 0.9 > 0.8
    assert weighted_vote(answers, [0.5, 0.25, 0.25], correct) == 0.5  # exact tie
    assert weighted_vote(answers, [0.5, 0.3, 0.3], correct) == 0.0
    # All weights zero: every answer ties.
    assert weighted_vote(answers, [0.0, 0.0, 0.0], correct) == 0.5
    with pytest.raises(ValueError, match="finite and >= 0"):
        weighted_vote(answers, [-1.0, 0.2, 0.3], correct)
    with pytest.raises(ValueError, match="finite and >= 0"):
        weighted_vote(answers, [-math.inf, 0.2, 0.3], correct)


def _reference_vote(groups, weights, correct):
    """Plain-Python vote: tally per group, average the share correct over tied groups."""
    tally, members = {}, {}
    for g, w, c in zip(groups, weights, correct):
        if g < 0:
            continue
        tally[g] = tally.get(g, 0.0) + w
        members.setdefault(g, []).append(c)
    if not tally:
        return 0.0
    top = max(tally.values())
    tied = [g for g in tally if tally[g] == top]
    return sum(np.mean(members[g]) for g in tied) / len(tied)


def test_batched_vote_matches_reference():
    rng = np.random.default_rng(0)
    groups = rng.integers(-1, 3, size=(200, 6))
    correct = rng.random((200, 6)) < 0.5
    ones = np.ones((200, 6))
    weights = rng.integers(0, 3, size=(200, 6)) / 2.0  # halves: exact ties happen
    for w in (ones, weights):
        got = vote_accuracy(groups, w, correct)
        assert got.shape == (200,)
        want = [_reference_vote(g, ww, c) for g, ww, c in zip(groups, w, correct)]
        np.testing.assert_allclose(got, want)
    with pytest.raises(ValueError, match="shapes differ"):
        vote_accuracy(groups, ones[:, :5], correct)


def test_votes_with_math_equivalence():
    answers_mod = pytest.importorskip("mmprm.answers")
    answers = ["1/2", "0.5", "3", "3"]
    correct = [True, True, False, False]
    assert majority_vote(answers, correct) == 0.0  # exact strings: "3" has the most votes
    # Equivalent values join one group: 2 vs 2, a tie.
    assert majority_vote(answers, correct, same=answers_mod.answers_match) == 0.5


def test_answer_groups_asks_same_only_for_new_spellings():
    """64 samples hold few distinct answers, and `same` may be symbolic math (ms per call): an
    answer spelled like an earlier one joins its group without a call; groups are unchanged."""
    from mmprm.answers import answers_match
    from mmprm.scoring.selection import answer_groups

    calls: list[tuple[str, str]] = []

    def same(a: str, b: str) -> bool:
        calls.append((a, b))
        return answers_match(a, b)

    answers = ["1/2", "0.5", " 1/2", None, "3", "1/2", "3", "\\frac{1}{2}", "", ""]
    assert answer_groups(answers, same=same) == [0, 0, 0, -1, 1, 0, 1, 0, 2, 3]
    # "0.5" vs "1/2"; "3" vs "1/2"; "\frac{1}{2}" vs "1/2"; each "" against every group so far
    assert calls == [("0.5", "1/2"), ("3", "1/2"), ("\\frac{1}{2}", "1/2"), ("", "1/2"), ("", "3"),
                     ("", "1/2"), ("", "3"), ("", "")]  # fmt: skip
