"""Reasoning trees: builders on real RPTS-Eval / OpenR data, hand-computed metrics, scorers."""

from __future__ import annotations

import json
import math
import random

import pytest
from real_data import DATA

from mmprm.treeval import (
    JudgeScorer,
    Node,
    Tree,
    constant_scores,
    filtered_accuracy,
    from_annotation_tree,
    from_rpts_lines,
    from_rpts_record,
    from_steps,
    from_think360_blocks,
    mc_scores,
    node_paths,
    path_scores,
    prm_scores,
    render_tree,
    rpts,
    set_scores,
    think360_depth,
    think360_width,
)
from mmprm.treeval.scorers import covering_paths, parse_verdict

RPTS_DIR = DATA / "rpts_eval"
OPENR_TREES = DATA / "openr_samples" / "samples_math-aps-tree.jsonl"

# 4 forward Conclusion references + 1 Text index past the clues + 1 premise cited twice (410)
QUIRKY_IDS = {155, 202, 203, 215, 265, 410}


def rpts_records(lang: str) -> list[dict]:
    return json.loads((RPTS_DIR / f"texts_{lang}.json").read_text(encoding="utf-8"))


def record(rid: int) -> dict:
    return next(r for r in rpts_records("en") if r["id"] == rid)


def think_tree(scores: dict[str, float]) -> Tree:
    """R -> A, B; A -> C; optional B -> D (only when D is scored)."""
    t = Tree()
    t.add(Node("R", "root"))
    t.add(Node("A", "a", parents=["R"]))
    t.add(Node("B", "b", parents=["R"]))
    t.add(Node("C", "c", parents=["A"]))
    if "D" in scores:
        t.add(Node("D", "d", parents=["B"]))
    return set_scores(t, scores)


# ---------------------------------------------------------------- RPTS-Eval: parsing and heights


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_every_rpts_eval_record_parses_and_quirks_become_warnings(lang):
    records = rpts_records(lang)
    assert len(records) == 416
    warned = set()
    for r in records:
        tree = from_rpts_record(r, image_dir=str(RPTS_DIR / "images"))
        assert len(tree.conclusions()) == len(r["reasoning"])
        assert tree.root == f"C{len(r['reasoning']) - 1}"
        tree.validate()
        if tree.warnings:
            warned.add(r["id"])
    assert warned == QUIRKY_IDS


def test_premise_cited_twice_is_counted_once_with_a_warning():
    # The RPTS reference keeps both citations, so its recursion weighs T0's subtree twice; we do not.
    tree = from_rpts_lines(
        ["Text0 -> Conclusion0: a", "Conclusion0 + Conclusion0 + Text1 -> Conclusion1: b"], ["t0", "t1"], 0, source="x"
    )
    assert tree.nodes["C1"].parents == ["C0", "T1"]
    assert tree.warnings == [
        "x: reasoning[1]: premise C0 cited 2 times; counted once (the RPTS reference counts it each time)"
    ]
    set_scores(tree, {"C0": 0.0, "C1": 1.0})
    # heights 1, 2; lam 0.5, h_f 1: weights 1 and 0.5 -> (0 * 1 + 1 * 0.5) / 1.5 (the reference: C0 twice, 0.5 / 2.5)
    assert rpts(tree, lam=0.5, h_f=1) == pytest.approx(1 / 3)


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_all_ones_scores_give_rpts_one_on_every_record(lang):
    for r in rpts_records(lang):
        tree = from_rpts_record(r)
        set_scores(tree, constant_scores(tree, 1.0))
        assert rpts(tree) == pytest.approx(1.0, abs=1e-12), r["id"]
        assert think360_width(tree) in (None, 1.0) and think360_depth(tree) == 1.0


