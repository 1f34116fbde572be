"""Build a `Tree` from the formats reasoning comes in.

* `from_rpts_lines`: RPTS step lines ``Image0 + Text1 + Conclusion0 -> Conclusion2: text`` (the
  ``ConclusionK:`` prefix is optional, as in RPTS-Eval's gold `reasoning`; Chinese 图片/文本/结论/上下文
  work too). Premise indices are 0-based; ``ConclusionK`` is the K-th line, as in the RPTS reference.
* `from_think360_blocks`: Think360 node blocks ``[NODE:2.1] [PARENT:1.1] [ORIGINAL:...] [TYPE:...]``.
* `from_steps`: a plain list of steps, a chain.
* `from_annotation_tree`: MCTS annotation trees with per-node Monte-Carlo values (nested
  ``{"text", "mc_value", "children"}`` as in OpenR's math-aps trees, or a flat ``{"nodes": [...]}``).

A premise cited twice on one line (``Text0 + Text0 -> ...``) is one premise here, with a warning;
the RPTS reference keeps both citations, so its recursion counts that premise's subtree twice in
the score. Citing a clue twice adds no evidence, so we count it once.

Builders never crash on the quirks of real data: a premise that is not an earlier step, an index past
the clue list, a parent that does not exist. They keep going, attach a "missing" evidence node (which
RPTS treats as an unscored leaf, like the reference's error node) and append a one-line warning to
`tree.warnings`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from mmprm.data.schema import row_id
from mmprm.treeval.tree import Node, Tree

# Order matters: "context" contains "text", and 上下文 contains 文.
_PREMISE_KINDS = [
    ("context", re.compile(r"context|上下文", re.I)),
    ("image", re.compile(r"image|图", re.I)),
    ("text", re.compile(r"text|文", re.I)),
    ("conclusion", re.compile(r"conclusion|结论", re.I)),
]
_PREFIX = {"image": "I", "text": "T", "conclusion": "C", "context": "X"}
_CONSEQUENT = re.compile(r"^\s*(?:conclusion|结论)\s*(\d+)\s*[:：]\s*(.*)$", re.I | re.S)
_INT = re.compile(r"\d+")


def from_rpts_lines(
    lines: Sequence[str],
    textual_clues: Sequence[str] | None = None,
    num_images: int | None = None,
    context: str | None = None,
    question: str = "",
    images: Sequence[str] = (),
    source: str = "",
) -> Tree:
    """Tree of one RPTS reasoning: one conclusion node per line, evidence nodes for cited clues.

    Args:
        lines: ``"<premise> + <premise> -> [ConclusionK:] <text>"``, one per step.
        textual_clues: text evidence (``TextK`` = textual_clues[K]); None skips range checks.
        num_images: number of images (``ImageK`` needs K < num_images); None skips range checks.
        context: text of the ``Context`` premise, if any line cites it.
        question, images: what a scorer shows the judge/PRM with each node.
        source: prefix for warnings (e.g. ``"texts_en.json: id=155"``).

    Returns:
        A tree with conclusions "C0".."Cn-1" (parents = their premises), evidence "I0", "T3", "X"
        for cited clues only, root = the last line's conclusion, and one warning per tolerated
        quirk.
    """
    tree = Tree(question=question, images=list(images))
    where = f"{source}: " if source else ""
    for i, raw in enumerate(lines):
        antecedent, arrow, text = _split_rpts_line(tree, where, i, raw)
        tokens = [t for t in antecedent.split("+") if t.strip()]
        if arrow and not tokens:
            tree.warnings.append(f"{where}reasoning[{i}]: no premises before '->'")
        parents = [_premise_node(tree, where, i, tok, textual_clues, num_images, context, images) for tok in tokens]
        tree.add(Node(f"C{i}", text, kind="conclusion", parents=_unique_premises(tree, where, i, parents)))
    tree.root = f"C{len(lines) - 1}" if lines else None
    tree.validate()
    return tree


def _split_rpts_line(tree: Tree, where: str, i: int, raw: str) -> tuple[str, str, str]:
    """(antecedent, arrow, conclusion text) of RPTS line `i`, warning on a missing '->' or a
    ``ConclusionK:`` label that is not the line's position."""
    antecedent, arrow, consequent = raw.partition("->")
    if not arrow:
        tree.warnings.append(f"{where}reasoning[{i}]: no '->' in {raw[:60]!r}; read as a conclusion with no premises")
        antecedent, consequent = "", raw
    m = _CONSEQUENT.match(consequent)
    text = consequent.strip()
    if m:
        text = m.group(2).strip()
        if int(m.group(1)) != i:
            tree.warnings.append(
                f"{where}reasoning[{i}]: labelled Conclusion{m.group(1)} but is line {i}; "
                "premises refer to line positions as in the RPTS reference"
            )
    return antecedent, arrow, text


