"""Export of annotation trees to step-labelled PRM rows: paths, labels, options, stats."""

from __future__ import annotations

import json

import pytest
from real_data import DATA

from mmprm.annotate.engine import AnnotationEngine, Problem
from mmprm.annotate.export import ExportConfig, export_examples, tree_paths, write_export_report
from mmprm.annotate.omega import OmegaConfig
from mmprm.annotate.simulated import GOLD, SimulatedPolicy, random_problems
from mmprm.data.schema import load_examples, write_jsonl

# root(0.5) -> A "a1","a2" (0.75) -> B "b" (0.0)              negative
#                                  -> C "c" + answer 5 (1.0)   positive (complete solution)
#           -> D "d" (0.25) -> E: answer 7 only (0.0)          negative (answer-only edge)
#                           -> F "e" (0.5)                     positive (probe leaf)
NODES = [
    {"id": 0, "parent": None, "steps": [], "mc": 0.5, "n": 16, "visits": 2},
    {"id": 1, "parent": 0, "steps": ["a1", "a2"], "mc": 0.75, "n": 16, "visits": 1},
    {"id": 2, "parent": 1, "steps": ["b"], "mc": 0.0, "n": 16, "visits": 0},
    {"id": 3, "parent": 1, "steps": ["c"], "mc": 1.0, "n": 0, "visits": 0, "answer": "5"},
    {"id": 4, "parent": 0, "steps": ["d"], "mc": 0.25, "n": 16, "visits": 0},
    {"id": 5, "parent": 4, "steps": [], "mc": 0.0, "n": 0, "visits": 0, "answer": "7"},
    {"id": 6, "parent": 4, "steps": ["e"], "mc": 0.5, "n": 16, "visits": 0},
]


def record(nodes=NODES, pid="p1", status="annotated"):
    return {"id": pid, "status": status, "question": "What is 2 + 3?", "images": [], "answer": "5", "nodes": nodes}


def as_tuples(paths):
    return sorted((tuple(p.steps), tuple(p.labels), p.negative) for p in paths)


def test_node_edges_follow_mm_prm_traverse():
    assert as_tuples(tree_paths(NODES, "node")) == sorted(
        [
            (("a1\na2", "b"), (0.75, 0.0), True),
            (("a1\na2", "c\n<answer>5</answer>"), (0.75, 1.0), False),
            (("d\n<answer>7</answer>",), (0.0,), True),
            (("d", "e"), (0.25, 0.5), False),
        ]
    )


def test_step_edges_give_inner_steps_the_edge_value():
    assert as_tuples(tree_paths(NODES, "step")) == sorted(
        [
            (("a1", "a2", "b"), (0.75, 0.75, 0.0), True),
            (("a1", "a2", "c\n<answer>5</answer>"), (0.75, 0.75, 1.0), False),
            (("d\n<answer>7</answer>",), (0.0,), True),
            (("d", "e"), (0.25, 0.5), False),
        ]
    )


# B's search kept its wrong rollout: B -> G "g1","g2" (a deeper probe, MC 0.5: the policy sometimes
# repairs) -> H "h" + answer 4 (a wrong solution); B -> I "i" + answer 5 (right, below a bad node)
KEPT = NODES + [
    {"id": 7, "parent": 2, "steps": ["g1", "g2"], "mc": 0.5, "n": 16, "visits": 0},
    {"id": 8, "parent": 7, "steps": ["h"], "mc": 0.0, "n": 0, "visits": 0, "answer": "4"},
    {"id": 9, "parent": 2, "steps": ["i"], "mc": 1.0, "n": 0, "visits": 0, "answer": "5"},
]