def test_heights_match_hand_check():
    # id 2: Image0 -> C0; Text2 + Text3 -> C1; C0 + C1 -> C2; C2 + Text4 -> C3; C3 + Text0 -> C4
    h = from_rpts_record(record(2)).heights()
    assert {k: h[k] for k in ("C0", "C1", "C2", "C3", "C4")} == {"C0": 1, "C1": 1, "C2": 2, "C3": 3, "C4": 4}
    assert h["I0"] == h["T2"] == h["T4"] == 0
    # id 0: Image0 -> C0; Text1 + Text2 -> C1; C0 + C1 -> C2
    h = from_rpts_record(record(0)).heights()
    assert (h["C0"], h["C1"], h["C2"]) == (1, 1, 2)
    # id 258: C0 is reused by C1 and C2, both under C3
    tree = from_rpts_record(record(258))
    h = tree.heights()
    assert (h["C0"], h["C1"], h["C2"], h["C3"]) == (1, 2, 2, 3)
    assert tree.nodes["C3"].parents == ["C1", "C2"] and tree.nodes["C1"].parents == ["C0", "T1"]


def test_quirky_record_keeps_a_missing_premise():
    # id 155, line 2: "Conclusion1 + Conclusion2 -> ..." cites itself
    tree = from_rpts_record(record(155))
    c2 = tree.nodes["C2"]
    assert c2.parents[0] == "C1"
    missing = tree.nodes[c2.parents[1]]
    assert missing.kind == "evidence" and missing.meta["missing"]
    assert tree.heights()["C2"] == 2
    assert "reasoning[2]: cites Conclusion2, which is not an earlier step" in tree.warnings[0]
    # id 215 cites Text2 with two text clues
    assert "only 2 text clues" in from_rpts_record(record(215)).warnings[0]


def test_rpts_lines_formats_and_bad_lines():
    tree = from_rpts_lines(
        [
            "Image 0 -> Conclusion 0: A red light.",
            "Conclusion 0 + Text 0 + Context -> Conclusion 1: It brakes.",
            "no arrow here",
            "Premise3 -> x",
        ],
        textual_clues=["Red = brake."],
        num_images=1,
        context="A road.",
    )
    assert tree.nodes["C0"].text == "A red light." and tree.nodes["C1"].parents == ["C0", "T0", "X"]
    assert tree.nodes["X"].text == "A road." and tree.nodes["C2"].parents == []
    assert len(tree.warnings) == 2 and "no '->'" in tree.warnings[0] and "Premise3" in tree.warnings[1]
    zh = from_rpts_lines(
        ["图片0 -> 结论0：红灯", "结论0 + 文本0 + 上下文 -> 结论1：刹车"], ["红=刹车"], 1, context="路"
    )
    assert zh.nodes["C1"].parents == ["C0", "T0", "X"] and zh.nodes["C1"].text == "刹车" and not zh.warnings
    # a label that disagrees with the line position is kept by position, with a warning
    assert "labelled Conclusion5" in from_rpts_lines(["Text0 -> Conclusion 5: x"]).warnings[0]


# ---------------------------------------------------------------- RPTS: hand values and reference recursion


def small_rpts_tree(s0: float, s1: float, s2: float) -> Tree:
    tree = from_rpts_lines(
        ["Image0 -> a", "Text0 + Text1 -> b", "Conclusion0 + Conclusion1 -> c"],
        textual_clues=["t0", "t1"],
        num_images=1,
    )
    return set_scores(tree, {"C0": s0, "C1": s1, "C2": s2})


def test_rpts_hand_values():
    # heights 1, 1, 2; lam 0.9, h_f 1 -> weights 1, 1, 0.9: (1 + 0.5 + 0) / 2.9
    assert rpts(small_rpts_tree(1.0, 0.5, 0.0)) == pytest.approx(1.5 / 2.9)
    # lam 0.5, h_f 2 -> weights 0.5, 0.5, 1: (0.5 + 0.25 + 0) / 2
    assert rpts(small_rpts_tree(1.0, 0.5, 0.0), lam=0.5, h_f=2) == pytest.approx(0.375)
    # lam 1 is the plain mean
    assert rpts(small_rpts_tree(1.0, 0.5, 0.0), lam=1.0) == pytest.approx(0.5)
    assert rpts(Tree()) == 0.0
    with pytest.raises(ValueError, match="decay factor"):
        rpts(small_rpts_tree(1, 1, 1), lam=0.0)


