"""Picture of a scored reasoning tree: networkx graph drawn with matplotlib, nodes coloured by score.

Layers run top to bottom the way a person reads the reasoning: for trees with evidence (RPTS) the
evidence sits at the bottom and each conclusion one row above its highest premise, the final
conclusion on top; for step trees (Think360, chains) the first steps are on top. A side panel lists
each node's label with the start of its text, so the graph itself can keep short labels.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from mmprm.treeval.tree import Node, Tree


def _layers(tree: Tree) -> dict[str, int]:
    """Row of each node, 0 = top."""
    if any(n.kind == "evidence" for n in tree.nodes.values()):
        h = tree.heights()
        # Evidence sits just below the first conclusion that uses it, so its edges stay short
        # instead of running up past unrelated nodes from a bottom row.
        kids = tree.children()
        for nid, n in tree.nodes.items():
            if n.kind == "evidence" and kids[nid]:
                h[nid] = min(h[c] for c in kids[nid]) - 1
        top = max(h.values())
        return {nid: top - v for nid, v in h.items()}
    return {nid: d - 1 for nid, d in tree.depths().items()}


def _tidy_positions(tree: Tree, layers: dict[str, int]) -> dict[str, tuple[float, float]]:
    """Layout of a tree (one parent per node): leaves in depth-first order, parents over their children."""
    kids = tree.children()
    x: dict[str, float] = {}
    slot = 0.0
    for root in [nid for nid, n in tree.nodes.items() if not n.parents]:
        stack = [(root, False)]
        while stack:
            nid, expanded = stack.pop()
            if not kids[nid]:
                x[nid], slot = slot, slot + 1.0
            elif expanded:
                x[nid] = sum(x[c] for c in kids[nid]) / len(kids[nid])
            else:
                stack.append((nid, True))
                stack.extend((c, False) for c in reversed(kids[nid]))
    mid = (slot - 1.0) / 2.0
    return {nid: (x[nid] - mid, -float(layers[nid])) for nid in tree.nodes}


def _positions(tree: Tree, layers: dict[str, int]) -> dict[str, tuple[float, float]]:
    """x within each row by the mean x of the nodes it connects to above (fewer crossings), y by row."""
    if all(len(n.parents) <= 1 for n in tree.nodes.values()) and not any(
        n.kind == "evidence" for n in tree.nodes.values()
    ):
        return _tidy_positions(tree, layers)
    kids = tree.children()
    rows: dict[int, list[str]] = {}
    for nid in tree.nodes:
        rows.setdefault(layers[nid], []).append(nid)
    pos: dict[str, tuple[float, float]] = {}
    for r in sorted(rows):

        def key(nid: str) -> float:
            above = [pos[o][0] for o in tree.nodes[nid].parents + kids[nid] if o in pos]
            return sum(above) / len(above) if above else float(rows[r].index(nid))  # noqa: B023 (sorted now)

        ordered = sorted(rows[r], key=key)
        width = len(ordered)
        for i, nid in enumerate(ordered):
            pos[nid] = (i - (width - 1) / 2.0, -float(r))
    return pos


def render_tree(
    tree: Tree, path: str | Path, title: str = "", threshold: float = 0.5, max_text: int = 110, max_listed: int = 40
) -> Path:
    """Draw `tree` to a PNG at `path` and return the path.

    Conclusions are circles coloured by score (red 0 -> green 1, colorbar; grey when unscored) with
    the label and score inside; evidence is grey squares, a missing premise a red-edged square.
    Nodes below `threshold` get a thick black edge. The side panel lists the first `max_listed` nodes
    with up to `max_text` characters of their text.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import colors

    layers = _layers(tree)
    pos = _positions(tree, layers)
    n_rows = max(layers.values(), default=0) + 1
    xs = [p[0] for p in pos.values()] or [0.0]
    n_cols = max(xs) - min(xs) + 1
    shown = list(tree.nodes.values())[:max_listed]
    n_text = len(shown) + (len(tree.nodes) > max_listed)
    # Big trees get smaller nodes rather than an unbounded canvas.
    col_w = 1.3 if n_cols <= 16 else max(0.2, 21.0 / n_cols)
    node_size = 1500 * (col_w / 1.3) ** 2
    font = 8 if col_w >= 1.0 else 6

    fig_w = max(9.0, col_w * n_cols + 7.5)
    fig_h = max(5.0, 1.2 * n_rows + 1.5, 0.42 * n_text + 1.5)
    fig = plt.figure(figsize=(fig_w, fig_h), dpi=110)
    graph_w = (fig_w - 6.5) / fig_w
    bottom = 1.0 / fig_h  # one inch for the colorbar and its label
    top = 1 - 0.5 / fig_h  # half an inch for the title
    ax = fig.add_axes((0.02, bottom + 0.02, graph_w - 0.04, top - bottom - 0.02))
    side = fig.add_axes((graph_w, bottom, 1 - graph_w - 0.01, top - bottom))
    side.axis("off")
    ax.axis("off")

    cmap = plt.get_cmap("RdYlGn")
    norm = colors.Normalize(vmin=0.0, vmax=1.0)
    _draw_graph(ax, tree, pos, node_size, font, threshold, cmap, norm)
    ax.set_xlim(min(xs) - 0.7, max(xs) + 0.7)
    ax.set_ylim(-(n_rows - 1) - 0.6, 0.6)
    side.text(
        0.0,
        1.0,
        _node_listing(tree, shown, max_text, max_listed),
        va="top",
        ha="left",
        fontsize=7.5,
        family="monospace",
        transform=side.transAxes,
    )

    _add_colorbar(fig, cmap, norm, (0.06, 0.55 / fig_h, graph_w * 0.7, 0.15 / fig_h), threshold)
    fig.suptitle(title or "reasoning tree", fontsize=10, x=0.02, y=1 - 0.15 / fig_h, ha="left", va="top")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _add_colorbar(fig: Any, cmap: Any, norm: Any, rect: tuple[float, float, float, float], threshold: float) -> None:
    """Horizontal score colorbar in `rect` (figure fractions) under the graph."""
    import matplotlib.pyplot as plt

    sm = plt.cm.ScalarMappable(norm=norm, cmap=cmap)
    cb = fig.colorbar(sm, cax=fig.add_axes(rect), orientation="horizontal")
    cb.set_label(f"node score (thick edge: below {threshold})", fontsize=8)
    cb.ax.tick_params(labelsize=7)