def test_complete_negatives_go_on_to_the_wrong_answer_with_zero_labels():
    paths = as_tuples(tree_paths(KEPT, "step", negatives="complete"))
    # after the first error B every step is 0.0, even G's (the path is already off track); the
    # right leaf I below B is never a completion; E (an answer-only edge) is whole already
    assert (("a1", "a2", "b", "g1", "g2", "h\n<answer>4</answer>"), (0.75, 0.75, 0.0, 0.0, 0.0, 0.0), True) in paths
    assert (("d\n<answer>7</answer>",), (0.0,), True) in paths and len(paths) == 4
    node_paths = as_tuples(tree_paths(KEPT, "node", negatives="complete"))
    assert (("a1\na2", "b", "g1\ng2", "h\n<answer>4</answer>"), (0.75, 0.0, 0.0, 0.0), True) in node_paths
    # cut (MM-PRM): the negative stops at B, without an answer; so does one with no kept rollout
    assert (("a1", "a2", "b"), (0.75, 0.75, 0.0), True) in as_tuples(tree_paths(KEPT, "step", negatives="cut"))
    assert as_tuples(tree_paths(NODES, "step", negatives="complete")) == as_tuples(tree_paths(NODES, "step"))
    rows, stats = export_examples([record(KEPT)], ExportConfig(balance=None))
    assert stats["negative_paths"] == 2 and stats["completed_negative_paths"] == 2
    rows, stats = export_examples([record(KEPT)], ExportConfig(balance=None, negatives="cut"))
    assert stats["completed_negative_paths"] == 1  # only E, whose error was its answer
    with pytest.raises(ValueError, match="export.negatives"):
        ExportConfig(negatives="full").validate()


def test_threshold_cuts_paths_at_low_values():
    # with threshold 0.3, D (0.25) itself ends a negative path ...
    paths = as_tuples(tree_paths(NODES, "node", negative_threshold=0.3, negatives="cut"))
    assert (("d",), (0.25,), True) in paths and len(paths) == 3
    # ... or, whole, goes on to E's wrong answer (an answer-only edge): that last step is 0.0
    paths = as_tuples(tree_paths(NODES, "node", negative_threshold=0.3))
    assert (("d\n<answer>7</answer>",), (0.0,), True) in paths and len(paths) == 3


def test_balance_dedup_min_length_and_stats():
    extra = NODES + [
        {"id": 7, "parent": 0, "steps": ["g"], "mc": 0.5, "n": 16, "visits": 0},
        {"id": 8, "parent": 0, "steps": ["h", "i"], "mc": 0.5, "n": 16, "visits": 0},
        {"id": 9, "parent": 0, "steps": ["d", "e"], "mc": 0.5, "n": 16, "visits": 0},
    ]
    recs = [record(extra), record(pid="p2", status="screened_all_correct")]
    rows, stats = export_examples(recs, ExportConfig(balance=None))
    assert (
        stats["negative_paths"] == 2
        and stats["positive_paths"] == 5
        and stats["by_status"] == {"annotated": 1, "screened_all_correct": 1}
    )
    rows, stats = export_examples(recs, ExportConfig(balance=1.0))
    assert stats["negative_paths"] == 2 and stats["positive_paths"] == 2 and stats["dropped"]["balance"] == 3
    assert {r["meta"]["kind"] for r in rows} == {"negative", "positive"}
    # step edges: node 9 "d","e" repeats the path D -> F exactly, so dedup drops it
    rows, stats = export_examples(recs, ExportConfig(edges="step", balance=None))
    assert stats["dropped"]["duplicate"] == 1 and stats["positive_paths"] == 4
    rows, stats = export_examples(recs, ExportConfig(balance=None, dedup=False, edges="step"))
    assert stats["dropped"]["duplicate"] == 0 and stats["positive_paths"] == 5
    rows, stats = export_examples(recs, ExportConfig(balance=None, min_steps=2))
    assert stats["dropped"]["too_short"] == 4  # one PRM step each: "d+answer", "g", "h\ni", "d\ne"
    # hand-counted histogram of the node-edge export without balancing:
    # labels 0.75,0.0 | 0.75,1.0 | 0.0 | 0.25,0.5 | 0.5 | 0.5 | 0.5
    rows, stats = export_examples([record(extra)], ExportConfig(balance=None))
    assert stats["labels"]["count"] == 10 and stats["labels"]["zero"] == 2 and stats["labels"]["one"] == 1
    assert stats["labels"]["between"]["0.5-0.6"] == 4 and stats["labels"]["between"]["0.7-0.8"] == 2
    assert stats["labels"]["between"]["0.2-0.3"] == 1
    assert stats["steps_per_path"]["histogram"] == {"1": 4, "2": 3}
    assert stats["labels"]["mean"] == pytest.approx((0.75 * 2 + 1.0 + 0.25 + 0.5 * 4) / 10)