def test_rpts_counts_a_reused_conclusion_once_per_path():
    # id 258: C0 (h1) is under C3 twice (via C1 and via C2); C1, C2 h2; C3 h3.
    tree = set_scores(from_rpts_record(record(258)), {"C0": 0.0, "C1": 1.0, "C2": 1.0, "C3": 1.0})
    # weights: C3 0.81, C1 0.9, C2 0.9, C0 2 x 1.0
    assert rpts(tree) == pytest.approx((0.81 + 0.9 + 0.9) / (0.81 + 0.9 + 0.9 + 2.0))


def reference_rpts(tree: Tree, lam: float, h_f: int) -> float:
    """RPTS by the reference's recursion over the unfolded tree (independent of metrics.rpts)."""

    def visit(nid: str) -> tuple[float, int, float]:
        node = tree.nodes[nid]
        if node.kind == "evidence":
            return 0.0, -h_f, 0.0
        total, exps, weights = 0.0, [], 0.0
        for p in node.parents:
            s, e, w = visit(p)
            total, weights = total + s, weights + w
            exps.append(e)
        exp = max(exps, default=-h_f) + 1
        w = lam ** abs(exp)
        return node.score * w + total, exp, w + weights

    s, _, w = visit(tree.root)
    return s / w


def test_rpts_matches_reference_recursion_on_all_records_with_random_scores():
    rng = random.Random(0)
    for r in rpts_records("en"):
        tree = from_rpts_record(r)
        set_scores(tree, {n.id: rng.random() for n in tree.conclusions()})
        lam, h_f = rng.choice([0.5, 0.9, 0.95]), rng.choice([0, 1, 2, 3])
        assert rpts(tree, lam, h_f) == pytest.approx(reference_rpts(tree, lam, h_f), rel=1e-12), r["id"]


def test_filtered_accuracy_and_path_scores():
    # correct & rpts >= 0.5: item 0 yes, item 1 no (rpts), item 2 no (answer), item 3 yes (boundary)
    assert filtered_accuracy([True, True, False, True], [0.9, 0.4, 0.9, 0.5], 0.5) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        filtered_accuracy([True], [0.1, 0.2])
    tree = small_rpts_tree(1.0, 0.5, 0.25)
    # the final conclusion's conclusion path: C0, C1, C2
    assert path_scores(tree, min) == {"C2": 0.25}
    assert path_scores(tree, lambda xs: sum(xs) / len(xs)) == {"C2": pytest.approx(1.75 / 3)}
    from mmprm.scoring.aggregators import AGGREGATORS  # the BoN aggregators plug in directly

    assert path_scores(tree, AGGREGATORS["last"])["C2"] == pytest.approx(0.25)


# ---------------------------------------------------------------- Think360 width / depth


def test_think360_width_depth_hand_values():
    tree = think_tree({"R": 0.3, "A": 0.9, "B": 0.2, "C": 0.7})
    # groups {A, B} -> 1/2, {C} -> 1 (roots are in no group, singletons count)
    assert think360_width(tree) == pytest.approx(0.75)
    assert think360_width(tree, soft=True) == pytest.approx(((0.9 + 0.2) / 2 + 0.7) / 2)
    # deepest node C, path R (0.3 wrong), A, C -> 2/3
    assert think360_depth(tree) == pytest.approx(2 / 3)
    assert think360_depth(tree, soft=True) == pytest.approx((0.3 + 0.9 + 0.7) / 3)
    # two deepest nodes: C (2/3) and D via R, B (0/3)
    tree = think_tree({"R": 0.3, "A": 0.9, "B": 0.2, "C": 0.7, "D": 0.1})
    assert think360_depth(tree) == pytest.approx((2 / 3 + 0.0) / 2)
    assert think360_width(tree) == pytest.approx((0.5 + 1.0 + 0.0) / 3)
    # the threshold is inclusive
    tree = think_tree({"R": 0.5, "A": 0.5, "B": 0.49, "C": 0.5})
    assert think360_width(tree, threshold=0.5) == pytest.approx(0.75) and think360_depth(tree) == 1.0