def _premise_node(
    tree: Tree,
    where: str,
    i: int,
    tok: str,
    textual_clues: Sequence[str] | None,
    num_images: int | None,
    context: str | None,
    images: Sequence[str],
) -> str:
    """Node id of premise `tok` on line `i`, adding its evidence node on first citation; a premise
    that cannot be resolved becomes a "missing" node with a warning."""
    kind = next((k for k, rx in _PREMISE_KINDS if rx.search(tok)), None)
    idx_m = _INT.search(tok)
    if kind is None:
        return _missing_premise(tree, where, i, tok, f"premise {tok.strip()!r} is not Image/Text/Conclusion/Context")
    if kind == "context":
        if "X" not in tree.nodes:
            tree.add(Node("X", context or "(context)", kind="evidence", label="Ctx"))
        return "X"
    if idx_m is None:
        return _missing_premise(tree, where, i, tok, f"premise {tok.strip()!r} has no index")
    k = int(idx_m.group())
    nid = f"{_PREFIX[kind]}{k}"
    if kind == "conclusion":
        if k >= i:
            return _missing_premise(tree, where, i, tok, f"cites Conclusion{k}, which is not an earlier step")
        return nid
    limit = num_images if kind == "image" else (len(textual_clues) if textual_clues is not None else None)
    if limit is not None and k >= limit:
        return _missing_premise(
            tree, where, i, tok, f"cites {kind.capitalize()}{k} but there are only {limit} {kind} clues"
        )
    if nid not in tree.nodes:
        if kind == "image":
            # the file name reads better than a path; tree.images keeps the full paths
            body = str(images[k]).replace("\\", "/").rsplit("/", 1)[-1] if k < len(images) else f"Image{k}"
            tree.add(Node(nid, body, kind="evidence", meta={"image": k}))
        else:
            body = textual_clues[k] if textual_clues is not None else f"Text{k}"
            tree.add(Node(nid, body, kind="evidence"))
    return nid


def _missing_premise(tree: Tree, where: str, line_no: int, token: str, why: str) -> str:
    """Add a "missing" evidence node (an unscored leaf for RPTS) for a premise that cannot be
    resolved, warn why, and return its id (``?<line>.<n>``)."""
    nid = f"?{line_no}.{len([n for n in tree.nodes if n.startswith(f'?{line_no}.')])}"
    tree.add(
        Node(
            nid,
            f"(missing {token.strip() or 'premise'})",
            kind="evidence",
            label="?",
            meta={"missing": True, "token": token.strip()},
        )
    )
    tree.warnings.append(f"{where}reasoning[{line_no}]: {why}; counted as a missing (unscored) premise")
    return nid


def _unique_premises(tree: Tree, where: str, i: int, parents: list[str]) -> list[str]:
    """`parents` without repeats, first citation first, warning once per repeated premise."""
    # A premise cited twice on one line is one premise: citing it again adds no evidence. The
    # RPTS reference keeps both, so its score counts that premise's subtree twice; warn.
    unique = list(dict.fromkeys(parents))
    for p in unique:
        if parents.count(p) > 1:
            tree.warnings.append(
                f"{where}reasoning[{i}]: premise {tree.nodes[p].label} cited "
                f"{parents.count(p)} times; counted once (the RPTS reference counts it each time)"
            )
    return unique


def from_rpts_record(record: Mapping[str, Any], image_dir: str | None = None, source: str = "") -> Tree:
    """Tree of one RPTS-Eval record (gold `reasoning`), with a question built from its fields.

    The question shows the context, numbered text clues and the statement, so a PRM or judge sees
    the evidence that ``TextK`` premises cite. `image_dir` resolves `visual_clue` file names.
    """
    clues = list(record.get("textual_clue", []))
    visual = list(record.get("visual_clue", []))
    images = [f"{image_dir}/{v}" if image_dir else v for v in visual]
    tree = from_rpts_lines(
        record.get("reasoning", []),
        textual_clues=clues,
        num_images=len(visual),
        context=record.get("context"),
        question=rpts_question(record),
        images=images,
        source=source or f"id={row_id(record)}",
    )
    tree.meta.update({"id": record.get("id"), "answer": record.get("answer")})
    return tree


