"""PRM-guided search: beam search, diverse verifier tree search and best-first search over steps.

    from mmprm.search import BackendProposer, SearchConfig, run_search
    trees = run_search(problems, BackendProposer(hf_or_vllm_backend), mmprm.load_prm("runs/prm"),
                       SearchConfig("beam", width=4, expansions=4, aggregator="min"))
    trees[0].nodes[trees[0].chosen]     # the chosen finished step; trees[0].to_treeval() for treeval

The search (`core`) only talks to a `StepProposer` and a `PrefixScorer`; `policy` adapts the
rollout backends, `report` builds the equal-budget comparison with Best-of-N, `reward` turns the
PRM into a TRL GRPO reward, `store` keeps per-problem results resumable.
"""

from mmprm.search.core import (
    SEARCH_METHODS,
    Search,
    SearchConfig,
    SearchNode,
    SearchTree,
    StepProposal,
    StepRequest,
    register_search,
    run_search,
)
from mmprm.search.policy import BackendProposer, parse_step, sample_solutions
from mmprm.search.reward import PRMReward

__all__ = [
    "SEARCH_METHODS",
    "Search",
    "SearchConfig",
    "SearchNode",
    "SearchTree",
    "StepProposal",
    "StepRequest",
    "register_search",
    "run_search",
    "BackendProposer",
    "parse_step",
    "sample_solutions",
    "PRMReward",
]