def test_min_words_drops_short_paths():
    rows, stats = export_examples([record()], ExportConfig(balance=None, min_words=2))
    # "a1\na2 b" has 3 words, "d <answer>7</answer>" 2, "d e" 2
    assert stats["dropped"]["too_short"] == 2 and stats["paths"] == 2


def test_export_of_a_real_search_is_valid_training_data(tmp_path):
    problems = random_problems(4, seed=3)
    records = []
    AnnotationEngine(SimulatedPolicy(problems), OmegaConfig(max_rollouts=160), lambda p, g, c: p == g).run(
        [Problem(pid, "What is the answer?", GOLD) for pid in problems], records.append
    )
    rows, stats = export_examples(records, ExportConfig())
    assert stats["paths"] == len(rows) > 0 and stats["negative_paths"] >= stats["positive_paths"] > 0
    write_jsonl(tmp_path / "prm.jsonl", rows)
    examples = load_examples(tmp_path / "prm.jsonl", require_labels=True)
    assert len(examples) == len(rows)
    # A binary search keeps the wrong rollout it searched, so its negative path runs on to that
    # rollout's answer; a node whose MC came out 0 with no kept wrong rollout below it ends at its
    # first error. Most negatives are whole solutions (here 13 of 15; the share moves with the draws).
    assert stats["completed_negative_paths"] >= 0.8 * stats["negative_paths"]
    whole = 0
    for ex in examples:
        if ex.meta["kind"] == "negative":
            # MC > 0 up to its first error, 0.0 from there to its wrong answer (or the error alone)
            first = ex.labels.index(0.0)
            assert all(x > 0 for x in ex.labels[:first]) and set(ex.labels[first:]) == {0.0}
            if "<answer>" in ex.steps[-1]:
                whole += 1
            else:
                assert first == len(ex.labels) - 1
        else:
            assert all(x > 0 for x in ex.labels)
    assert whole == stats["completed_negative_paths"]
    write_export_report(stats, tmp_path / "r.json", tmp_path / "r.png")
    assert json.loads((tmp_path / "r.json").read_text())["paths"] == len(rows)
    assert (tmp_path / "r.png").stat().st_size > 1000


def _flatten(tree: dict) -> list[dict]:
    """openr/MM-PRM nested tree -> our flat node records (each child's text is one step)."""
    nodes: list[dict] = []

    def visit(node, parent):
        nid = len(nodes)
        nodes.append(
            {
                "id": nid,
                "parent": parent,
                "steps": [node["text"]] if parent is not None else [],
                "mc": node["mc_value"],
                "n": 0,
                "visits": 0,
            }
        )
        for child in node["children"]:
            visit(child, nid)

    visit(tree, None)
    return nodes


def _reference_paths(node, labels=()):
    """MM-PRM's traverse written out: stop at mc <= 0, else recurse, leaves are positive."""
    out = []
    for child in node["children"]:
        lab = labels + (child["mc_value"],)
        if child["mc_value"] <= 0:
            out.append((lab, True))
        elif child["children"]:
            out.extend(_reference_paths(child, lab))
        else:
            out.append((lab, False))
    return out


def test_paths_of_real_openr_mcts_trees_match_mm_prm_traverse():
    lines = (DATA / "openr_samples" / "samples_math-aps-tree.jsonl").read_text().splitlines()
    for line in lines:
        tree = json.loads(line)["reasoning_steps"]
        got = sorted((tuple(p.labels), p.negative) for p in tree_paths(_flatten(tree), "node"))
        want = sorted(_reference_paths(tree))
        assert got == want and len(got) > 5


def test_export_counts_unfinished_rollouts_as_truncated():
    recs = [
        {**record(), "stats": {"rollouts": 32, "truncated_rollouts": 5}},
        {**record(pid="p2", status="no_answer"), "stats": {"rollouts": 16, "truncated_rollouts": 16}},
        record(pid="p3"),
    ]  # a record from before the count existed
    _, stats = export_examples(recs, ExportConfig(balance=None))
    assert stats["truncated_rollouts"] == 21 and stats["by_status"]["no_answer"] == 1


