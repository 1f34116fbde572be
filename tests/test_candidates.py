"""Best-of-N candidates: converters on the real public data, the JSONL loader and its errors."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image
from real_data import DATA, full_or_subset

from mmprm.data.schema import DataError
from mmprm.rerank.candidates import (
    Candidate,
    ProblemWithCandidates,
    candidate_steps,
    cli_convert_candidates,
    count_label_disagreements,
    from_gsm8k_solutions,
    from_mathv,
    from_qwen_math_bon,
    from_text_solutions,
    load_candidates,
    write_candidates,
)
from mmprm.steps import render_solution


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------ steps of one candidate


def test_candidate_steps_tags_attach_answer():
    text = render_solution(["2 + 3 = 5.", "5 * 2 = 10."], "10")
    assert candidate_steps(text) == ["2 + 3 = 5.", "5 * 2 = 10.\n<answer>10</answer>"]


def test_candidate_steps_gsm8k_final_line_becomes_answer():
    text = "He has 3 + 4 = <<3+4=7>>7 apples.\nHe eats 2, so 7 - 2 = <<7-2=5>>5 are left.\nA: 5"
    assert candidate_steps(text) == [
        "He has 3 + 4 = 7 apples.",
        "He eats 2, so 7 - 2 = 5 are left.\n<answer>5</answer>",
    ]


def test_candidate_steps_blank_lines_keep_boxed_answer_in_text():
    text = "First, 2 + 2 = 4.\n\nSo the answer is $\\boxed{4}$."
    assert candidate_steps(text) == ["First, 2 + 2 = 4.", "So the answer is $\\boxed{4}$."]
    assert candidate_steps("") == []


# ------------------------------------------------------------------ converters on real data


def test_from_mathv(tmp_path):
    problems = from_mathv(DATA / "mathv")
    n = full_or_subset(full=304, subset=37)
    assert len(problems) == n and all(len(p.candidates) == 3 for p in problems)
    assert all(Path(p.images[0]).is_absolute() and Path(p.images[0]).exists() for p in problems)
    # MATH-V's own counts (data README): 44 + 42 + 45 correct; in the repo subset 8 + 6 + 7
    per_model = Counter(c.meta["model"] for p in problems for c in p.candidates if c.correct)
    assert per_model == full_or_subset(
        full={"gemini-pro-vision": 44, "qwen-vl-max": 42, "InternLM-XComposer2-VL": 45},
        subset={"gemini-pro-vision": 8, "qwen-vl-max": 6, "InternLM-XComposer2-VL": 7},
    )
    # our verifier disagrees on 19 (subset: 4), all of them a model naming the right option by its value
    disagree = full_or_subset(full=19, subset=4)
    assert count_label_disagreements(problems) == disagree
    by_verifier = from_mathv(DATA / "mathv", label="verifier")
    assert sum(c.correct for p in by_verifier for c in p.candidates) == sum(per_model.values()) + disagree
    p = next(p for p in problems if p.id == "mathv-1546")
    assert p.choices[3] == "$40^{\\circ}$" and "Choices: (A) $25^{\\circ}$" in p.question
    qwen = next(c for c in p.candidates if c.meta["model"] == "qwen-vl-max")
    assert qwen.answer == "40^\\circ" and qwen.meta == {
        "model": "qwen-vl-max",
        "source_answer": "40",
        "flag_correct": False,
        "verifier_correct": True,
    }
    assert all(c.steps for p in problems for c in p.candidates)
    # round trip through the file format, images checked on load
    out = tmp_path / "mathv.jsonl"
    assert write_candidates(out, problems) == n
    loaded = load_candidates(out)
    assert [x.to_json() for x in loaded] == [x.to_json() for x in problems]


def test_from_gsm8k_solutions():
    problems = from_gsm8k_solutions(DATA / "gsm8k" / "example_model_solutions.jsonl")
    assert len(problems) == full_or_subset(full=1319, subset=40) and all(len(p.candidates) == 4 for p in problems)
    per_model = Counter(c.meta["model"] for p in problems for c in p.candidates if c.correct)
    assert per_model == full_or_subset(
        full={"6b_finetuning": 286, "6b_verification": 515, "175b_finetuning": 458, "175b_verification": 742},
        subset={"6b_finetuning": 6, "6b_verification": 11, "175b_finetuning": 11, "175b_verification": 22},
    )
    assert count_label_disagreements(problems) == 0
    first = problems[0]
    assert first.id == "gsm8k-0" and first.answer == "18"
    assert first.candidates[3].steps[-1].endswith("<answer>18</answer>")
    assert not any("<<" in s for p in problems for c in p.candidates for s in c.steps)


def test_converters_refuse_text_flags_and_missing_fields(tmp_path):
    """A flag written as text ("false") would read as correct through bool(); it and a missing
    field are named by file, line, id and field instead."""
    lines = (DATA / "gsm8k" / "example_model_solutions.jsonl").read_text().splitlines()[:2]
    row = json.loads(lines[1])
    row["6b_finetuning"]["is_correct"] = "false"
    del row["175b_verification"]["solution"]
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text(lines[0] + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError) as e:
        from_gsm8k_solutions(gsm)
    assert e.value.problems == [
        f"{gsm}:2: id=gsm8k-1: 6b_finetuning.is_correct: 'false' is not true or false",
        f"{gsm}:2: id=gsm8k-1: 175b_verification.solution: missing (the model's solution text)",
    ]
    row = json.loads((DATA / "qwen_math_bon" / "math_cot_100.jsonl").read_text().splitlines()[0])
    row["score"][2] = "False"
    del row["gt"]
    qwen = tmp_path / "qwen.jsonl"
    qwen.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError) as e:
        from_qwen_math_bon(qwen)
    rid = row["idx"]
    assert e.value.problems == [
        f"{qwen}:1: id={rid}: gt: missing",
        f"{qwen}:1: id={rid}: score[2]: 'False' is not true or false",
    ]


def test_from_qwen_math_bon():
    problems = from_qwen_math_bon(DATA / "qwen_math_bon" / "math_cot_100.jsonl")
    # the repo subset keeps the 14 problems with a wrong response (the other 86 are all correct)
    n = full_or_subset(full=100, subset=14)
    assert len(problems) == n and all(len(p.candidates) == 8 for p in problems)
    assert sum(c.correct for p in problems for c in p.candidates) == full_or_subset(full=728, subset=728 - 86 * 8)
    assert problems[0].candidates[0].meta["rm_score"] == pytest.approx(full_or_subset(full=3.546875, subset=0.62109375))
    # the one disagreement: gold "10{,}000" graded unequal to "10000" by the file
    bad = [
        (p.id, k)
        for p in problems
        for k, c in enumerate(p.candidates)
        if c.meta["flag_correct"] != c.meta["verifier_correct"]
    ]
    assert bad == [("qwen-math-72", 7)]
    # upstream reference: RM best-of-8 (argmax pred_score, first on ties) solves 94 of 100
    best = [max(range(8), key=lambda k: (p.candidates[k].meta["rm_score"], -k)) for p in problems]
    assert sum(p.candidates[k].correct for p, k in zip(problems, best)) == full_or_subset(full=94, subset=94 - 86)


def test_cli_convert_candidates(tmp_path, capsys):
    out = tmp_path / "gsm8k.jsonl"
    rc = cli_convert_candidates(
        [
            "--from",
            "gsm8k",
            "--input",
            str(DATA / "gsm8k" / "example_model_solutions.jsonl"),
            "--out",
            str(out),
            "--label",
            "verifier",
        ]
    )
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    n = full_or_subset(full=1319, subset=40)
    assert summary["problems"] == n and summary["candidates"] == 4 * n
    assert summary["correct"] == full_or_subset(full=286 + 515 + 458 + 742, subset=6 + 11 + 11 + 22)
    assert len(load_candidates(out)) == n
    rc = cli_convert_candidates(["--from", "qwen_math", "--input", str(tmp_path / "nope.jsonl"), "--out", str(out)])
    assert rc == 2


# ------------------------------------------------------------------ generic text solutions


def test_from_text_solutions(tmp_path):
    path = _write(
        tmp_path / "sols.jsonl",
        [
            {
                "id": "p1",
                "question": "What is 2 + 3?",
                "answer": "5",
                "solutions": [
                    render_solution(["2 + 3 = 5."], "5"),
                    "Add them.\n\n2 + 3 = 6, so the answer is \\boxed{6}.",
                    "I don't know.",
                ],
            },
            {
                "id": "p2",
                "question": "Pick one.",
                "answer": "B",
                "choices": ["7", "8"],
                "solutions": ["The value is 8, so the correct option is (B)."],
            },
        ],
    )
    p1, p2 = from_text_solutions(path)
    assert [c.correct for c in p1.candidates] == [True, False, False]
    assert [c.answer for c in p1.candidates] == ["5", "6", None]
    assert p1.candidates[1].steps == ["Add them.", "2 + 3 = 6, so the answer is \\boxed{6}."]
    assert p2.candidates[0].answer == "(B)" and p2.candidates[0].correct is True
    bad = _write(tmp_path / "bad.jsonl", [{"id": "p3", "question": "Q", "answer": "1", "solutions": []}])
    with pytest.raises(DataError) as e:
        from_text_solutions(bad)
    assert e.value.problems == [f"{bad}:1: id=p3: solutions: must be a non-empty list of solution strings"]


# ------------------------------------------------------------------ loader: fill-in and errors


def test_load_candidates_fills_in_and_keeps_extra_keys(tmp_path):
    Image.new("RGB", (2, 2)).save(tmp_path / "img.png")  # the loader opens every image
    path = _write(
        tmp_path / "c.jsonl",
        [
            {
                "id": 7,
                "images": ["img.png"],
                "question": "<image> How many?",
                "answer": "3",
                "candidates": [
                    {"text": "I count 3.\n\nThe answer is 3."},
                    {"steps": ["Count: 4."], "answer": "4", "step_probs": [0.2]},
                    {"text": "Hmm", "answer": None},
                ],
            }
        ],
    )
    (p,) = load_candidates(path)
    assert p.id == "7" and p.images == [str((tmp_path / "img.png").resolve())]
    a, b, c = p.candidates
    assert (a.steps, a.answer, a.correct) == (["I count 3.", "The answer is 3."], "3", True)
    assert (b.text, b.correct, b.extra) == (None, False, {"step_probs": [0.2]})
    assert (c.answer, c.correct) == (None, False)  # an explicit null answer is not re-extracted
    assert b.to_json() == {"steps": ["Count: 4."], "answer": "4", "correct": False, "step_probs": [0.2]}
    assert p.prm_inputs()[1] == {"question": "<image> How many?", "steps": ["Count: 4."], "images": p.images}


def test_load_candidates_reports_every_problem(tmp_path):
    path = _write(
        tmp_path / "bad.jsonl",
        [
            {"id": "a", "question": "Q", "answer": "1", "candidates": [{"text": "1"}]},
            '{"id": "b", "question": ',
            {"id": "a", "question": "Q", "answer": "1", "candidates": [{"text": "1"}]},
            {"id": "c", "question": "", "answer": "1", "candidates": []},
            {
                "id": "d",
                "question": "Q",
                "images": ["missing.png"],
                "answer": "1",
                "candidates": [{"answer": "1"}, {"text": "1", "correct": "yes"}, "nope"],
            },
            {
                "id": "e",
                "question": "Q <image1> <image2>",
                "images": [],
                "answer": "1",
                "choices": "AB",
                "candidates": [{"steps": ["ok", ""]}],
            },
        ],
    )
    with pytest.raises(DataError) as e:
        load_candidates(path)
    p = f"{path}:"
    assert e.value.problems[0].startswith(f"{p}2: id=?: line: invalid JSON: ")
    assert e.value.problems[1:] == [
        f"{p}3: id=a: id: duplicated (first on line 1; make ids unique)",
        f"{p}4: id=c: question: missing or empty (add the problem text)",
        f'{p}4: id=c: candidates: missing or empty (a list of {{"text"|"steps", ...}} objects)',
        f"{p}5: id=d: images[0]: image not found: {tmp_path / 'missing.png'} (paths are relative to the JSONL file's folder)",
        f"{p}5: id=d: candidates[0]: has neither 'text' nor 'steps' (give the solution text, its steps, or both)",
        f"{p}5: id=d: candidates[1].correct: 'yes' is not true/false/null",
        f'{p}5: id=d: candidates[2]: must be an object like {{"text": ...}} or {{"steps": [...]}}',
        f"{p}6: id=e: images: question has 2 image placeholder(s) but 0 image(s) are listed (list one image per placeholder, or remove the placeholders)",
        f"{p}6: id=e: choices: must be a list of option texts in letter order, or omitted",
        f"{p}6: id=e: candidates[0].steps: must be a list of non-empty strings",
    ]


def test_dataclass_json_round_trip():
    p = ProblemWithCandidates(id="x", question="Q", answer=None, candidates=[Candidate(text="t", steps=["t"])])
    assert p.to_json() == {
        "id": "x",
        "images": [],
        "question": "Q",
        "answer": None,
        "candidates": [{"text": "t", "steps": ["t"], "answer": None, "correct": None}],
    }
