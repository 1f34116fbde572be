"""OmegaPRM search for one problem: pure, backend-agnostic, driven by the engine.

The search never calls a model. It is a generator that yields `Probe`s ("roll out `n` solutions
continuing this step prefix") and receives the parsed, verified `Rollout`s back::

    search = OmegaSearch(OmegaConfig())
    gen = search.run()
    probe = next(gen)                  # always the root first: Probe(prefix=(), n=16)
    while True:
        try:
            probe = gen.send(rollouts_for(probe))
        except StopIteration as stop:
            result = stop.value        # SearchResult: status, tree nodes, first errors, stats
            break

so the engine can keep hundreds of problems in flight and batch all their probes into one
backend call. The algorithm is OmegaPRM (Luo et al. 2024, "Improve Mathematical Reasoning in
Language Models by Automated Process Supervision") as MM-PRM runs it:

1. Estimate the root: MC(s) = correct / total over k rollouts. A root that is all right or all
   wrong is screened out (nothing to localise).
2. Every wrong rollout of a state with 0 < MC < 1 enters a candidate pool ordered by
   Q(s, r) + U(s), Q = alpha^(1 - MC(s)) * beta^(len(r) / L), U = c_puct * sqrt(sum N) / (1 + N(s)).
3. Pop the best candidate (it never returns) and binary-search its first wrong step: a probe
   prefix with MC > 0 is still good (search right), MC = 0 is bad (search left). Every probe is
   a node of the tree and its own wrong rollouts join the pool.
4. Repeat until the pool is empty or a budget (searches, rollouts) is spent. The rollout budget
   is also checked before each probe inside a binary search.

Unfinished rollouts (cut at `max_new_tokens`, or no answer written: `answer is None`) count as
not correct in MC, as in MM-PRM, but are never searched: their missing answer says nothing about
their steps, and a binary search over one would end at its full length and value it 0.0, blaming
the last complete step of a solution that may be right. A probe whose rollouts are all
unfinished gives no evidence either way, so the search stops there (an incomplete search) rather
than calling the prefix bad; a root with no finished rollout is `no_answer`.

Fixes over the anchors: a popped rollout is gone for good (openr re-selects), priorities are
maintained incrementally (the anchors re-score the whole tree every iteration), and the tree is a
prefix trie - a probe inside an existing edge splits it, so a zero-valued node always carries the
shortest known bad prefix instead of a long multi-step chunk; and the searched wrong rollout is
kept below its first error (`keep_failed_rollouts`), so a negative path can be exported as the
whole wrong solution a policy writes instead of a prefix that stops mid-solution.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, Literal

Status = Literal["annotated", "screened_all_correct", "screened_all_wrong", "no_steps", "no_answer"]


@dataclass
class OmegaConfig:
    """OmegaPRM hyper-parameters; defaults are MM-PRM's.

    Attributes:
        rollouts_per_estimate: k, rollouts behind every MC estimate (MM-PRM: 16).
        c_puct: exploration weight of U (MM-PRM: 0.125).
        alpha: Q rewards states near MC = 1 through alpha^(1 - MC); alpha < 1 (MM-PRM: 0.5).
        beta: Q prefers short rollouts through beta^(len / L); beta < 1 (MM-PRM: 0.9).
        length_scale: L, the length normaliser; rollout length is counted in words as MM-PRM does
            (MM-PRM: 2000).
        max_searches: binary searches per problem (MM-PRM: 200).
        max_rollouts: rollouts per problem, root estimate included (MM-PRM: 1000).
        keep_correct_rollouts: add each distinct correct complete rollout as an MC = 1 leaf
            (MM-PRM does; these leaves are the positive paths of the export).
        keep_failed_rollouts: add the wrong rollout a binary search ran on as an MC = 0 leaf below
            the first error it found. It costs no rollout; the export uses it to give a negative
            path its whole wrong solution (`ExportConfig.negatives`). MM-PRM drops it.
    """

    rollouts_per_estimate: int = 16
    c_puct: float = 0.125
    alpha: float = 0.5
    beta: float = 0.9
    length_scale: float = 2000.0
    max_searches: int = 200
    max_rollouts: int = 1000
    keep_correct_rollouts: bool = True
    keep_failed_rollouts: bool = True

    def validate(self) -> None:
        if self.rollouts_per_estimate < 1:
            raise ValueError("search.rollouts_per_estimate must be >= 1")
        if self.max_rollouts < self.rollouts_per_estimate:
            raise ValueError(
                f"search.max_rollouts ({self.max_rollouts}) must be >= search.rollouts_per_estimate "
                f"({self.rollouts_per_estimate}): the root estimate alone needs that many"
            )
        if self.max_searches < 0:
            raise ValueError("search.max_searches must be >= 0")
        if not 0 < self.alpha <= 1 or not 0 < self.beta <= 1:
            raise ValueError("search.alpha and search.beta must lie in (0, 1]")
        if self.length_scale <= 0 or self.c_puct < 0:
            raise ValueError("search.length_scale must be > 0 and search.c_puct >= 0")


@dataclass
class Rollout:
    """One sampled continuation of a prefix, parsed and verified by the engine.

    steps: the new steps after the prefix (may be empty when nothing parsed).
    answer: the final answer the policy gave, or None when the rollout is unfinished (cut off at
        max_new_tokens, or no answer written); unfinished rollouts are never searched.
    correct: the verifier's verdict on `answer` against the gold answer.
    """

    steps: list[str]
    answer: str | None
    correct: bool


@dataclass(frozen=True)
class Probe:
    """A request for `n` rollouts continuing the step prefix `prefix`."""

    prefix: tuple[str, ...]
    n: int


@dataclass
class OmegaNode:
    """A state of the tree: a step prefix with its MC estimate.

    A terminal node is a complete rollout (steps + answer); its value is exact (1.0 or 0.0 from
    the verifier) and costs no rollouts, so `total` is 0.
    """

    id: int
    prefix: tuple[str, ...]
    mc: float
    correct: int = 0
    total: int = 0
    finished: int = 0  # rollouts that reached an answer; MC = 0 with none finished proves nothing
    visits: int = 0
    answer: str | None = None
    terminal: bool = False


@dataclass
class SearchResult:
    """What a finished search leaves.

    nodes: the tree as flat records `{"id", "parent", "steps", "mc", "n", "visits", ["answer"]}`,
        root first; `steps` are the steps added on the edge from the parent.
    first_errors: one `{"node", "step"}` per completed binary search: the node whose last step is
        the first wrong one, and that step's 1-based position in the solution.
    selected: (node id, rollout index) of every popped candidate, in order.
    """

    status: Status
    nodes: list[dict[str, Any]]
    first_errors: list[dict[str, int]]
    selected: list[tuple[int, int]]
    rollouts: int
    searches: int
    probes: int
    unparsed_rollouts: int
    incomplete_searches: int
    truncated_rollouts: int = 0

    def stats(self) -> dict[str, int]:
        return {
            "rollouts": self.rollouts,
            "searches": self.searches,
            "probes": self.probes,
            "nodes": len(self.nodes),
            "first_errors": len({e["node"] for e in self.first_errors}),
            "unparsed_rollouts": self.unparsed_rollouts,
            "incomplete_searches": self.incomplete_searches,
            "truncated_rollouts": self.truncated_rollouts,
        }


def q_value(mc: float, length: float, alpha: float, beta: float, length_scale: float) -> float:
    """OmegaPRM's Q(s, r) = alpha^(1 - MC(s)) * beta^(len(r) / L).

    >>> q_value(0.5, 0.0, 0.5, 0.9, 2000.0)  # 0.5 ** 0.5
    0.7071067811865476
    """
    return alpha ** (1.0 - mc) * beta ** (length / length_scale)


def u_value(total_visits: int, visits: int, c_puct: float) -> float:
    """OmegaPRM's U(s) = c_puct * sqrt(sum of all visit counts) / (1 + N(s))."""
    return c_puct * math.sqrt(total_visits) / (1 + visits)