# MM-PRM's export, transcribed from github:ModalMinds/MM-PRM@b914fd66c8efb3d6667610fba1f8fd1e55cde095:
# data_pipeline/traverse.py (`dfs` before dedup and balancing; `completion_too_short` apart). Its
# tree nodes hold `partial_solution`, the rollout's slice, whose last element is the answer.
def _traverse_reference(root: dict, threshold: float = 0.0) -> list[tuple[str, tuple, bool]]:
    out = []

    def dfs(node, prefix, labels):
        prefix = prefix + "\n\n".join(map(str.strip, node["partial_solution"])) + "<prm>" + "\n\n"
        labels = labels + [node["mc_value"]]
        if node["mc_value"] <= threshold:
            out.append((prefix.strip(), tuple(labels), True))
            return
        if node["children"]:
            for child in node["children"]:
                dfs(child, prefix, labels)
        else:
            out.append((prefix.strip(), tuple(labels), False))

    for child in root["children"]:
        dfs(child, "", [])
    return sorted(out)


def _as_mm_prm_tree(nodes: list[dict], node_id: int = 0) -> dict:
    node = next(n for n in nodes if n["id"] == node_id)
    answer = [node["answer"]] if node.get("answer") is not None else []
    return {
        "partial_solution": list(node["steps"]) + answer,
        "mc_value": node["mc"],
        "children": [_as_mm_prm_tree(nodes, n["id"]) for n in nodes if n["parent"] == node_id],
    }


def test_mm_prm_format_writes_paths_as_traverse_does():
    paths = tree_paths(NODES, "node", negatives="cut", fmt="mm_prm")
    # each edge's steps joined by a blank line; the answer a plain step, and an answer-only edge
    # (E: answer 7) a step of its own with its own label
    assert as_tuples(paths) == sorted(
        [
            (("a1\n\na2", "b"), (0.75, 0.0), True),
            (("a1\n\na2", "c\n\n5"), (0.75, 1.0), False),
            (("d", "7"), (0.25, 0.0), True),
            (("d", "e"), (0.25, 0.5), False),
        ]
    )
    mine = sorted(("".join(f"{s}<prm>\n\n" for s in p.steps).strip(), tuple(p.labels), p.negative) for p in paths)
    assert mine == _traverse_reference(_as_mm_prm_tree(NODES))
    # a completed negative (negatives=complete) ends on the wrong answer as a plain step too
    node_paths = as_tuples(tree_paths(KEPT, "node", negatives="complete", fmt="mm_prm"))
    assert (("a1\n\na2", "b", "g1\n\ng2", "h\n\n4"), (0.75, 0.0, 0.0, 0.0), True) in node_paths


def test_mm_prm_format_counts_words_as_traverse_does():
    from mmprm.annotate.export import traverse_words

    # traverse.py: len(process.split(' ')) <= 10 is too short; a newline does not part words
    lines = "\n".join(f"w{i}" for i in range(12))  # 12 words by whitespace, 1 by single spaces
    nodes = [
        {"id": 0, "parent": None, "steps": [], "mc": 0.5, "n": 16, "visits": 1},
        {"id": 1, "parent": 0, "steps": [lines], "mc": 0.0, "n": 16, "visits": 0},
        {"id": 2, "parent": 0, "steps": ["one two three four five six", "seven"], "mc": 1.0, "answer": "8 9 10"},
    ]
    assert traverse_words([lines]) == 1
    assert traverse_words(["one two three four five six\n\nseven\n\n8 9 10"]) == 8
    rows, stats = export_examples([record(nodes)], ExportConfig(min_words=9, balance=None, negatives="cut"))
    assert stats["dropped"]["too_short"] == 0 and len(rows) == 2  # 12 and 10 ("<answer>8", "10</answer>") words
    rows, stats = export_examples(
        [record(nodes)], ExportConfig(min_words=9, balance=None, negatives="cut", format="mm_prm")
    )
    assert stats["dropped"]["too_short"] == 2 and rows == []  # 1 and 8 words
    rows, _ = export_examples([record(nodes)], ExportConfig(min_words=7, balance=None, format="mm_prm"))
    assert [r["steps"] for r in rows] == [["one two three four five six\n\nseven\n\n8 9 10"]]
