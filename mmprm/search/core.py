"""PRM-guided step-level search: beam search, diverse verifier tree search, best-first search.

Pure and backend-agnostic: the search calls a `StepProposer` (sample next steps of prefixes) and
a `PrefixScorer` (PRM probability of every step of prefixes) and nothing else, so scripted ones
test it and the HF / vLLM adapters of `mmprm.search.policy` plug in unchanged. All problems of a
call advance in lockstep, one round at a time: every round sends ONE proposer call (all problems,
all beams) and ONE scorer call, so the engine and the PRM see full batches.

A node is one generated step. Its score is `AGGREGATORS[aggregator]` over the PRM probabilities
of its whole path (the same functions Best-of-N ranks finished candidates with), where the path
is `prm_steps(steps, answer)`: a finished node's answer is attached to its last step, exactly as
Best-of-N candidates are scored. Ties go to the node created first (lowest id).

Methods (W = `width`, M = `expansions`):

* beam: round 0 samples W*M first steps; every round keeps the best W new nodes, and each kept
  node that is not finished is expanded M times next round. A kept finished node is a result
  and stops; a kept node at depth `max_steps` is cut. So each round samples at most W*M steps.
* dvts (diverse verifier tree search): W independent subtrees; round 0 samples M first steps per
  subtree, and every round each subtree keeps only its best new node and expands it M times.
* best_first (tree-of-thought frontier): every node that is not dead sits on a frontier ordered by
  score; each round expands the best W open nodes M times. It stops when the best frontier node
  is finished (with `min`, a path score never rises, so no open node can beat it), when the
  frontier is empty, or after `max_expansions` node expansions.

The answer is the best finished node of the tree; with none, the best node at all (no answer,
counted wrong). Dead nodes (the proposer's text held neither a step nor an answer) are kept in
the tree for the record but never scored or expanded. Cut nodes (the PRM's `max_length` cut their
path, so their last steps have no score) are kept the same way: a partial score would compare a
middle step with other nodes' last ones, and every child would be cut too. `stats["cut_nodes"]`
counts them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from mmprm.scoring.aggregators import AGGREGATORS
from mmprm.steps import ANSWER_CLOSE, ANSWER_OPEN, prm_steps

NodeStatus = Literal["root", "open", "finished", "dead", "cut"]


@dataclass
class SearchConfig:
    """How to search.

    Attributes:
        method: "beam", "dvts", "best_first" (see the module docstring) or one added with
            `register_search`.
        width: W - beams kept (beam), subtrees (dvts), nodes expanded per round (best_first).
        expansions: M - next steps sampled per expanded node.
        max_steps: depth limit; a node at this depth is never expanded.
        aggregator: name in `mmprm.scoring.AGGREGATORS` that turns a path's step probabilities
            into its score.
        max_expansions: best_first only: node expansions per problem before it stops.
        distinct: beam and best_first keep one node per distinct path (same steps and answer);
            a sampled duplicate would spend a beam on a prefix already kept.
    """

    method: str = "beam"
    width: int = 4
    expansions: int = 4
    max_steps: int = 12
    aggregator: str = "min"
    max_expansions: int = 64
    distinct: bool = True

    def validate(self) -> None:
        if self.method not in SEARCH_METHODS:
            raise ValueError(f"search.method: {self.method!r} is not one of {list(SEARCH_METHODS)}")
        if self.width < 1 or self.expansions < 1 or self.max_steps < 1 or self.max_expansions < 1:
            raise ValueError("search: width, expansions, max_steps and max_expansions must all be >= 1")
        if self.aggregator not in AGGREGATORS:
            raise ValueError(f"search.aggregator: {self.aggregator!r} is not one of {list(AGGREGATORS)}")

    def label(self) -> str:
        """Short name for tables and plots, e.g. "beam W4xM4"."""
        extra = f" x{self.max_expansions}" if self.method == "best_first" else ""
        return f"{self.method} W{self.width}xM{self.expansions}{extra}"


@dataclass
class StepProposal:
    """One sampled continuation of a prefix, parsed.

    step: the step text ("" when the continuation holds only the final answer).
    answer: the final answer when the continuation finished the solution, else None.
    tokens: generated tokens spent on it (counted even when it is dead).
    text: the raw continuation, kept for the record.
    """

    step: str
    answer: str | None
    tokens: int
    text: str = ""

    @property
    def dead(self) -> bool:
        return not self.step.strip() and self.answer is None


@dataclass
class StepRequest:
    """Sample `n` next steps of the solution that starts with `prefix_steps`."""

    problem_id: str
    question: str
    images: list[str]
    prefix_steps: list[str]
    n: int


class StepProposer(Protocol):
    """Samples next steps: `mmprm.search.policy.BackendProposer` or a scripted one in tests."""

    def propose(self, requests: list[StepRequest]) -> list[list[StepProposal]]:
        """Per request, up to `n` proposals (fewer is allowed: an empty expansion)."""
        ...


class PrefixScorer(Protocol):
    """`mmprm.models.prm.PRMScorer` or any object scoring `{question, images, steps}` dicts."""

    def score(self, examples: Sequence[Any]) -> list[list[float]]:
        """One probability per step per example."""
        ...


@dataclass
class SearchNode:
    """One step of the search tree (id 0 is the root: the question, no step)."""

    id: int
    parent: int | None
    step: str = ""
    answer: str | None = None
    depth: int = 0
    status: NodeStatus = "open"
    probs: list[float] = field(default_factory=list)  # PRM probability per step of prm_path (cut: the scored prefix)
    score: float | None = None  # aggregated over probs; None until scored (and for dead and cut nodes)
    tokens: int = 0
    round: int = 0
    kept: bool = False  # selected by the search to stay (beam/dvts) or expanded (best_first)
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "parent": self.parent,
            "step": self.step,
            "answer": self.answer,
            "depth": self.depth,
            "status": self.status,
            "probs": self.probs,
            "score": self.score,
            "tokens": self.tokens,
            "round": self.round,
            "kept": self.kept,
            "meta": self.meta,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> SearchNode:
        return cls(**obj)


@dataclass
class SearchTree:
    """Everything one problem's search explored, plus its cost."""

    problem_id: str
    question: str
    images: list[str]
    nodes: list[SearchNode] = field(default_factory=list)
    chosen: int | None = None
    stats: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.nodes:
            self.nodes.append(SearchNode(0, None, status="root", kept=True))

    def add(self, parent: SearchNode, proposal: StepProposal, round_: int) -> SearchNode:
        status: NodeStatus = "dead" if proposal.dead else "finished" if proposal.answer is not None else "open"
        node = SearchNode(
            len(self.nodes),
            parent.id,
            proposal.step.strip(),
            proposal.answer,
            parent.depth + 1,
            status,
            tokens=proposal.tokens,
            round=round_,
        )
        self.nodes.append(node)
        return node

    def path(self, node: SearchNode) -> list[SearchNode]:
        """Nodes from the first step down to `node` (root excluded)."""
        out = []
        while node.parent is not None:
            out.append(node)
            node = self.nodes[node.parent]
        return out[::-1]

    def steps(self, node: SearchNode) -> list[str]:
        """The policy-format steps of `node`'s path (an answer-only node adds no step)."""
        return [n.step for n in self.path(node) if n.step]

    def prm_path(self, node: SearchNode) -> list[str]:
        """What the PRM scores for `node`: its steps, with its answer attached to the last one."""
        return prm_steps(self.steps(node), node.answer)

    def best(self, candidates: Sequence[SearchNode]) -> SearchNode | None:
        """Highest score, ties to the lowest id; None for no candidates."""
        return min(candidates, key=lambda n: (-n.score, n.id), default=None)

    def pick(self) -> SearchNode:
        """The answer of the search: best finished node, else best scored node, else the root."""
        finished = [n for n in self.nodes if n.status == "finished"]
        scored = [n for n in self.nodes if n.score is not None]
        node = self.best(finished) or self.best(scored) or self.nodes[0]
        self.chosen = node.id
        return node

    def to_json(self) -> dict[str, Any]:
        return {
            "problem_id": self.problem_id,
            "question": self.question,
            "images": list(self.images),
            "chosen": self.chosen,
            "stats": self.stats,
            "nodes": [n.to_json() for n in self.nodes],
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> SearchTree:
        return cls(
            obj["problem_id"],
            obj["question"],
            list(obj["images"]),
            [SearchNode.from_json(n) for n in obj["nodes"]],
            obj.get("chosen"),
            dict(obj.get("stats", {})),
        )

    def to_treeval(self) -> Any:
        """This tree as a `mmprm.treeval.Tree` (Think360 width/depth, RPTS, `render_tree`).

        Every scored node becomes a conclusion ("n{id}") whose parent is its parent step (first
        steps have none); its score is the PRM probability of its own step given its path (an
        answer node's is that of the last step with the answer attached). `tree.root` is the chosen
        node, so RPTS is read along the chosen solution. Dead and cut nodes are left out (counted in
        `meta["dead_nodes"]` and `meta["cut_nodes"]`).
        """
        from mmprm.treeval.tree import Node, Tree

        tree = Tree(
            question=self.question,
            images=list(self.images),
            meta={
                "problem_id": self.problem_id,
                "dead_nodes": sum(n.status == "dead" for n in self.nodes),
                "cut_nodes": sum(n.status == "cut" for n in self.nodes),
            },
        )
        chosen_path = {n.id for n in self.path(self.nodes[self.chosen])} if self.chosen else set()
        for n in self.nodes[1:]:
            if n.status in ("dead", "cut") or not n.probs:
                continue
            text = n.step if n.answer is None else f"{n.step}\n{ANSWER_OPEN}{n.answer}{ANSWER_CLOSE}".strip()
            parent = [f"n{n.parent}"] if n.parent else []
            tree.add(
                Node(
                    f"n{n.id}",
                    text,
                    parents=parent,
                    score=float(n.probs[-1]),
                    meta={
                        "path_score": n.score,
                        "status": n.status,
                        "kept": n.kept,
                        "round": n.round,
                        "chosen_path": n.id in chosen_path,
                        "answer": n.answer,
                    },
                )
            )
        if self.chosen and f"n{self.chosen}" in tree.nodes:
            tree.root = f"n{self.chosen}"
        tree.validate()
        return tree


class Search:
    """One problem's search: which nodes to expand next, and what to keep of their children.

    A method subclasses it (`requests`, `update`, setting `done` when finished) and is added with
    `register_search`; `run_search` drives every problem's search in lockstep.
    """

    def __init__(self, tree: SearchTree, cfg: SearchConfig):
        self.tree, self.cfg = tree, cfg
        self.done = False
        self.round = 0

    def requests(self) -> list[tuple[SearchNode, int]]:
        raise NotImplementedError

    def update(self, children: list[list[SearchNode]]) -> None:
        """Children (scored; dead and cut ones unscored) of the nodes of the last `requests`, in order."""
        raise NotImplementedError

    def _expandable(self, node: SearchNode) -> bool:
        return node.status == "open" and node.depth < self.cfg.max_steps

    def _distinct(self, nodes: list[SearchNode]) -> list[SearchNode]:
        """`nodes` without later copies of an earlier node's path (when `distinct` is on)."""
        if not self.cfg.distinct:
            return nodes
        seen, out = set(), []
        for n in nodes:
            key = (tuple(self.tree.steps(n)), n.answer)
            if key not in seen:
                seen.add(key)
                out.append(n)
        return out


class _BeamSearch(Search):
    def __init__(self, tree: SearchTree, cfg: SearchConfig):
        super().__init__(tree, cfg)
        self.active: list[SearchNode] = []

    def requests(self) -> list[tuple[SearchNode, int]]:
        if self.round == 0:
            return [(self.tree.nodes[0], self.cfg.width * self.cfg.expansions)]
        return [(n, self.cfg.expansions) for n in self.active]

    def update(self, children: list[list[SearchNode]]) -> None:
        alive = [c for kids in children for c in kids if c.score is not None]
        kept = self._distinct(sorted(alive, key=lambda n: (-n.score, n.id)))[: self.cfg.width]
        for n in kept:
            n.kept = True
        self.active = [n for n in kept if self._expandable(n)]
        self.round += 1
        self.done = not self.active


class _DiverseTreeSearch(Search):
    def __init__(self, tree: SearchTree, cfg: SearchConfig):
        super().__init__(tree, cfg)
        self.active: dict[int, SearchNode] = {}  # subtree -> its node to expand next

    def requests(self) -> list[tuple[SearchNode, int]]:
        if self.round == 0:
            return [(self.tree.nodes[0], self.cfg.width * self.cfg.expansions)]
        return [(n, self.cfg.expansions) for n in self.active.values()]

    def update(self, children: list[list[SearchNode]]) -> None:
        if self.round == 0:  # the root's W*M children: M per subtree, in order
            kids = children[0]
            groups = {s: kids[s * self.cfg.expansions : (s + 1) * self.cfg.expansions] for s in range(self.cfg.width)}
        else:
            groups = dict(zip(self.active, children))
        self.active = {}
        for subtree, kids in groups.items():
            for k in kids:
                k.meta["subtree"] = subtree
            best = self.tree.best([k for k in kids if k.score is not None])
            if best is not None:
                best.kept = True
                if self._expandable(best):
                    self.active[subtree] = best
        self.round += 1
        self.done = not self.active


class _BestFirstSearch(Search):
    def __init__(self, tree: SearchTree, cfg: SearchConfig):
        super().__init__(tree, cfg)
        self.frontier: list[SearchNode] = []
        self.expanded = 0

    def requests(self) -> list[tuple[SearchNode, int]]:
        if self.round == 0:
            return [(self.tree.nodes[0], self.cfg.expansions)]
        budget = self.cfg.max_expansions - self.expanded
        picked = [n for n in self.frontier[: self.cfg.width] if self._expandable(n)][:budget]
        for n in picked:
            n.kept = True
            self.frontier.remove(n)
        self.expanded += len(picked)
        return [(n, self.cfg.expansions) for n in picked]

    def update(self, children: list[list[SearchNode]]) -> None:
        if self.round == 0:
            self.expanded = 1
        self.frontier += [c for kids in children for c in kids if c.score is not None]
        # Nodes at the depth limit can never grow: only finished ones may stay as answers.
        self.frontier = self._distinct(
            sorted(
                (n for n in self.frontier if n.status == "finished" or self._expandable(n)),
                key=lambda n: (-n.score, n.id),
            )
        )
        self.round += 1
        top = self.frontier[0] if self.frontier else None
        self.done = (
            top is None
            or top.status == "finished"
            or self.expanded >= self.cfg.max_expansions
            or not any(self._expandable(n) for n in self.frontier[: self.cfg.width])
        )


SEARCH_METHODS: dict[str, type[Search]] = {
    "beam": _BeamSearch,
    "dvts": _DiverseTreeSearch,
    "best_first": _BestFirstSearch,
}
"""`search.method` name -> its `Search` class."""


def register_search(name: str, method: type[Search]) -> None:
    """Make `method` (a `Search` subclass) the search `search.method=<name>` runs.

    Raises:
        ValueError: the name is taken, or `method` is not a `Search`.
    """
    if name in SEARCH_METHODS:
        raise ValueError(f"search method {name!r}: already registered; choose another name")
    if not (isinstance(method, type) and issubclass(method, Search)):
        raise ValueError(f"search method {name!r}: {method!r} is not a subclass of mmprm.search.core.Search")
    SEARCH_METHODS[name] = method


def run_search(
    problems: Sequence[Any], proposer: StepProposer, scorer: PrefixScorer, cfg: SearchConfig
) -> list[SearchTree]:
    """Search every problem (objects or dicts with id, question, images) in lockstep.

    Returns one `SearchTree` per problem, its `chosen` node set and `stats` holding
    generated_tokens, proposals, prm_sequences (prefixes the PRM scored), cut_nodes (prefixes the
    PRM's max_length cut, see the module docstring), rounds and seconds (this call's wall time,
    split evenly: the problems share every batch).
    """
    cfg.validate()
    start = time.perf_counter()
    trees = [SearchTree(str(_get(p, "id")), _get(p, "question"), list(_get(p, "images") or [])) for p in problems]
    searches = [SEARCH_METHODS[cfg.method](t, cfg) for t in trees]
    for t in trees:
        t.stats = {"generated_tokens": 0, "proposals": 0, "prm_sequences": 0, "cut_nodes": 0, "rounds": 0}
    while True:
        work = [(s, node, n) for s in searches if not s.done for node, n in s.requests()]
        if not work:
            break
        props = proposer.propose(
            [
                StepRequest(s.tree.problem_id, s.tree.question, s.tree.images, s.tree.steps(node), n)
                for s, node, n in work
            ]
        )
        if len(props) != len(work):
            raise ValueError(f"proposer returned {len(props)} lists for {len(work)} requests")
        children: list[list[SearchNode]] = []
        for (s, node, n), got in zip(work, props):
            kids = [s.tree.add(node, p, s.round) for p in got[:n]]
            s.tree.stats["generated_tokens"] += sum(p.tokens for p in got[:n])
            s.tree.stats["proposals"] += len(kids)
            children.append(kids)
        to_score = [(s, k) for (s, _, _), kids in zip(work, children) for k in kids if k.status != "dead"]
        if to_score:
            probs = scorer.score(
                [
                    {"question": s.tree.question, "images": s.tree.images, "steps": s.tree.prm_path(k)}
                    for s, k in to_score
                ]
            )
            for (s, k), p in zip(to_score, probs):
                k.probs = [float(x) for x in p if not math.isnan(x)]  # NaN: a step past the PRM's max_length
                s.tree.stats["prm_sequences"] += 1
                if len(k.probs) < len(p):
                    k.status = "cut"
                    s.tree.stats["cut_nodes"] += 1
                else:
                    k.score = AGGREGATORS[cfg.aggregator](k.probs)
        by_search: dict[int, list[list[SearchNode]]] = {}
        for (s, _, _), kids in zip(work, children):
            by_search.setdefault(id(s), []).append(kids)
        for s in searches:
            if id(s) in by_search:
                s.update(by_search[id(s)])
                s.tree.stats["rounds"] += 1
    seconds = time.perf_counter() - start
    for t in trees:
        t.pick()
        t.stats["seconds"] = seconds / max(1, len(trees))
    return trees


def _get(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key)
