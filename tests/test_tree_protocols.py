"""The RPTS judge protocol and the Think360 extraction, with a scripted judge on 127.0.0.1 and
hand-computed scores, widths and depths."""

from __future__ import annotations

import pytest
from chat_server import ChatServer

from mmprm.chat import ChatClient, ChatConfig
from mmprm.treeval import (
    JudgeScorer,
    RPTSJudge,
    RPTSJudgeConfig,
    corrected_score,
    extract_think360,
    from_rpts_lines,
    from_think360_blocks,
    image_facts,
    rpts,
    rpts_answer_prompt,
    rpts_lines,
    rpts_verdict,
    set_scores,
    think360_depth,
    think360_valid,
    think360_width,
)

pytest.importorskip("openai")

RECORD = {
    "id": 7,
    "context": "Tom is at a fruit stall.",
    "statement": "Tom can pay for his apples.",
    "answer": "agree",
    "textual_clue": ["An apple costs 2 dollars.", "Tom has 10 dollars.", "There is no tax."],
    "visual_clue": ["7_0.png", "7_1.png"],
    "reasoning": [
        "Image0 -> Tom holds three red apples.",
        "Image0 + Text0 -> Three apples cost 6 dollars.",
        "Conclusion1 + Text1 -> Tom can pay.",
    ],
}

# The model under test: an image step with references, an image step without any, an image index
# past the record's two images, a sound inference, a weak one (rescued by the correction pass), and
# a weak one the correction pass cannot rescue.
ANSWER = """Here is my reasoning.
```
Image0 -> Conclusion0: Tom holds three red apples.
Image1 -> Conclusion1: There is a price board.
Image5 -> Conclusion2: A dog sits nearby.
Text0 + Conclusion0 -> Conclusion3: The apples cost 6 dollars.
Text2 -> Conclusion4: Tom can afford the apples.
Conclusion4 + Conclusion3 -> Conclusion5: So the clues agree with the statement.
```"""


def rpts_script(body):
    prompt = body["messages"][-1]["content"]
    if "Reference descriptions:" in prompt:
        return "0.9" if "Tom holds three red apples." in prompt.split("Sentence:")[1] else "0.1"
    premises, conclusion = prompt.split("Premises:")[1].split("Conclusion:")
    if "apples cost 6" in conclusion:
        return "Score: 1.0"
    if "can afford" in conclusion:  # the cited premise (no tax) does not support it; Tom's money does
        return "0.9" if "Tom has 10 dollars." in premises else "0.3"
    if "mumble" in conclusion:
        return "hard to say"
    return "0.4"


def judge_client(server, tmp_path=None):
    return ChatClient(
        ChatConfig(url=server.url, model="judge", backoff_s=0),
        config_key="scorer.judge",
        cache_path=None if tmp_path is None else tmp_path / "cache.jsonl",
    )


def test_corrected_score_by_hand():
    assert corrected_score(0.3, 0.9) == 0.7  # round(0.72, 1)
    assert corrected_score(0.4, 0.4) == 0.4  # round(0.32, 1) = 0.3 < 0.4
    assert corrected_score(0.0, 1.0, penalty=0.5) == 0.5 and corrected_score(0.2, 0.0) == 0.2


def test_image_facts_are_the_gold_conclusions_citing_the_image():
    assert image_facts(RECORD["reasoning"], 2) == [["Tom holds three red apples.", "Three apples cost 6 dollars."], []]
    assert image_facts(["图片0 -> 结论0: 一只猫。"], 1) == [["一只猫。"]]


def test_rpts_answer_parsing():
    lines = rpts_lines(ANSWER)
    assert len(lines) == 6 and lines[0] == "Image0 -> Conclusion0: Tom holds three red apples."
    assert rpts_lines("1. Text0 -> Conclusion0: a\ncontinued here\n- Conclusion0 → Conclusion1: b") == [
        "Text0 -> Conclusion0: a continued here",
        "Conclusion0 -> Conclusion1: b",
    ]
    assert rpts_lines("I think the statement is true.") == []
    assert rpts_verdict(ANSWER) == "agree"
    assert rpts_verdict("Text0 -> Conclusion0: The clues disagree with the statement.") == "disagree"
    assert rpts_verdict("Some words.\nFinal: it supports the claim") == "agree" and rpts_verdict("no idea") is None
    prompt = rpts_answer_prompt(RECORD)
    assert "Text1: Tom has 10 dollars." in prompt and "Image0, Image1" in prompt and "Statement: Tom can pay" in prompt


