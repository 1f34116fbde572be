"""MathVista and MathVerse read and scored as their official code does, on their released rows.

The references below re-express, independently of mmprm, what each benchmark's own evaluation code
computes:

* MathVista: github:lupantech/MathVista@53d525874bdde205128e6b160b7357a88277d479:
  evaluation/calculate_score.py `normalize_extracted_answer` (run with its default
  `ignore_empty_extractions=False`) and `safe_equal`; the prompt fed to a model is the row's
  `query`, shipped as data/query.json beside data/testmini.json.
* MathVerse: github:ZrrSkywalker/MathVerse@937b090597aeafb8e82b35d310a4bc5b9e2ea29d:
  evaluation/prompts.py `demo_prompt_score`, whose five examples carry the judge's verdicts, and
  data/testmini_text_only.json, whose questions list options inline ("A. ... B. ...") or after
  "Choices:".
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from real_data import SHARED_DATA

from mmprm.data.eval_sets import answer_correct, read_mathverse, read_mathvista
from mmprm.data.eval_sets.mathverse import mathverse_choices
from mmprm.data.eval_sets.mathvista import edit_distance, mathvista_prediction

FIX = Path(__file__).parent / "fixtures" / "eval_sets"


# ---- the official procedures (no mmprm code in them)


def calculate_score_normalize(extraction, choices, question_type, answer_type, precision):
    """MathVista's normalize_extracted_answer (calculate_score.py, ignore_empty_extractions=False)."""
    if question_type == "multi_choice":
        extraction = extraction.strip() if isinstance(extraction, str) else str(extraction)
        letter = re.findall(r"\(([a-zA-Z])\)", extraction)
        if len(letter) > 0:
            extraction = letter[0].upper()
        letters = [chr(ord("A") + i) for i in range(len(choices))]
        if extraction in letters:
            return choices[letters.index(extraction)]
        distances = [edit_distance(extraction, c) for c in choices]  # Levenshtein.distance
        return choices[distances.index(min(distances))]
    try:
        if answer_type == "integer":
            return str(int(float(extraction)))
        if answer_type == "float":
            return str(round(float(extraction), int(precision)))
        return str(extraction)
    except Exception:
        return None


# ---- MathVista


def test_mathvista_query_is_read_beside_the_data_not_the_images(tmp_path):
    """MathVista's `query` (with the hint line MM-PRM feeds) comes from data/query.json beside the
    rows, also when the images were unzipped somewhere else (`image_root`)."""
    queries = json.loads((FIX / "mathvista" / "query.json").read_text(encoding="utf-8"))
    images = tmp_path / "elsewhere"
    shutil.copytree(FIX / "mathvista" / "images", images / "images")
    rows = read_mathvista(FIX / "mathvista", image_root=images)
    assert [r["question"] for r in rows] == [queries[r["id"]] for r in rows]
    assert all(r["question"].startswith("Hint: ") for r in rows)
    assert all(Path(r["images"][0]).parent == images / "images" for r in rows)


def test_mathvista_normalisation_is_calculate_scores():
    """Our normalisation and verdict equal calculate_score.py's on every shipped row, for the released
    Bard extractions and for the cases the official code settles its own way: a letter in brackets
    only when it is an ASCII letter, an empty extraction mapped to the nearest choice, a float
    answer without a precision never scored."""
    rows = json.loads((FIX / "mathvista" / "testmini.json").read_text(encoding="utf-8"))
    bard = json.loads((FIX / "mathvista" / "results" / "bard" / "output_bard.json").read_text(encoding="utf-8"))
    problems = {r["id"]: r for r in read_mathvista(FIX / "mathvista")}
    extra = ["", "(é) 145°", "(Б)", "(b)", "(B) 140°", "(α) 12cm", "1.24", "7.0", "abc", "[2014, 2016]"]
    cases = 0
    for pid, r in rows.items():
        for ext in [bard[pid]["extraction"], *extra]:
            args = (ext, r["choices"], r["question_type"], r["answer_type"], r["precision"])
            want = calculate_score_normalize(*args)
            assert mathvista_prediction(*args) == want, (pid, ext)
            assert answer_correct(ext or None, problems[pid]) is (want == r["answer"]), (pid, ext)
            cases += 1
    assert cases == 15 * 11
    # the three cases named above, on real rows: 3 (145°), 5 (97, the shortest choice), 1 (precision 1)
    assert mathvista_prediction("(é) 145°", rows["3"]["choices"], "multi_choice", "text", None) == "145°"
    assert answer_correct(None, problems["5"]) and answer_correct("", problems["6"])
    assert not answer_correct(None, problems["334"])  # "" is nearer "No" than "Yes"
    assert mathvista_prediction("1.24", None, "free_form", "float", None) is None
    no_precision = {**problems["1"], "meta": {**problems["1"]["meta"], "precision": None}}
    assert not answer_correct("1.2", no_precision)


# ---- MathVerse