class CandidatePool:
    """Wrong rollouts awaiting a binary search, popped in order of Q(s, r) + U(s).

    U depends on the total visit count, which changes after every pop, so a fixed heap key goes
    stale; the anchors re-score everything each iteration. Here the candidates of one state share
    U(s), so a state's best candidate is its highest Q (a per-state heap), and states are grouped
    by visit count N: within a group U is equal, so each group is a heap on best Q. A pop compares
    only the group tops - exact argmax of Q + U in O(groups + log n), with lazy invalidation.
    Ties go to the earliest-added candidate, so runs are deterministic.
    """

    def __init__(self, c_puct: float):
        self.c_puct = c_puct
        self._seq = 0
        self._cands: dict[int, list[tuple[float, int, Any]]] = {}  # state -> heap of (-Q, seq, item)
        self._visits: dict[int, int] = {}
        self._version: dict[int, int] = {}
        self._groups: dict[int, list[tuple[float, int, int, int]]] = {}  # N -> heap of (-bestQ, seq, state, version)
        self.total_visits = 0
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def add(self, state: int, q: float, item: Any) -> None:
        """Add a candidate `item` of `state` with value Q."""
        self._visits.setdefault(state, 0)
        heapq.heappush(self._cands.setdefault(state, []), (-q, self._seq, item))
        self._seq += 1
        self._size += 1
        self._reindex(state)

    def _reindex(self, state: int) -> None:
        self._version[state] = self._version.get(state, 0) + 1
        heap = self._cands.get(state)
        if heap:
            neg_q, seq, _ = heap[0]
            group = self._groups.setdefault(self._visits[state], [])
            heapq.heappush(group, (neg_q, seq, state, self._version[state]))

    def peek_scores(self) -> list[tuple[float, int, int]]:
        """(Q + U, seq, state) of every state's best candidate (for tests and debugging)."""
        out = []
        for state, heap in self._cands.items():
            if heap:
                neg_q, seq, _ = heap[0]
                out.append((-neg_q + u_value(self.total_visits, self._visits[state], self.c_puct), seq, state))
        return out

    def pop(self) -> tuple[int, Any] | None:
        """Remove and return (state, item) with the highest Q + U, then count a visit to state."""
        best: tuple[float, int, int] | None = None  # (score, -seq, N)
        sqrt_total = math.sqrt(self.total_visits)
        for n, group in list(self._groups.items()):
            while group and group[0][3] != self._version[group[0][2]]:
                heapq.heappop(group)  # stale: the state was visited or its best changed
            if not group:
                del self._groups[n]
                continue
            neg_q, seq, _, _ = group[0]
            score = -neg_q + self.c_puct * sqrt_total / (1 + n)
            if best is None or (score, -seq) > best[:2]:
                best = (score, -seq, n)
        if best is None:
            return None
        _, _, state, _ = heapq.heappop(self._groups[best[2]])
        _, _, item = heapq.heappop(self._cands[state])
        self._size -= 1
        # N(s) += 1 for the selected state (OmegaPRM's maintenance phase).
        self._visits[state] += 1
        self.total_visits += 1
        self._reindex(state)
        return state, item