def test_think360_edge_cases():
    single = set_scores(from_steps(["only step"]), {"S0": 0.2})
    assert think360_width(single) is None and think360_depth(single) == 0.0
    assert think360_depth(Tree()) is None
    # a chain: width = correct share of steps 2..n, depth = correct share of all steps
    chain = set_scores(from_steps(["a", "b", "c", "d"]), {"S0": 0.1, "S1": 0.9, "S2": 0.6, "S3": 0.2})
    assert think360_width(chain) == pytest.approx(2 / 3) and think360_depth(chain) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="node S0 has no score"):
        think360_depth(from_steps(["a"]))


def test_think360_blocks_parse_with_quirks():
    text = """Some preamble the extractor wrote.
[NODE:1.1]
[PARENT:None]
[ORIGINAL:The squirrel is in compartment [E], top right.]
[TYPE:observation]

[NODE:2.1]
[PARENT:1.1]
[ORIGINAL:The apples are walled off;
no path connects them.]
[TYPE:deduction]
[NODE:2.2] [PARENT:1.1]
[ORIGINAL:Berries connect.]
[NODE:3.1]
[PARENT:2.1]
[ORIGINAL:Answer: A]
[TYPE:conclusion]
[NODE:2.2]
[PARENT:9.9]
[ORIGINAL:duplicate with a dangling parent]
[NODE:4.1]
[PARENT:2.2]
[ORIGINAL:depth in the id is wrong]"""
    tree = from_think360_blocks(text)
    assert list(tree.nodes)[:4] == ["1.1", "2.1", "2.2", "3.1"]
    assert tree.nodes["1.1"].text == "The squirrel is in compartment [E], top right."
    assert tree.nodes["2.1"].text == "The apples are walled off;\nno path connects them."
    assert tree.nodes["2.1"].meta["type"] == "deduction" and tree.nodes["3.1"].parents == ["2.1"]
    assert tree.depths() == {"1.1": 1, "2.1": 2, "2.2": 2, "3.1": 3, "2.2#4": 1, "4.1": 3}
    joined = "\n".join(tree.warnings)
    assert "duplicate id, renamed 2.2#4" in joined and "parent 9.9 is not a node" in joined
    assert "node 4.1: id says depth 4 but its parent chain gives 3" in joined
    cyc = from_think360_blocks("[NODE:1.1]\n[PARENT:2.1]\n[ORIGINAL:a]\n[NODE:2.1]\n[PARENT:1.1]\n[ORIGINAL:b]")
    assert any("cycle" in w for w in cyc.warnings)
    cyc.validate()
    assert from_think360_blocks("no blocks").warnings == ["no [NODE:...] blocks found"]


# ---------------------------------------------------------------- annotation trees and MC scores


def test_openr_mc_trees():
    rows = [json.loads(line) for line in OPENR_TREES.read_text().splitlines()]
    trees = [from_annotation_tree(r) for r in rows]
    assert [len(t) for t in trees] == [142, 89, 23]  # the question root is not a step
    assert [max(t.depths().values()) for t in trees] == [4, 3, 3]
    first = rows[0]["reasoning_steps"]["children"][0]
    assert trees[0].nodes["0"].meta["mc_value"] == first["mc_value"] and trees[0].question == rows[0]["question"]
    for t in trees:
        set_scores(t, mc_scores(t))
        assert 0.0 <= rpts(t) <= 1.0 and 0.0 <= think360_width(t) <= 1.0
    with pytest.raises(ValueError, match="no mc_value"):
        mc_scores(from_steps(["a"]))