def test_rpts_judge_with_correction_pass_by_hand(tmp_path):
    tree = from_rpts_lines(rpts_lines(ANSWER), RECORD["textual_clue"], 2, context=RECORD["context"])
    assert any("Image5" in w for w in tree.warnings)
    with ChatServer(rpts_script) as server:
        judged = RPTSJudge(judge_client(server, tmp_path)).judge(tree, RECORD)
        assert judged.scores == {"C0": 0.9, "C1": 1.0, "C2": 0.0, "C3": 1.0, "C4": 0.7, "C5": 0.4}
        assert judged.unparsed == [] and judged.corrected == ["C4", "C5"]
        # C1 (no reference description) and C2 (no such image) cost no call; C4 and C5 cost two each
        assert len(server.requests) == 6
        prompts = server.prompts()
        assert "Tom holds three red apples.; Three apples cost 6 dollars." in prompts[0]  # all facts joined
        wide = prompts[3]  # C4's second look: its premise, every text clue, every earlier conclusion
        assert all(c in wide for c in RECORD["textual_clue"]) and "A dog sits nearby." in wide
        assert "Tom has 10 dollars." not in prompts[2]
        assert [d["kind"] for d in judged.details] == ["image"] * 3 + ["inference"] * 3
        assert judged.details[4] == {"node": "C4", "kind": "inference", "first": 0.3, "second": 0.9, "score": 0.7}

        # RPTS under C5 reaches C5 (h 3), C4 (h 1), C3 (h 2), C0 (h 1); lam 0.9, h_f 1:
        # weights 0.81, 1, 0.9, 1 -> (0.81*0.4 + 0.7 + 0.9*1.0 + 0.9) / 3.71 = 2.824 / 3.71
        set_scores(tree, judged.scores)
        assert rpts(tree, lam=0.9, h_f=1) == pytest.approx(2.824 / 3.71)

        # the same with the correction pass off: C4 keeps 0.3 -> 2.424 / 3.71; no extra calls
        n = len(server.requests)
        plain = RPTSJudge(judge_client(server), RPTSJudgeConfig(correction=False)).judge(tree, RECORD)
        assert plain.scores["C4"] == 0.3 and plain.corrected == [] and len(server.requests) == n + 4
        set_scores(tree, plain.scores)
        assert rpts(tree, lam=0.9, h_f=1) == pytest.approx(2.424 / 3.71)

        # image comparison off: image steps are inferences from the image's reference descriptions
        no_img = RPTSJudge(judge_client(server), RPTSJudgeConfig(compare_images=False)).judge(tree, RECORD)
        assert [d["kind"] for d in no_img.details] == ["inference"] * 6
        # a penalty of 0.5: C4 -> max(0.3, round(0.45, 1)) = max(0.3, 0.5) = 0.5
        assert (
            RPTSJudge(judge_client(server, tmp_path), RPTSJudgeConfig(penalty=0.5)).judge(tree, RECORD).scores["C4"]
            == 0.5
        )


def test_rpts_judge_reports_unreadable_replies():
    tree = from_rpts_lines(
        ["Text0 -> Conclusion0: mumble", "Text1 -> Conclusion1: Tom can afford the apples."], RECORD["textual_clue"], 2
    )
    with ChatServer(rpts_script) as server:
        judged = RPTSJudge(judge_client(server)).judge(tree, RECORD)
        assert judged.unparsed == ["C0"] and judged.scores == {"C1": 0.9}
        assert len(server.requests) == 3 + 1  # three asks for the unreadable one

        def second_look_mumbles(body):
            return "0.2" if "Tom has 10 dollars." not in body["messages"][-1]["content"] else "no comment"

        server.script = second_look_mumbles
        judged = RPTSJudge(judge_client(server)).judge(tree, RECORD)
        # C0 scores 0.2 first, then its second look is unreadable: unscored, not silently uncorrected
        assert judged.unparsed[0] == "C0" and judged.details[0]["first"] == 0.2 and judged.details[0]["second"] is None
        assert "C0" not in judged.scores


# ---------------------------------------------------------------- Think360

RESPONSE = """The figure shows a right triangle with legs 3 and 5. The hypotenuse is 5. If 4 were
the hypotenuse the third side would be sqrt(7). The perimeter is 3 + 4 + 5 = 12. Or 3 + 4 + 5 = 13.
So the answer is 12."""