class OmegaSearch:
    """OmegaPRM on one problem; `run()` is the generator the engine drives (see module doc)."""

    def __init__(self, cfg: OmegaConfig):
        cfg.validate()
        self.cfg = cfg
        self.nodes: list[OmegaNode] = []
        self._by_prefix: dict[tuple[str, ...], OmegaNode] = {}
        self._terminals: dict[tuple[tuple[str, ...], str | None], OmegaNode] = {}
        self.pool = CandidatePool(cfg.c_puct)
        self.rollouts = 0
        self.searches = 0
        self.probes = 0
        self.unparsed = 0
        self.truncated = 0
        self.incomplete = 0
        self.first_errors: list[dict[str, int]] = []
        self.selected: list[tuple[int, int]] = []

    # -- the algorithm ---------------------------------------------------------------------

    def run(self) -> Generator[Probe, list[Rollout], SearchResult]:
        k = self.cfg.rollouts_per_estimate
        root, root_rollouts = yield from self._estimate(())
        if not any(r.steps for r in root_rollouts):
            return self._result("no_steps")
        if root.finished == 0:
            return self._result("no_answer")
        if root.mc == 1.0:
            return self._result("screened_all_correct")
        if root.mc == 0.0:
            return self._result("screened_all_wrong")
        while self.searches < self.cfg.max_searches:
            picked = self.pool.pop()
            if picked is None:
                break
            state_id, (index, rollout) = picked
            self.selected.append((state_id, index))
            self.nodes[state_id].visits += 1
            self.searches += 1
            yield from self._binary_search(self.nodes[state_id], rollout)
            if self.rollouts + k > self.cfg.max_rollouts:
                break  # no further probe is affordable
        return self._result("annotated")

    def _estimate(self, prefix: tuple[str, ...]) -> Generator[Probe, list[Rollout], tuple[OmegaNode, list[Rollout]]]:
        """MC estimate of `prefix` from k fresh rollouts (cached: a known prefix costs nothing)."""
        if prefix in self._by_prefix:
            return self._by_prefix[prefix], []
        k = self.cfg.rollouts_per_estimate
        rollouts = yield Probe(prefix, k)
        if len(rollouts) != k:
            raise ValueError(f"asked for {k} rollouts of a prefix, got {len(rollouts)}")
        self.rollouts += k
        self.probes += 1
        correct = sum(r.correct for r in rollouts)
        finished = sum(r.answer is not None for r in rollouts)
        node = self._add_node(prefix, correct / k, correct=correct, total=k)
        node.finished = finished
        self.truncated += k - finished
        for _index, r in enumerate(rollouts):
            if not r.steps:
                self.unparsed += 1
            if r.correct and self.cfg.keep_correct_rollouts and r.steps:
                self._terminal(prefix + tuple(r.steps), r.answer, 1.0)
        if 0.0 < node.mc < 1.0:
            # A state with MC = 0 is itself wrong; its rollouts would only re-find that.
            for index, r in enumerate(rollouts):
                if not r.correct and r.steps and r.answer is not None:
                    length = sum(len(s.split()) for s in r.steps)
                    q = q_value(node.mc, length, self.cfg.alpha, self.cfg.beta, self.cfg.length_scale)
                    self.pool.add(node.id, q, ((node.id, index), r))
        return node, rollouts

    def _binary_search(self, state: OmegaNode, rollout: Rollout) -> Generator[Probe, list[Rollout], None]:
        """Find the first wrong step of `state.prefix + rollout.steps`, keeping every probe."""
        full = state.prefix + tuple(rollout.steps)
        good, bad = len(state.prefix), len(full)  # full[:good] has MC > 0; full[:bad] is wrong
        while bad - good > 1:
            mid = (good + bad) // 2
            affordable = self.rollouts + self.cfg.rollouts_per_estimate <= self.cfg.max_rollouts
            if full[:mid] not in self._by_prefix and not affordable:
                self.incomplete += 1
                return
            probe, _ = yield from self._estimate(full[:mid])
            if probe.finished == 0:
                self.incomplete += 1  # every rollout unfinished: no evidence either way
                return
            if probe.mc > 0.0:
                good = mid
            else:
                bad = mid
        if bad == len(full):
            # The error is the last step: the complete rollout itself, valued exactly by its answer.
            bad_node = self._terminal(full, rollout.answer, 0.0)
        else:
            bad_node = self._by_prefix[full[:bad]]
            if self.cfg.keep_failed_rollouts:
                self._terminal(full, rollout.answer, 0.0)  # its parent is bad_node or a node below it
        self.first_errors.append({"node": bad_node.id, "step": bad})

    # -- bookkeeping ----------------------------------------------------------------------

    def _add_node(self, prefix: tuple[str, ...], mc: float, correct: int, total: int) -> OmegaNode:
        node = OmegaNode(id=len(self.nodes), prefix=prefix, mc=mc, correct=correct, total=total)
        self.nodes.append(node)
        self._by_prefix[prefix] = node
        return node

    def _terminal(self, steps: tuple[str, ...], answer: str | None, mc: float) -> OmegaNode:
        key = (steps, answer)
        if key not in self._terminals:
            node = OmegaNode(id=len(self.nodes), prefix=steps, mc=mc, answer=answer, terminal=True)
            self.nodes.append(node)
            self._terminals[key] = node
        return self._terminals[key]

    def _parent(self, node: OmegaNode) -> int | None:
        """Longest proper prefix that is a (non-terminal) node; a terminal may sit on its own prefix."""
        if not node.terminal and not node.prefix:
            return None
        top = len(node.prefix) if node.terminal else len(node.prefix) - 1
        for j in range(top, -1, -1):
            parent = self._by_prefix.get(node.prefix[:j])
            if parent is not None:
                return parent.id
        raise AssertionError("the root prefix () is always a node")

    def _result(self, status: Status) -> SearchResult:
        records = []
        for node in self.nodes:
            parent = self._parent(node)
            start = len(self.nodes[parent].prefix) if parent is not None else 0
            rec: dict[str, Any] = {
                "id": node.id,
                "parent": parent,
                "steps": list(node.prefix[start:]),
                "mc": node.mc,
                "n": node.total,
                "visits": node.visits,
            }
            if node.terminal:
                rec["answer"] = node.answer
            records.append(rec)
        return SearchResult(
            status=status,
            nodes=records,
            first_errors=self.first_errors,
            selected=self.selected,
            rollouts=self.rollouts,
            searches=self.searches,
            probes=self.probes,
            unparsed_rollouts=self.unparsed,
            incomplete_searches=self.incomplete,
            truncated_rollouts=self.truncated,
        )


def drive(search: OmegaSearch, answer: Any) -> SearchResult:
    """Run one search to the end, answering each probe with `answer(probe) -> list[Rollout]`.

    The engine interleaves many searches instead; this is for tests, benchmarks and debugging.
    """
    gen = search.run()
    probe = next(gen)
    while True:
        try:
            probe = gen.send(answer(probe))
        except StopIteration as stop:
            return stop.value