def rpts_question(record: Mapping[str, Any]) -> str:
    """Question text for an RPTS-style record: context, numbered clues, statement, the ask."""
    clues = "\n".join(f"Text{k}: {c}" for k, c in enumerate(record.get("textual_clue", [])))
    parts = [
        f"Context: {record['context']}" if record.get("context") else "",
        f"Clues:\n{clues}" if clues else "",
        f"Statement: {record.get('statement', '')}",
        "Do the images and clues support the statement (agree or disagree)?",
    ]
    return "\n".join(p for p in parts if p)


_MARKER = re.compile(r"\[\s*(NODE|PARENT|ORIGINAL|TYPE)\s*:", re.I)
_THINK360_ID = re.compile(r"\d+\.\d+")


def from_think360_blocks(text: str, question: str = "", images: Sequence[str] = (), source: str = "") -> Tree:
    """Tree of Think360 node blocks, one field per line or several on a line.

    ``[NODE:d.s]`` starts a node, ``[PARENT:None|id]``, ``[ORIGINAL:text]`` and ``[TYPE:t]`` fill it.
    A field runs to the next marker, so text may span lines and contain brackets. Depth is
    recomputed from the parent links (the ``d`` in the id is only checked, with a warning).
    Unknown or cyclic parents become roots, duplicate ids get a suffix; both with a warning.

    ``tree.meta["structure_errors"]`` lists what makes the Think360 reference reject the tree (no
    nodes, an id that is not ``depth.sequence``, a duplicate id, an unknown parent; a cycle too):
    see `mmprm.treeval.extract.think360_valid`. A depth that disagrees with the parent chain is
    only counted (``meta["depths_renumbered"]``): the reference fixes those by renumbering.
    """
    where = f"{source}: " if source else ""
    blocks: list[dict[str, str]] = []
    marks = list(_MARKER.finditer(text))
    for k, m in enumerate(marks):
        name = m.group(1).lower()
        value = text[m.end() : marks[k + 1].start() if k + 1 < len(marks) else len(text)]
        if name == "node" or not blocks:
            blocks.append({})
        blocks[-1][name] = value

    def clean(value: str) -> str:
        # the field's closing bracket is the last one before the next marker
        value = value.strip()
        value = value[:-1] if value.endswith("]") else value
        return "\n".join(line.strip() for line in value.strip().splitlines())

    tree = Tree(question=question, images=list(images))
    # What makes the Think360 reference reject a tree (it then leaves it out of the width/depth
    # averages). A wrong depth in an id is not here: the reference renumbers those trees from
    # their parent links, which is what the depths computed below already are.
    errors: list[str] = []
    declared: dict[str, str] = {}  # node id -> declared parent
    for b, block in enumerate(blocks):
        nid = clean(block.get("node", "")) or f"node{b}"
        if not _THINK360_ID.fullmatch(nid):
            errors.append(f"node id {nid!r} is not depth.sequence")
        if nid in tree.nodes:
            new = f"{nid}#{b}"
            tree.warnings.append(f"{where}node {nid}: duplicate id, renamed {new}")
            errors.append(f"duplicate node id {nid}")
            nid = new
        parent = clean(block.get("parent", "None"))
        declared[nid] = "" if parent.lower() in ("none", "null", "") else parent
        tree.add(Node(nid, clean(block.get("original", "")), meta={"type": clean(block.get("type", ""))}))
    if not blocks:
        tree.warnings.append(f"{where}no [NODE:...] blocks found")
        errors.append("no nodes")
    for nid, parent in declared.items():
        if not parent:
            continue
        if parent not in tree.nodes:
            tree.warnings.append(f"{where}node {nid}: parent {parent} is not a node; treated as a root")
            errors.append(f"node {nid} has a parent that is not a node")
            continue
        tree.nodes[nid].parents = [parent]
        try:
            tree.topo_order()
        except ValueError:
            tree.nodes[nid].parents = []
            tree.warnings.append(f"{where}node {nid}: parent {parent} makes a cycle; treated as a root")
            errors.append(f"node {nid} is in a cycle")
    depths = tree.depths()
    renumbered = 0
    for nid, d in depths.items():
        head = nid.split(".")[0]
        if head.isdigit() and int(head) != d:
            renumbered += 1
            tree.warnings.append(f"{where}node {nid}: id says depth {head} but its parent chain gives {d}")
    tree.meta["structure_errors"] = errors
    tree.meta["depths_renumbered"] = renumbered
    tree.validate()
    return tree


