"""Pure scoring math: step-score aggregators, Best-of-N selection, step metrics, bootstrap
statistics (`mmprm.scoring.stats`) and losses.

Aggregators, selection and metrics need only numpy; `mmprm.scoring.losses` imports torch, so it
is not imported here.
"""

from mmprm.scoring.aggregators import AGGREGATORS, EPS, aggregate, register_aggregator
from mmprm.scoring.selection import (
    answer_groups,
    majority_vote,
    oracle,
    pick_best,
    random_pick_accuracy,
    vote_accuracy,
    weighted_vote,
)

__all__ = [
    "AGGREGATORS",
    "EPS",
    "aggregate",
    "answer_groups",
    "majority_vote",
    "oracle",
    "pick_best",
    "random_pick_accuracy",
    "register_aggregator",
    "vote_accuracy",
    "weighted_vote",
]