GOOD_TREE = """[NODE:1.1]
[PARENT:None]
[ORIGINAL:The figure shows a right triangle with legs 3 and 5.]
[TYPE:observation]
[NODE:2.1]
[PARENT:1.1]
[ORIGINAL:The hypotenuse is 5.]
[TYPE:calculation]
[NODE:2.2]
[PARENT:1.1]
[ORIGINAL:If 4 were the hypotenuse the third side would be sqrt(7).]
[TYPE:exploration]
[NODE:3.1]
[PARENT:2.1]
[ORIGINAL:The perimeter is 3 + 4 + 5 = 12.]
[TYPE:calculation]
[NODE:3.2]
[PARENT:2.1]
[ORIGINAL:Or 3 + 4 + 5 = 13.]
[TYPE:calculation]
[NODE:4.1]
[PARENT:3.1]
[ORIGINAL:So the answer is 12.]
[TYPE:conclusion]"""

BAD_TREE = "[NODE:1.1]\n[PARENT:None]\n[ORIGINAL:The hypotenuse is 5.]\n[NODE:2.1]\n[PARENT:1.7]\n[ORIGINAL:So 12.]"


def think360_script(body):
    system = body["messages"][0]["content"]
    if system.startswith("You turn a worked solution"):  # the extractor
        return GOOD_TREE if body.get("seed") == 1 else BAD_TREE  # valid only on the first retry
    step = body["messages"][-1]["content"].split("Step to check:")[1]
    wrong = ("legs 3 and 5", "sqrt(7)", "= 13")  # the misread figure, the dead end, the slip
    return "False" if any(w in step for w in wrong) else "True"


def test_think360_extraction_and_judge_by_hand(tmp_path):
    with ChatServer(think360_script) as server:
        client = judge_client(server, tmp_path)
        ex = extract_think360(client, "Perimeter of the triangle?", RESPONSE, reference="12")
        assert ex.valid and ex.attempts == 2 and ex.tree.meta["structure_errors"] == []
        assert [b.get("seed") for b in server.requests] == [None, 1]
        assert "Reference answer: 12" in server.prompts()[0] and RESPONSE in server.prompts()[0]
        tree = ex.tree
        assert tree.depths() == {"1.1": 1, "2.1": 2, "2.2": 2, "3.1": 3, "3.2": 3, "4.1": 4}
        n = len(server.requests)
        judged = JudgeScorer(client).judge(tree, reference="12")
        # only the last step is held to the reference answer, not the dead end 2.2 or the slip 3.2
        noted = [p.split("Step to check:")[1][:30] for p in server.prompts()[n:] if "This is the final step" in p]
        assert noted == ["\nSo the answer is 12.\n(This is"]
        assert judged.scores == {"1.1": 0.0, "2.1": 1.0, "2.2": 0.0, "3.1": 1.0, "3.2": 0.0, "4.1": 1.0}
        set_scores(tree, judged.scores)
        # width: sibling groups {2.1 ok, 2.2 wrong} 1/2, {3.1 ok, 3.2 wrong} 1/2, {4.1 ok} 1 -> 2/3
        assert think360_width(tree) == pytest.approx(2 / 3)
        # depth: the deepest node 4.1, its path 1.1 (wrong), 2.1, 3.1, 4.1 -> 3/4
        assert think360_depth(tree) == pytest.approx(0.75)
        assert ex.tokens["completion"] > 0 and judged.tokens["prompt"] > 0

        server.script = lambda body: BAD_TREE  # never valid
        ex = extract_think360(judge_client(server), "Q", "another answer", retries=2)
        assert not ex.valid and ex.attempts == 3 and ex.reason == "node 2.1 has a parent that is not a node"
        server.script = lambda body: "I cannot do that."
        ex = extract_think360(judge_client(server), "Q", "a third answer", retries=0)
        assert not ex.valid and ex.reason == "no nodes" and ex.attempts == 1


def test_think360_validity_follows_the_reference():
    assert think360_valid(from_think360_blocks(GOOD_TREE)) == (True, "")
    dup = from_think360_blocks("[NODE:1.1][PARENT:None][ORIGINAL:a]\n[NODE:1.1][PARENT:None][ORIGINAL:b]")
    assert think360_valid(dup) == (False, "duplicate node id 1.1")
    assert think360_valid(from_think360_blocks("[NODE:step1][PARENT:None][ORIGINAL:a]"))[1] == (
        "node id 'step1' is not depth.sequence"
    )
    # a depth that disagrees with the parent chain is renumbered, as the reference's fix does: valid
    renumbered = from_think360_blocks("[NODE:1.1][PARENT:None][ORIGINAL:a]\n[NODE:3.1][PARENT:1.1][ORIGINAL:b]")
    assert think360_valid(renumbered) == (True, "") and renumbered.meta["depths_renumbered"] == 1
    assert renumbered.depths() == {"1.1": 1, "3.1": 2}