def from_steps(steps: Sequence[str], question: str = "", images: Sequence[str] = ()) -> Tree:
    """A chain: step i ("S{i}") has step i-1 as its only parent."""
    tree = Tree(question=question, images=list(images))
    for i, s in enumerate(steps):
        tree.add(Node(f"S{i}", s, parents=[f"S{i - 1}"] if i else []))
    tree.root = f"S{len(steps) - 1}" if steps else None
    return tree


def from_annotation_tree(obj: Mapping[str, Any], root_is_question: bool = True, source: str = "") -> Tree:
    """Tree of an MCTS annotation record; each node's MC value goes to `meta["mc_value"]`.

    Accepted shapes (values under "mc_value", "value" or "mc"):

    * nested, OpenR math-aps style: ``{"question", "reasoning_steps": {"text", "mc_value",
      "children": [...]}}`` (or the root node itself). With `root_is_question` the root is the
      problem, not a step: it becomes `tree.question` and its children the depth-1 steps.
    * flat, as `mmprm.annotate` search results: ``{"question", "nodes": [{"id", "parent" | "parent_id",
      "text" | "steps", "mc"}]}``; a node's "steps" (the steps added on its edge) join into its text.
      With `root_is_question` the parentless empty-text root is the problem and is dropped.

    Node ids of nested trees are their child-index paths ("0", "0.2", "0.2.1").
    """
    where = f"{source}: " if source else ""
    tree = Tree(question=str(obj.get("question", "")), images=[str(p) for p in obj.get("images", [])])
    for key in ("final_answer", "answer", "question_id", "id"):
        if key in obj:
            tree.meta[key] = obj[key]

    def value(node: Mapping[str, Any]) -> float | None:
        v = node.get("mc_value", node.get("value", node.get("mc")))
        return None if v is None else float(v)

    if "nodes" in obj:
        skipped: set[str] = set()
        for i, n in enumerate(obj["nodes"]):
            nid = str(n.get("id", i))
            parent = n.get("parent", n.get("parent_id"))
            steps = n.get("steps", [])
            if "text" not in n and (not isinstance(steps, list) or not all(isinstance(t, str) for t in steps)):
                raise ValueError(f"{where}node {nid}: steps: must be a list of step texts, got {steps!r:.60}")
            text = n["text"] if "text" in n else "\n".join(steps)
            if root_is_question and parent is None and not text.strip():
                skipped.add(nid)  # the empty-prefix root of a search is the problem itself
                tree.meta["root_mc_value"] = value(n)
                continue
            parents = [str(parent)] if parent is not None and str(parent) not in skipped else []
            meta = {"mc_value": value(n)}
            if "answer" in n:
                meta["answer"] = n["answer"]
            tree.add(Node(nid, text, parents=parents, meta=meta))
        for n in tree.nodes.values():
            if n.parents and n.parents[0] not in tree.nodes:
                tree.warnings.append(f"{where}node {n.id}: parent {n.parents[0]} is not a node; treated as a root")
                n.parents = []
        tree.validate()
        return tree

    root = obj.get("reasoning_steps", obj)
    if not isinstance(root, Mapping) or "text" not in root:
        raise ValueError(
            f"{where}annotation tree: expected 'reasoning_steps' (a node with text, mc_value, "
            "children) or 'nodes' (a flat list); got keys " + ", ".join(map(str, obj))
        )
    stack: list[tuple[Mapping[str, Any], str, str | None]] = []
    if root_is_question:
        tree.question = tree.question or str(root["text"])
        tree.meta["root_mc_value"] = value(root)
        stack = [(c, str(i), None) for i, c in enumerate(root.get("children", []))]
    else:
        stack = [(root, "0", None)]
    stack.reverse()
    while stack:  # depth-first, children in order, so parents always come before children
        node, nid, parent = stack.pop()
        tree.add(
            Node(nid, str(node.get("text", "")), parents=[parent] if parent else [], meta={"mc_value": value(node)})
        )
        kids = node.get("children", []) or []
        stack.extend((c, f"{nid}.{i}", nid) for i, c in reversed(list(enumerate(kids))))
    return tree