def _draw_graph(
    ax: Any,
    tree: Tree,
    pos: dict[str, tuple[float, float]],
    node_size: float,
    font: int,
    threshold: float,
    cmap: Any,
    norm: Any,
) -> None:
    """Draw edges, evidence squares, score-coloured conclusion circles and their labels on `ax`."""
    import networkx as nx

    g = nx.DiGraph()
    for n in tree.nodes.values():
        g.add_node(n.id)
        for p in n.parents:
            g.add_edge(p, n.id)
    concl = [n for n in tree.nodes.values() if n.kind == "conclusion"]
    evid = [n for n in tree.nodes.values() if n.kind == "evidence"]
    nx.draw_networkx_edges(
        g, pos, ax=ax, arrows=True, arrowstyle="-|>", arrowsize=12, edge_color="#777777", node_size=node_size, width=1.0
    )
    if evid:
        nx.draw_networkx_nodes(
            g,
            pos,
            ax=ax,
            nodelist=[n.id for n in evid],
            node_shape="s",
            node_size=0.6 * node_size,
            node_color="#dddddd",
            edgecolors=["#cc0000" if n.meta.get("missing") else "#888888" for n in evid],
            linewidths=1.5,
        )
    if concl:
        nx.draw_networkx_nodes(
            g,
            pos,
            ax=ax,
            nodelist=[n.id for n in concl],
            node_size=node_size,
            node_color=[cmap(norm(n.score)) if n.score is not None else "#bbbbbb" for n in concl],
            edgecolors=["black" if n.score is not None and n.score < threshold else "#555555" for n in concl],
            linewidths=[2.5 if n.score is not None and n.score < threshold else 1.0 for n in concl],
        )
    labels = {
        n.id: n.label if n.score is None or n.kind == "evidence" else f"{n.label}\n{n.score:.2f}"
        for n in tree.nodes.values()
    }
    nx.draw_networkx_labels(g, pos, labels=labels, ax=ax, font_size=font)


def _node_listing(tree: Tree, shown: list[Node], max_text: int, max_listed: int) -> str:
    """Side-panel text: the `shown` nodes, steps before evidence, each as ``label [score]: text``
    cut to `max_text` characters, then a count of the nodes past `max_listed`."""
    lines = []
    for n in sorted(shown, key=lambda n: n.kind == "evidence"):  # steps first, then evidence
        text = " ".join(n.text.split())
        text = text if len(text) <= max_text else text[: max_text - 3] + "..."
        score = f" [{n.score:.2f}]" if n.score is not None and n.kind == "conclusion" else ""
        lines.append(textwrap.fill(f"{n.label}{score}: {text}", width=62, subsequent_indent="    "))
    if len(tree.nodes) > max_listed:
        lines.append(f"... and {len(tree.nodes) - max_listed} more nodes (see trees.jsonl)")
    return "\n".join(lines)