def test_flat_annotation_tree_from_search_results():
    # mmprm.annotate search records: root = empty prefix (the problem), steps added on each edge
    obj = {
        "question": "1+1?",
        "nodes": [
            {"id": 0, "parent": None, "steps": [], "mc": 0.5},
            {"id": 1, "parent": 0, "steps": ["1+1=2.", "So 2."], "mc": 1.0},
            {"id": 2, "parent": 0, "steps": ["1+1=3."], "mc": 0.0},
            {"id": 3, "parent": 2, "steps": ["So 3."], "mc": 0.0, "answer": "3"},
        ],
    }
    tree = from_annotation_tree(obj)
    assert list(tree.nodes) == ["1", "2", "3"] and tree.nodes["1"].text == "1+1=2.\nSo 2."
    assert tree.nodes["1"].parents == [] and tree.nodes["3"].parents == ["2"]
    set_scores(tree, mc_scores(tree))
    # groups: {3} -> 0; depth: deepest 3, path 2, 3 -> 0
    assert think360_width(tree) == 0.0 and think360_depth(tree) == 0.0
    with pytest.raises(ValueError, match="expected 'reasoning_steps'"):
        from_annotation_tree({"question": "q"})
    obj["nodes"][2]["steps"] = "1+1=3."  # would join one character a line
    with pytest.raises(ValueError, match="trees.jsonl:4: node 2: steps: must be a list of step texts"):
        from_annotation_tree(obj, source="trees.jsonl:4")


# ---------------------------------------------------------------- scorers


class FakePRM:
    """Step score = 0.9 for 'good' steps, 0.1 otherwise, halved after any earlier bad step."""

    def __init__(self):
        self.calls = []

    def score(self, examples):
        self.calls.append(examples)
        out = []
        for ex in examples:
            scores, bad = [], False
            for s in ex["steps"]:
                v = 0.9 if "good" in s else 0.1
                scores.append(v / 2 if bad else v)
                bad = bad or "good" not in s
            out.append(scores)
        return out


def test_prm_scores_one_call_one_path_per_leaf():
    tree = from_think360_blocks(
        "[NODE:1.1]\n[PARENT:None]\n[ORIGINAL:good start]\n"
        "[NODE:2.1]\n[PARENT:1.1]\n[ORIGINAL:bad turn]\n"
        "[NODE:2.2]\n[PARENT:1.1]\n[ORIGINAL:good branch]\n"
        "[NODE:3.1]\n[PARENT:2.1]\n[ORIGINAL:good after bad]",
        question="Q?",
    )
    prm = FakePRM()
    scores = prm_scores(tree, prm)
    assert len(prm.calls) == 1
    assert sorted(tuple(ex["steps"]) for ex in prm.calls[0]) == [
        ("good start", "bad turn", "good after bad"),
        ("good start", "good branch"),
    ]
    assert all(ex["question"] == "Q?" for ex in prm.calls[0])
    assert scores == {"1.1": 0.9, "2.1": 0.1, "2.2": 0.9, "3.1": 0.45}


def test_prm_scores_rpts_tree_paths_and_truncation():
    tree = small_rpts_tree(0, 0, 0)
    assert node_paths(tree) == {"C0": ["C0"], "C1": ["C1"], "C2": ["C0", "C1", "C2"]}
    kept, where = covering_paths(node_paths(tree))
    assert kept == [["C0", "C1", "C2"], ["C1"]] and where["C0"] == (0, 0) and where["C1"] == (1, 0)

    class Truncating(FakePRM):
        def score(self, examples):
            return [[0.5] + [math.nan] * (len(ex["steps"]) - 1) for ex in examples]

    with pytest.raises(ValueError, match="truncated"):
        prm_scores(tree, Truncating())


def test_parse_verdict():
    assert parse_verdict("Yes.", "binary") == 1.0 and parse_verdict(" False", "binary") == 0.0
    assert parse_verdict("maybe", "binary") is None
    assert parse_verdict("Score: 0.7", "graded") == 0.7 and parse_verdict("1.0", "graded") == 1.0
    assert parse_verdict("0", "graded") == 0.0 and parse_verdict("7 out of 10", "graded") is None
    assert parse_verdict("<think>Is it 0.2 or 1? Step 1 looks fine.</think>\n0.8", "graded") == 0.8
    assert parse_verdict("<think>no wait, yes</think> True", "binary") == 1.0
    assert parse_verdict("<think>cut off before the end", "graded") is None


