"""Best-of-N selection: pick one candidate per problem, or score the baselines exactly.

Per problem there are N candidates, each with an extracted answer (str, or None when nothing
was extracted), a correctness flag and, for PRM selection, an aggregated score.

Rules (all deterministic):

* `pick_best`: highest score, ties broken by the lowest candidate index. A candidate marked
  truncated (its steps did not all fit the PRM) ranks below every complete one, an empty one
  included, whatever its partial score; among truncated candidates only, the lowest index wins.
* `random_pick_accuracy`: the exact expectation of picking uniformly at random (share correct).
* Votes (`majority_vote`, `weighted_vote`): candidates with answer None abstain. Answers are
  grouped after `normalize` (default: strip whitespace) or, if given, a pairwise `same`
  predicate such as `mmprm.answers.answers_match`. The answer group with the largest tally
  wins; on a tie the result is the expected accuracy of picking one of the tied answers
  uniformly. An answer group counts as correct by the share of its members flagged correct
  (1 or 0 when the verifier is consistent). If every candidate abstains, accuracy is 0.
* `oracle`: 1 if any candidate is correct (pass@N).

The vote core, `vote_accuracy`, works on arrays with any leading batch shape so that the
Best-of-N report can score thousands of candidate subsets at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def _strip(answer: str) -> str:
    return answer.strip()


def _check_nonempty(n: int, what: str) -> None:
    if n == 0:
        raise ValueError(f"{what}: got no candidates; a problem needs at least one")


def pick_best(scores: Sequence[float], truncated: Sequence[bool] | None = None) -> int:
    """Index of the highest score; ties go to the lowest index; truncated candidates rank last.

    Args:
        scores: (N,) aggregated candidate scores; -inf allowed, NaN is an error.
        truncated: (N,) True where the candidate was scored on a prefix; None: none was.

    >>> pick_best([float("-inf"), 0.9, -3.0], truncated=[False, True, False])
    2
    """
    s = np.asarray(scores, dtype=float)
    _check_nonempty(s.size, "pick_best")
    if np.isnan(s).any():
        raise ValueError(f"pick_best: score of candidate {int(np.argmax(np.isnan(s)))} is NaN")
    cut = np.zeros(s.shape, dtype=bool) if truncated is None else np.asarray(truncated, dtype=bool)
    if cut.shape != s.shape:
        raise ValueError(f"pick_best: {s.size} scores but {cut.size} truncated flags")
    return int(best_index(s, cut))


def best_index(scores: np.ndarray, truncated: np.ndarray) -> np.ndarray:
    """`pick_best`'s rule, batched, without checks.

    Args:
        scores: (..., N) float scores, no NaN.
        truncated: (..., N) bool.

    Returns:
        (...) int index of the winner in each row.
    """
    complete = ~truncated
    # Masking truncated scores to -inf is not enough: an empty candidate scores -inf under the
    # log-scale aggregators, and the tie would go to a truncated one at a lower index.
    top = np.where(complete, scores, -np.inf).max(-1, keepdims=True)
    win = complete & (scores == top)  # (..., N); all False only when every candidate is truncated
    # argmax takes the first True, i.e. the lowest index; a row of all-truncated falls to index 0.
    return win.argmax(-1)


def random_pick_accuracy(correct: Sequence[bool]) -> float:
    """Expected accuracy of a uniform random pick: the share of correct candidates."""
    _check_nonempty(len(correct), "random_pick_accuracy")
    return float(np.mean(np.asarray(correct, dtype=float)))


def oracle(correct: Sequence[bool]) -> float:
    """pass@N: 1.0 if any candidate is correct, else 0.0."""
    _check_nonempty(len(correct), "oracle")
    return float(np.any(np.asarray(correct, dtype=bool)))


def answer_groups(
    answers: Sequence[str | None],
    normalize: Callable[[str], str] | None = None,
    same: Callable[[str, str], bool] | None = None,
) -> list[int]:
    """Group id per candidate, numbered in order of first appearance; -1 for answer None.

    Args:
        answers: extracted answers, None where extraction failed.
        normalize: key function; two answers agree when their keys are equal (default: strip).
        same: pairwise equivalence instead of `normalize` (e.g. `mmprm.answers.answers_match`);
            each answer joins the first earlier group whose first member it matches. An answer
            written exactly like an earlier one (after strip) joins that one's group without a
            call: `same` may be slow (symbolic math), and 64 samples hold few distinct answers.

    >>> answer_groups(["12", " 12", None, "7"])
    [0, 0, -1, 1]
    """
    groups: list[int] = []
    if same is not None:
        reps: list[str] = []
        seen: dict[str, int] = {}  # stripped text -> its group
        for a in answers:
            if a is None:
                groups.append(-1)
                continue
            gid = seen.get(a.strip()) if a.strip() else None
            if gid is None:
                gid = next((g for g, r in enumerate(reps) if same(a, r)), None)
            if gid is None:
                gid = len(reps)
                reps.append(a)
            if a.strip():
                seen.setdefault(a.strip(), gid)
            groups.append(gid)
        return groups
    key = normalize or _strip
    ids: dict[str, int] = {}
    for a in answers:
        groups.append(-1 if a is None else ids.setdefault(key(a), len(ids)))
    return groups


def vote_accuracy(groups: np.ndarray, weights: np.ndarray, correct: np.ndarray) -> np.ndarray:
    """Expected accuracy of a (weighted) vote, batched.

    Args:
        groups: (..., N) int answer-group ids, -1 for abstaining candidates.
        weights: (..., N) non-negative vote weights (ones for a majority vote).
        correct: (..., N) bool correctness per candidate.

    Returns:
        (...) float: mean, over the answers with the top tally, of each answer's share of
        correct members; 0 where every candidate abstains.
    """
    groups = np.asarray(groups)
    weights = np.asarray(weights, dtype=float)
    correct = np.asarray(correct, dtype=float)
    if not groups.shape == weights.shape == correct.shape:
        raise ValueError(f"shapes differ: groups {groups.shape}, weights {weights.shape}, correct {correct.shape}")
    _check_nonempty(groups.shape[-1], "vote_accuracy")
    if not (np.isfinite(weights) & (weights >= 0)).all():
        raise ValueError(
            "vote weights must be finite and >= 0: weight by a probability-scale aggregator "
            "(min, average, last, product, ...), not sum_logpr / sum_logodds"
        )
    votes = groups >= 0  # (..., N)
    same = (groups[..., :, None] == groups[..., None, :]) & votes[..., None, :]  # (..., N, N)
    # Members of one group share a row of `same`, so their tallies are bit-identical sums.
    tally = (same * weights[..., None, :]).sum(-1)  # (..., N) tally of each candidate's answer
    size = same.sum(-1)  # (..., N) members in each candidate's group
    tally = np.where(votes, tally, -np.inf)
    top = tally.max(-1, keepdims=True)
    win = votes & (tally == top)  # (..., N) candidates whose answer has the top tally
    # Summing 1/size over a group's winning members counts that group once.
    inv = np.where(win, 1.0 / np.maximum(size, 1), 0.0)
    n_groups = inv.sum(-1)
    hits = (inv * correct).sum(-1)  # sum over tied groups of their share correct
    return np.where(n_groups > 0, hits / np.where(n_groups > 0, n_groups, 1.0), 0.0)


def majority_vote(
    answers: Sequence[str | None],
    correct: Sequence[bool],
    normalize: Callable[[str], str] | None = None,
    same: Callable[[str, str], bool] | None = None,
) -> float:
    """Accuracy of the most frequent answer (self-consistency); ties -> expected accuracy."""
    if len(answers) != len(correct):
        raise ValueError(f"majority_vote: {len(answers)} answers but {len(correct)} correct flags")
    g = np.asarray(answer_groups(answers, normalize, same))
    return float(vote_accuracy(g, np.ones(len(g)), np.asarray(correct, dtype=bool)))


def weighted_vote(
    answers: Sequence[str | None],
    scores: Sequence[float],
    correct: Sequence[bool],
    normalize: Callable[[str], str] | None = None,
    same: Callable[[str, str], bool] | None = None,
) -> float:
    """Accuracy of the answer with the largest sum of candidate scores; ties -> expected accuracy.

    `scores` must be >= 0 (a probability-scale aggregate such as min or product).
    """
    if not len(answers) == len(scores) == len(correct):
        raise ValueError(f"weighted_vote: {len(answers)} answers, {len(scores)} scores, {len(correct)} correct flags")
    g = np.asarray(answer_groups(answers, normalize, same))
    return float(vote_accuracy(g, np.asarray(scores, dtype=float), np.asarray(correct, dtype=bool)))
