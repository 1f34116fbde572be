"""The reasoning-tree model shared by the builders, scorers, metrics and renderer.

Edges point the way inference runs: `node.parents` are the nodes a node was derived from.

* RPTS (``Text1 + Conclusion0 -> Conclusion2``): C2's parents are T1 and C0. Evidence (image, text,
  context) nodes have no parents; the final conclusion is cited by nobody. RPTS's "children of a
  conclusion" are our parents, and its height is counted up from the evidence (`heights`).
* Think360 (``[NODE:2.1] [PARENT:1.1]``): 2.1's parent is 1.1; the roots (depth 1) have none.
* A chain of steps: step i has parent step i-1.

Scores: `node.score` is a float in [0, 1] or None (not scored yet). Scorers return
``{node_id: score}`` and `set_scores(tree, scores)` writes them onto the tree; metrics read them.
Evidence nodes are given, not reasoned, so scorers and metrics only use conclusion nodes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

NodeKind = Literal["evidence", "conclusion"]


@dataclass
class Node:
    """One node: a reasoning step (conclusion) or a piece of given evidence.

    id: unique within the tree ("C2", "T0", "2.1", ...).
    text: the step or evidence text.
    kind: "conclusion" for reasoning steps, "evidence" for image/text/context leaves.
    parents: ids of the nodes this one was derived from (premises, or the previous step).
    score: correctness in [0, 1] set by a scorer, None until then.
    label: short name for pictures and prompts (defaults to the id).
    meta: builder extras (step type, MC value, "missing": True for a dangling reference, ...).
    """

    id: str
    text: str
    kind: NodeKind = "conclusion"
    parents: list[str] = field(default_factory=list)
    score: float | None = None
    label: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.label:
            self.label = self.id


@dataclass
class Tree:
    """Nodes in insertion order, plus what a scorer needs to see (question, images).

    root: the final conclusion RPTS is computed under (RPTS takes the last step); None means every
    conclusion that no other node cites is a final one.
    warnings: problems a builder tolerated (dangling references, bad lines), one line each.
    """

    nodes: dict[str, Node] = field(default_factory=dict)
    root: str | None = None
    question: str = ""
    images: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def add(self, node: Node) -> Node:
        """Add a node (parents may be added later; `validate` checks them)."""
        if node.id in self.nodes:
            raise ValueError(f"duplicate node id {node.id!r}: node ids must be unique within a tree")
        self.nodes[node.id] = node
        return node

    def __len__(self) -> int:
        return len(self.nodes)

    def conclusions(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.kind == "conclusion"]

    def children(self) -> dict[str, list[str]]:
        """id -> ids of the nodes that cite it, in insertion order."""
        out: dict[str, list[str]] = {nid: [] for nid in self.nodes}
        for n in self.nodes.values():
            for p in n.parents:
                out[p].append(n.id)
        return out

    def validate(self) -> None:
        """Raise ValueError on a parent that is not a node, a cycle, or a bad root/score."""
        for n in self.nodes.values():
            for p in n.parents:
                if p not in self.nodes:
                    raise ValueError(f"node {n.id}: parent {p!r} is not a node of the tree")
            if n.score is not None and not (0.0 <= n.score <= 1.0 and math.isfinite(n.score)):
                raise ValueError(f"node {n.id}: score {n.score} is outside [0, 1]")
        if self.root is not None and self.root not in self.nodes:
            raise ValueError(f"root {self.root!r} is not a node of the tree")
        self.topo_order()

    def topo_order(self) -> list[str]:
        """Ids with every node after all its parents (insertion order among equals)."""
        order: list[str] = []
        state: dict[str, int] = {}  # 1 = on the stack, 2 = done
        for start in self.nodes:
            if state.get(start) == 2:
                continue
            stack: list[tuple[str, int]] = [(start, 0)]
            state[start] = 1
            while stack:
                nid, i = stack.pop()
                parents = self.nodes[nid].parents
                if i < len(parents):
                    stack.append((nid, i + 1))
                    p = parents[i]
                    if state.get(p) == 1:
                        raise ValueError(f"cycle through node {p!r}: a step cannot depend on itself")
                    if state.get(p) is None:
                        state[p] = 1
                        stack.append((p, 0))
                else:
                    state[nid] = 2
                    order.append(nid)
        return order

    def heights(self) -> dict[str, int]:
        """RPTS height: 0 for evidence, 1 + the largest parent height for a conclusion.

        A conclusion with no parents (a chain's first step) has height 1: one inference above
        the evidence it silently used.
        """
        h: dict[str, int] = {}
        for nid in self.topo_order():
            n = self.nodes[nid]
            h[nid] = 0 if n.kind == "evidence" else 1 + max((h[p] for p in n.parents), default=0)
        return h

    def depths(self) -> dict[str, int]:
        """Think360 depth of each conclusion: 1 with no conclusion parent, else 1 + the deepest one."""
        d: dict[str, int] = {}
        for nid in self.topo_order():
            n = self.nodes[nid]
            if n.kind == "conclusion":
                d[nid] = 1 + max((d[p] for p in n.parents if p in d), default=0)
        return d

    def ancestors(self, node_id: str, kind: NodeKind | None = "conclusion") -> list[str]:
        """Ids of every node `node_id` rests on (of `kind`, None for all), in topological order."""
        seen: set[str] = set()
        todo = list(self.nodes[node_id].parents)
        while todo:
            p = todo.pop()
            if p not in seen:
                seen.add(p)
                todo.extend(self.nodes[p].parents)
        return [nid for nid in self.topo_order() if nid in seen and (kind is None or self.nodes[nid].kind == kind)]

    def final_conclusions(self) -> list[str]:
        """The root if set, else every conclusion no other conclusion cites."""
        if self.root is not None:
            return [self.root]
        kids = self.children()
        return [n.id for n in self.conclusions() if not any(self.nodes[c].kind == "conclusion" for c in kids[n.id])]

    def to_json(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "question": self.question,
            "images": list(self.images),
            "warnings": list(self.warnings),
            "meta": self.meta,
            "nodes": [
                {
                    "id": n.id,
                    "text": n.text,
                    "kind": n.kind,
                    "parents": list(n.parents),
                    "score": n.score,
                    "label": n.label,
                    "meta": n.meta,
                }
                for n in self.nodes.values()
            ],
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Tree:
        tree = cls(
            root=obj.get("root"),
            question=obj.get("question", ""),
            images=list(obj.get("images", [])),
            warnings=list(obj.get("warnings", [])),
            meta=dict(obj.get("meta", {})),
        )
        for n in obj["nodes"]:
            tree.add(
                Node(
                    id=str(n["id"]),
                    text=n.get("text", ""),
                    kind=n.get("kind", "conclusion"),
                    parents=[str(p) for p in n.get("parents", [])],
                    score=n.get("score"),
                    label=n.get("label", ""),
                    meta=dict(n.get("meta", {})),
                )
            )
        tree.validate()
        return tree


def set_scores(tree: Tree, scores: Mapping[str, float]) -> Tree:
    """Write `{node_id: score}` onto the tree's nodes (in place) and return the tree.

    Raises ValueError naming the node for an unknown id or a score outside [0, 1].
    """
    for nid, s in scores.items():
        if nid not in tree.nodes:
            raise ValueError(f"score for unknown node {nid!r} (tree has {list(tree.nodes)[:8]}...)")
        s = float(s)
        if not (0.0 <= s <= 1.0) or math.isnan(s):
            raise ValueError(f"node {nid}: score {s} is outside [0, 1]; rescale the scorer's output")
        tree.nodes[nid].score = s
    return tree