# evaluation/prompts.py `demo_prompt_score`: its five examples as (question, standard answer, model
# answer, judgement), with the `{{ }}` of the format string as the judge reads them.
JUDGE_EXAMPLES = [
    (
        "Write the set of numbers represented on the number line in interval notation.",
        "(-2,1]",
        "Extracted Answer: \\((-2, 1)\\)",
        0,
    ),
    (
        "As shown in the figure, circle O has a radius 1.0, if angle BAC = 60.0, then the length of BC is ()\n"
        "Choices:\nA:2\nB:2\u221a{3}\nC:\u221a{3}\nD:2\u221a{2}",
        "C",
        "B:2\u221a{3}",
        0,
    ),
    (
        "Find the domain and range of the function f using interval notation.",
        "domain: [-4, 0) and range: (-3, 1]",
        "Range: \\((-4, 1]\\)",
        0,
    ),
    (
        "As shown in the figure, circle O has a radius 1.0, if angle BAC = 60.0, then the length of BC is ()\n"
        "Choices:\nA:2\nB:2\u221a{3}\nC:\u221a{3}\nD:2\u221a{2}",
        "C",
        "null",
        0,
    ),
    (
        "Given the graph of the ellipse that intersects with x-axis at 9 and -9 and with y-axis at 3 and -3, "
        "determine its equation.A. \\frac{x^2}{81} + \\frac{y^2}{9} = 1 B. Can not determine.\n",
        "A",
        "\\frac{x^2}{81} + \\frac{y^2}{9} = 1",
        1,
    ),
]


def _mathverse_problem(question: str, answer: str) -> dict:
    mc = re.fullmatch(r"[A-H]", answer) is not None
    return {
        "question": question,
        "answer": answer,
        "choices": mathverse_choices(question) if mc else None,
        "meta": {"source": "mathverse", "question_type": "multi-choice" if mc else "free-form"},
    }


def test_mathverse_rule_agrees_with_its_judge_examples():
    """All five examples of MathVerse's score prompt get the judge's verdict: a partial answer to a
    domain-and-range question is refused, an option given by its text (inline options) is right."""
    got = [int(answer_correct(m, _mathverse_problem(q, a))) for q, a, m, _ in JUDGE_EXAMPLES]
    assert got == [j for *_, j in JUDGE_EXAMPLES]
    # the domain-and-range answer needs both parts, each with its own value
    problem = _mathverse_problem(*JUDGE_EXAMPLES[2][:2])
    assert answer_correct("Domain: \\([-4, 0)\\)\nRange: \\((-3, 1]\\)", problem)
    assert answer_correct("range: (-3,1], domain: [-4,0)", problem)
    assert not answer_correct("Domain: \\((-3, 3]\\)\nRange: \\((-4, 1]\\)", problem)
    assert not answer_correct("(-3, 1]", problem)


def test_mathverse_options_inline_and_listed():
    """Options after "Choices:" / "Choice:" lines (an empty one keeps its place), or inline."""
    inline = JUDGE_EXAMPLES[4][0]
    assert mathverse_choices(inline) == ["\\frac{x^2}{81} + \\frac{y^2}{9} = 1", "Can not determine."]
    assert mathverse_choices("Which one? (A) 3 (B) 4 (C) 5") == ["3", "4", "5"]
    assert mathverse_choices(JUDGE_EXAMPLES[1][0]) == ["2", "2\u221a{3}", "\u221a{3}", "2\u221a{2}"]
    assert mathverse_choices("Q\nChoice:\nA. True\nB. False") == ["True", "False"]
    assert mathverse_choices("Q\nChoices:\nA:x\nB:\nC:y") == ["x", "", "y"]
    assert mathverse_choices("Find AB. Point A lies on the circle.") is None


def test_mathverse_text_only_full_set():
    """Every row of the Text Only testmini (788, ../shared/data/mathverse; the shipped 5 otherwise) reads,
    every multiple-choice row has its options, and each gold answer scores as right against itself
    and its option text, and a different option as wrong."""
    source = SHARED_DATA / "mathverse" if (SHARED_DATA / "mathverse").is_dir() else FIX / "mathverse"
    rows = read_mathverse(source, split="testmini_text_only")
    raw = json.loads((source / "testmini_text_only.json").read_text(encoding="utf-8"))
    assert len(rows) == len(raw) and (len(rows) == 788 or source == FIX / "mathverse")
    for r in rows:
        assert answer_correct(r["answer"], r), r["id"]
        if r["meta"]["question_type"] != "multi-choice":
            continue
        assert r["choices"] and len(r["choices"]) >= 2, r["id"]
        letters = re.fullmatch(r"\(?([A-H])\)?", r["answer"])
        if letters:  # a single gold letter: its option's text is right, another letter wrong
            idx = ord(letters.group(1)) - 65
            if r["choices"][idx] and r["choices"].count(r["choices"][idx]) == 1:
                assert answer_correct(r["choices"][idx], r), r["id"]
            assert not answer_correct(chr(65 + (idx + 1) % len(r["choices"])), r), r["id"]
        elif r["answer"] in r["choices"]:  # the gold is an option's text ("False"): its letter is right
            assert answer_correct(chr(65 + r["choices"].index(r["answer"])), r), r["id"]
        else:  # several gold letters ("C\nD"): all of them, in any layout, and not one alone
            gold = r["answer"].split()
            assert answer_correct(", ".join(gold), r) and not answer_correct(gold[0], r), r["id"]
