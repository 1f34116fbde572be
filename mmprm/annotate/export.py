"""Annotation trees -> step-labelled PRM training rows (`mmprm.data.schema`) + a stats report.

    rows, stats = export_examples(read_jsonl("out/trees.jsonl"), ExportConfig())
    write_jsonl("out/prm_train.jsonl", rows); write_export_report(stats, "out/export_report.json")

or, streamed (memory: one tree at a time, whatever the number of problems)::

    stats = {}
    write_jsonl("out/prm_train.jsonl", iter_examples(iter_records("out/trees.jsonl"), ExportConfig(), stats))

Paths follow MM-PRM's traverse: walk down from the root; a node whose MC value is at or below
`negative_threshold` ends a negative path (its last step is the first error the search found);
a leaf with MC above it ends a positive path. Every step is labelled with the soft MC value of
the node it reaches. Example, a tree root -> A (mc 0.75) -> B (mc 0.0), A -> C (terminal, mc 1)::

    negative: steps [A, B]       labels [0.75, 0.0]
    positive: steps [A, C + answer] labels [0.75, 1.0]

`negatives="complete"` (the default) goes on below the first error along the wrong rollout the
search ran on (`OmegaConfig.keep_failed_rollouts`) to its answer, every step after the error
labelled 0.0; the path above becomes ``steps [A, B, B2 + answer 4] labels [0.75, 0.0, 0.0]``.
Cut paths (`negatives="cut"`, MM-PRM's; also any negative without a kept rollout) end mid-solution
without an answer while positive paths end with one, and the PRM sees the answer on the last step
(`prm_steps`): it can then learn "has an answer" instead of checking the step, which is why
`complete` is the default (the demo's figures are in docs/scaling.md).

`edges="node"` makes each tree edge one PRM step, as MM-PRM does; `edges="step"` keeps every
policy step and gives the steps inside an edge the edge's value - exact for the one-step edges
where a binary search ended, an approximation elsewhere.

`format` writes the steps: "mmprm" joins an edge's policy steps with "\\n", attaches the answer to
the last step in `<answer>` tags (`prm_steps`) and counts words by whitespace; "mm_prm" writes them
as MM-PRM's data_pipeline/traverse.py does (github:ModalMinds/MM-PRM@b914fd66c8efb3d6667610fba1f8fd1e55cde095):
an edge's steps joined by "\\n\\n", the answer a plain step (the last of its rollout, so an
answer-only edge is a step of its own), words counted by `traverse_words`. The node example
above in "mm_prm": ``steps ["A", "C\\n\\nANSWER"]`` for the positive path.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from mmprm.steps import STEP_TOKEN, prm_steps

ExportFormat = Literal["mmprm", "mm_prm"]
MM_PRM_STEP_TOKEN = "<prm>"  # MM-PRM's internvl/train/constants.py PRM_TOKEN


def traverse_words(steps: list[str]) -> int:
    """Words of a path as MM-PRM's traverse.py counts them: its process text (each step followed by
    `<prm>` and a blank line) split on single spaces, so newlines do not part words.

    >>> traverse_words(["a b\\n\\nc", "d"])   # "a b\\n\\nc<prm>\\n\\nd<prm>\\n\\n".split(" ")
    2
    """
    return len("".join(f"{s}{MM_PRM_STEP_TOKEN}\n\n" for s in steps).split(" "))


@dataclass
class ExportConfig:
    """How trees become training rows.

    Attributes:
        edges: "node" (one PRM step per tree edge, MM-PRM) or "step" (one per policy step).
        negative_threshold: a node with MC <= this is the first error of a negative path (MM-PRM: 0.0).
        negatives: "complete" (a negative path goes on along its kept wrong rollout to that
            rollout's answer, later steps labelled 0.0) or "cut" (it ends at its first error, MM-PRM).
        balance: keep at most `balance` positive paths per negative path of the same problem
            (MM-PRM: 1.0); None keeps all.
        dedup: drop paths whose step texts repeat an earlier path of the same problem.
        min_steps: drop paths with fewer PRM steps.
        min_words: drop paths with this many words or fewer (MM-PRM: 10); 0 keeps all.
        seed: for the positive subsampling.
        format: how steps are written (module doc): "mmprm" (edge steps joined by "\\n", the answer
            in `<answer>` tags on the last step, words split on whitespace) or "mm_prm" (MM-PRM's
            traverse.py: joined by "\\n\\n", the answer a plain step, words split on spaces).
    """

    edges: Literal["node", "step"] = "node"
    negative_threshold: float = 0.0
    negatives: Literal["complete", "cut"] = "complete"
    balance: float | None = 1.0
    dedup: bool = True
    min_steps: int = 1
    min_words: int = 0
    seed: int = 0
    format: ExportFormat = "mmprm"

    def validate(self) -> None:
        if self.format not in ("mmprm", "mm_prm"):
            raise ValueError(f"export.format must be 'mmprm' or 'mm_prm', got {self.format!r}")
        if self.negatives not in ("complete", "cut"):
            raise ValueError(f"export.negatives must be 'complete' or 'cut', got {self.negatives!r}")
        if self.balance is not None and self.balance < 0:
            raise ValueError("export.balance must be >= 0 or null")
        if self.min_steps < 1:
            raise ValueError("export.min_steps must be >= 1")


@dataclass
class TreePath:
    """One root-to-leaf path: PRM steps (answer attached when the leaf is a complete solution)."""

    steps: list[str]
    labels: list[float]
    negative: bool
    node: int
    completed: bool = False  # a negative path that ends with an answer: a whole wrong solution


def tree_paths(
    nodes: list[dict[str, Any]],
    edges: Literal["node", "step"] = "node",
    negative_threshold: float = 0.0,
    negatives: Literal["complete", "cut"] = "complete",
    fmt: ExportFormat = "mmprm",
) -> list[TreePath]:
    """Root-to-leaf paths of one tree record's `nodes` (see module doc)."""
    plain = fmt == "mm_prm"

    def edge_steps(node: dict[str, Any]) -> list[str]:
        new = [s.strip() for s in node["steps"]]
        if plain and node.get("answer") is not None:
            new.append(str(node["answer"]).strip())  # MM-PRM: the answer is its rollout's last step
        return [("\n\n" if plain else "\n").join(new)] if edges == "node" and new else new

    children: dict[int | None, list[dict[str, Any]]] = {}
    for n in nodes:
        children.setdefault(n["parent"], []).append(n)
    out: list[TreePath] = []
    roots = children.get(None, [])
    if not roots:
        return out
    # Iterative DFS: (node, steps so far, labels so far)
    stack: list[tuple[dict[str, Any], list[str], list[float]]] = [
        (c, [], []) for c in reversed(children.get(roots[0]["id"], []))
    ]
    while stack:
        node, steps, labels = stack.pop()
        new = edge_steps(node)
        mc = float(node["mc"])
        answer = node.get("answer")
        if new:
            steps, labels = steps + new, labels + [mc] * len(new)
        elif steps and answer is not None:
            labels = labels[:-1] + [mc]  # answer-only edge: the answer joins the last step below
        else:
            continue  # nothing to label: no new step and no answer
        if answer is not None and not plain:
            steps = prm_steps(steps, answer)
        if mc <= negative_threshold:
            tail = _wrong_completion(node, children) if negatives == "complete" and answer is None else None
            if tail is None:
                out.append(TreePath(steps, labels, True, node["id"], completed=answer is not None))
                continue
            edges_below, final_answer = tail
            for below in edges_below:
                new = edge_steps(below)
                steps, labels = steps + new, labels + [0.0] * len(new)
            labels = labels[:-1] + [0.0]  # the step that carries the wrong answer (an answer-only edge adds none)
            steps = steps if plain else prm_steps(steps, final_answer)
            out.append(TreePath(steps, labels, True, node["id"], completed=True))
        elif children.get(node["id"]):
            stack.extend((c, steps, labels) for c in reversed(children[node["id"]]))
        else:
            out.append(TreePath(steps, labels, False, node["id"]))
    return out


def _wrong_completion(
    node: dict[str, Any], children: dict[int | None, list[dict[str, Any]]]
) -> tuple[list[dict[str, Any]], str] | None:
    """The edges from `node` down to its first wrong complete solution (a leaf with an answer and
    MC 0.0, in the records' order, as `tree_paths` walks) and that solution's answer; None when
    there is none below `node`."""
    stack: list[tuple[dict[str, Any], list[dict[str, Any]]]] = [(node, [])]
    while stack:
        current, trail = stack.pop()
        if current is not node and current.get("answer") is not None:
            if float(current["mc"]) == 0.0:
                return trail, current["answer"]
            continue
        stack.extend((child, trail + [child]) for child in reversed(children.get(current["id"], [])))
    return None


def export_examples(
    records: Iterable[dict[str, Any]], cfg: ExportConfig
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Training rows (schema dicts) from tree records, and the statistics of the export."""
    stats: dict[str, Any] = {}
    rows = list(iter_examples(records, cfg, stats))
    return rows, stats


def iter_examples(
    records: Iterable[dict[str, Any]], cfg: ExportConfig, stats: dict[str, Any]
) -> Iterator[dict[str, Any]]:
    """Training rows from tree records, one problem's at a time; `stats` is filled as they go and
    is complete once the iterator is exhausted (counts, drops, label and length histograms)."""
    cfg.validate()
    rng = random.Random(cfg.seed)
    stats.clear()
    stats.update(
        {
            "problems": 0,
            "by_status": {},
            "paths": 0,
            "negative_paths": 0,
            "completed_negative_paths": 0,
            "positive_paths": 0,
            "truncated_rollouts": 0,
            "dropped": {"duplicate": 0, "too_short": 0, "step_token": 0, "balance": 0},
        }
    )
    hist = _Histograms()
    for rec in records:
        stats["problems"] += 1
        stats["by_status"][rec["status"]] = stats["by_status"].get(rec["status"], 0) + 1
        # Rollouts that stopped before an answer (max_new_tokens, or none written): never labelled.
        stats["truncated_rollouts"] += int((rec.get("stats") or {}).get("truncated_rollouts", 0))
        if rec["status"] != "annotated":
            continue
        kept: list[TreePath] = []
        seen: set[tuple[str, ...]] = set()
        for p in tree_paths(rec["nodes"], cfg.edges, cfg.negative_threshold, cfg.negatives, cfg.format):
            key = tuple(p.steps)
            if cfg.dedup and key in seen:
                stats["dropped"]["duplicate"] += 1
                continue
            seen.add(key)
            words = traverse_words(p.steps) if cfg.format == "mm_prm" else sum(len(s.split()) for s in p.steps)
            if len(p.steps) < cfg.min_steps or words <= cfg.min_words:
                stats["dropped"]["too_short"] += 1
                continue
            if any(STEP_TOKEN in s or (cfg.format == "mm_prm" and MM_PRM_STEP_TOKEN in s) for s in p.steps):
                stats["dropped"]["step_token"] += 1  # the schema rejects it; the policy wrote our reserved token
                continue
            kept.append(p)
        negatives = [p for p in kept if p.negative]
        positives = [p for p in kept if not p.negative]
        if cfg.balance is not None and len(positives) > cfg.balance * len(negatives):
            keep = int(cfg.balance * len(negatives))
            stats["dropped"]["balance"] += len(positives) - keep
            positives = rng.sample(positives, keep)
        stats["negative_paths"] += len(negatives)
        stats["completed_negative_paths"] += sum(p.completed for p in negatives)
        stats["positive_paths"] += len(positives)
        for k, p in enumerate(negatives + positives):
            stats["paths"] += 1
            hist.add(p.labels)
            yield {
                "id": f"{rec['id']}/path{k}",
                "images": rec.get("images", []),
                "question": rec["question"],
                "steps": p.steps,
                "labels": p.labels,
                "meta": {
                    "source": "omegaprm",
                    "problem_id": rec["id"],
                    "gold": rec.get("answer"),
                    "kind": "negative" if p.negative else "positive",
                    "node": p.node,
                },
            }
    stats.update(hist.summary())


class _Histograms:
    """Label histogram (exact 0 and 1 apart, 10 bins in between) and steps per path, kept as counts."""

    def __init__(self) -> None:
        self.count = self.zero = self.one = 0
        self.total = 0.0
        self.bins = [0] * 10
        self.lengths: dict[int, int] = {}
        self.paths = self.steps = 0

    def add(self, labels: list[float]) -> None:
        for x in labels:
            self.count += 1
            self.total += x
            if x == 0.0:
                self.zero += 1
            elif x == 1.0:
                self.one += 1
            elif 0.0 < x < 1.0:
                self.bins[min(int(x * 10), 9)] += 1
        self.lengths[len(labels)] = self.lengths.get(len(labels), 0) + 1
        self.paths += 1
        self.steps += len(labels)

    def summary(self) -> dict[str, Any]:
        return {
            "labels": {
                "count": self.count,
                "zero": self.zero,
                "one": self.one,
                "between": {f"{i / 10:.1f}-{(i + 1) / 10:.1f}": b for i, b in enumerate(self.bins)},
                "mean": self.total / self.count if self.count else None,
            },
            "steps_per_path": {
                "histogram": {str(k): v for k, v in sorted(self.lengths.items())},
                "mean": self.steps / self.paths if self.paths else None,
            },
        }


def write_export_report(stats: dict[str, Any], json_path: str | Path, png_path: str | Path | None = None) -> None:
    """Write the export statistics as JSON, and as a two-panel PNG when `png_path` is given."""
    Path(json_path).write_text(json.dumps(stats, indent=2) + "\n", encoding="utf-8")
    if png_path is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lab = stats["labels"]
    names = ["0"] + list(lab["between"]) + ["1"]
    values = [lab["zero"]] + list(lab["between"].values()) + [lab["one"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.5))
    ax1.bar(range(len(values)), values)
    ax1.set_xticks(range(len(values)), names, rotation=60, fontsize=7)
    ax1.set_title(f"step labels (MC values), n={lab['count']}")
    hist = stats["steps_per_path"]["histogram"]
    ax2.bar([int(k) for k in hist], list(hist.values()))
    ax2.set_title(f"PRM steps per path, {stats['paths']} paths")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