def test_judge_scorer_against_local_server(monkeypatch):
    from chat_server import ChatServer, free_port_url

    from mmprm.chat import ChatClient, ChatConfig, EndpointUnavailable

    def script(body):
        prompt = body["messages"][-1]["content"]
        step = prompt.split("Step to check:")[1]
        if "mumble" in step:
            return "Let me think about it."
        return ("yes" if "fine" in step else "no") if "yes or no" in prompt else "0.7"

    with ChatServer(script) as server:
        monkeypatch.setenv("TEST_JUDGE_KEY", "sk-test")
        client = ChatClient(
            ChatConfig(url=server.url, model="judge-x", api_key_env="TEST_JUDGE_KEY", backoff_s=0),
            config_key="scorer.judge",
        )
        tree = from_steps(["fine start", "broken middle", "fine end"], question="What is 2+2?")
        judged = JudgeScorer(client).judge(tree, reference="4")
        assert judged.scores == {"S0": 1.0, "S1": 0.0, "S2": 1.0} and judged.unparsed == []
        assert server.headers[-1]["authorization"] == "Bearer sk-test" and server.requests[-1]["model"] == "judge-x"
        prompt = server.prompts()[-1]
        assert "What is 2+2?" in prompt and "Reference answer: 4" in prompt
        assert "1. fine start\n2. broken middle" in prompt  # the ancestors, in order
        assert "This is the final step" in prompt and "This is the final step" not in server.prompts()[0]
        assert JudgeScorer(client, mode="graded").judge(tree).scores == {"S0": 0.7, "S1": 0.7, "S2": 0.7}
        # a node whose replies never hold a verdict is asked 3 times, then reported, not guessed
        n = len(server.requests)
        judged = JudgeScorer(client).judge(from_steps(["fine a", "mumble b"]))
        assert judged.scores == {"S0": 1.0} and judged.unparsed == ["S1"] and len(server.requests) == n + 1 + 3
    dead = ChatClient(ChatConfig(url=free_port_url(), model="m", timeout_s=1, max_retries=0), config_key="scorer.judge")
    with pytest.raises(EndpointUnavailable, match="scorer.judge.url"):
        JudgeScorer(dead).judge(from_steps(["x"]))


def test_set_scores_and_json_round_trip():
    tree = small_rpts_tree(1.0, 0.5, 0.0)
    with pytest.raises(ValueError, match="unknown node"):
        set_scores(tree, {"C9": 0.5})
    with pytest.raises(ValueError, match="outside"):
        set_scores(tree, {"C0": 1.5})
    again = Tree.from_json(json.loads(json.dumps(tree.to_json())))
    assert rpts(again) == rpts(tree) and again.heights() == tree.heights()


def test_render_tree_png(tmp_path):
    tree = small_rpts_tree(0.9, 0.3, 0.6)
    out = render_tree(tree, tmp_path / "t.png", title="small")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


# ---------------------------------------------------------------- the real PRM (slow)


@pytest.mark.slow
def test_prm_scores_with_real_tiny_prm(tmp_path):
    pytest.importorskip("mmprm.models.prm")
    from mmprm import load_prm
    from mmprm.models.loading import load_backbone
    from mmprm.models.prm import PRMSpec, build_prm, save_prm
    from mmprm.models.tiny import build_tiny_model

    backbone, processor = load_backbone(build_tiny_model("qwen2", tmp_path / "backbone"))
    save_prm(build_prm(backbone, processor, PRMSpec()), processor, tmp_path / "prm")
    scorer = load_prm(tmp_path / "prm")
    tree = from_rpts_record(record(258))
    tree.images = []  # the tiny qwen2 is text-only
    scores = prm_scores(tree, scorer)
    assert set(scores) == {"C0", "C1", "C2", "C3"} and all(0.0 < s < 1.0 for s in scores.values())
    # each node's score equals scoring its own ancestor path on its own
    for nid, path in node_paths(tree).items():
        alone = scorer.score([{"question": tree.question, "images": [], "steps": [tree.nodes[p].text for p in path]}])[
            0
        ][-1]
        assert scores[nid] == pytest.approx(alone, abs=1e-4)
    set_scores(tree, scores)
    assert 0.0 < rpts(tree) < 1.0
