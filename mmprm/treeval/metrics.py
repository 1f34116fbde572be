"""Tree metrics: Think360 width and depth, RPTS, RPTS-filtered accuracy, path scores.

Pure: a scored `Tree` (or lists) in, a number out. Only conclusion nodes count; evidence nodes are
given, not reasoned. A node is correct when ``score >= threshold``; with ``soft=True`` the score
itself is averaged instead of the 0/1 verdict.

Think360 (Chen et al., CVPR 2026; reference code Walnutes/Think360 `tree_metric.py`):

* width = mean over sibling groups of the share of correct nodes in the group. A group is the set
  of nodes that share a parent; roots belong to no group; a group of one counts.
* depth = mean over the deepest nodes of the share of correct nodes on the path from the node up
  to its root, both ends included.

Assumption beyond the paper (which only has trees): when a node has several parents (RPTS trees),
it sits in each parent's group, and its "path" is the set of all its conclusion ancestors.

RPTS (Wang et al., AAAI 2026; reference code wang-hao-feng/RPTS `evaluate/calculate.py`):
``sum(w * s) / sum(w)`` over the conclusions under the final one, ``w = lam ** |h - h_f|``, with
height h = 0 at evidence and 1 + the highest premise above. As in the reference's recursion, the
sum runs over the tree unfolded from the final conclusion, so a conclusion reused by two later
steps is counted once per path that reaches it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mmprm.treeval.tree import Tree


def _value(tree: Tree, nid: str, threshold: float, soft: bool) -> float:
    s = tree.nodes[nid].score
    if s is None:
        raise ValueError(f"node {nid} has no score: score the tree first (see mmprm.treeval.scorers)")
    return float(s) if soft else float(s >= threshold)


def think360_width(tree: Tree, threshold: float = 0.5, soft: bool = False) -> float | None:
    """Mean share of correct nodes per sibling group; None when no node has a parent.

    Example: root R with children A (0.9), B (0.2); A with child C (0.7)::

        groups {A, B} -> 1/2 and {C} -> 1/1, width = (0.5 + 1.0) / 2 = 0.75
        soft: ((0.9 + 0.2) / 2 + 0.7) / 2 = 0.625
    """
    shares = []
    for parent, kids in tree.children().items():
        group = [k for k in kids if tree.nodes[k].kind == "conclusion"]
        if tree.nodes[parent].kind != "conclusion" or not group:
            continue  # children of evidence are roots of the reasoning, not siblings
        shares.append(sum(_value(tree, k, threshold, soft) for k in group) / len(group))
    return sum(shares) / len(shares) if shares else None


def think360_depth(tree: Tree, threshold: float = 0.5, soft: bool = False) -> float | None:
    """Mean over the deepest nodes of the share of correct nodes on their root path; None if empty.

    Example (same tree as `think360_width`, R scored 0.3): the deepest node is C, its path
    R, A, C is 0.3, 0.9, 0.7 -> 2/3 correct; soft: (0.3 + 0.9 + 0.7) / 3 = 0.6333.
    """
    depths = tree.depths()
    if not depths:
        return None
    deepest = max(depths.values())
    shares = []
    for nid in (n for n, d in depths.items() if d == deepest):
        path = tree.ancestors(nid, kind="conclusion") + [nid]
        shares.append(sum(_value(tree, p, threshold, soft) for p in path) / len(path))
    return sum(shares) / len(shares)


def rpts(tree: Tree, lam: float = 0.9, h_f: int = 1) -> float:
    """RPTS of a scored tree, in [0, 1]; 0.0 when there is no conclusion (as the reference).

    Example: C0 <- I0, C1 <- T0 + T1, C2 <- C0 + C1 (heights 1, 1, 2), scores 1, 0.5, 0, lam 0.9,
    h_f 1: weights 1, 1, 0.9, RPTS = (1 + 0.5 + 0) / 2.9 = 0.5172.
    """
    if not 0.0 < lam <= 1.0:
        raise ValueError(f"lam={lam}: the decay factor must be in (0, 1]")
    if h_f < 0:
        raise ValueError(f"h_f={h_f}: the focus height must be >= 0")
    finals = tree.final_conclusions()
    if not finals:
        return 0.0
    heights = tree.heights()
    # Paths from the final conclusion(s) to each node: the times the reference's recursion visits it.
    paths: dict[str, int] = {nid: 0 for nid in tree.nodes}
    for f in finals:
        paths[f] += 1
    for nid in reversed(tree.topo_order()):  # every citing node comes before the nodes it cites
        if paths[nid]:
            for p in tree.nodes[nid].parents:
                paths[p] += paths[nid]
    num = den = 0.0
    for nid, n in tree.nodes.items():
        if n.kind != "conclusion" or not paths[nid]:
            continue
        w = paths[nid] * lam ** abs(heights[nid] - h_f)
        num += w * _value(tree, nid, 0.0, soft=True)
        den += w
    return num / den if den else 1.0


def filtered_accuracy(correct: Sequence[bool], scores: Sequence[float], threshold: float = 0.5) -> float:
    """Share of items whose answer is correct AND whose RPTS is >= threshold (RPTS's filtered accuracy)."""
    if len(correct) != len(scores):
        raise ValueError(f"{len(correct)} answers but {len(scores)} RPTS scores")
    if not correct:
        raise ValueError("no items to score")
    return sum(bool(c) and s >= threshold for c, s in zip(correct, scores)) / len(correct)


def path_scores(tree: Tree, aggregate: Callable[[list[float]], float]) -> dict[str, float]:
    """Score of each final conclusion's reasoning: `aggregate` over its conclusion path's node scores.

    `aggregate` is any fn(list[float]) -> float, e.g. `mmprm.scoring.aggregators.AGGREGATORS["min"]`
    (or "product", "last", ...), applied to the scores from the first step to the final one.
    """
    out = {}
    for f in tree.final_conclusions():
        path = tree.ancestors(f, kind="conclusion") + [f]
        out[f] = float(aggregate([_value(tree, p, 0.0, soft=True) for p in path]))
    return out
