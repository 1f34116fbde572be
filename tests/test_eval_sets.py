"""Answer-benchmark readers on shipped rows (tests/fixtures/eval_sets, README there), and each
benchmark's answer rule against the benchmark's own verdicts: MathVista's scored outputs (Bard's
`prediction` / `true_false`), OlympiadBench's judged examples and its judge's verdicts on real rows,
MathVerse's judge-prompt examples."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from real_data import REPO_DATA

from mmprm.cli import main
from mmprm.data.eval_sets import (
    accuracy_breakdown,
    answer_correct,
    read_mathverse,
    read_mathvision,
    read_mathvista,
    read_mmk12,
    read_olympiadbench,
)
from mmprm.data.eval_sets.mathvista import mathvista_prediction
from mmprm.data.eval_sets.olympiadbench import olympiad_equal, olympiad_precision
from mmprm.data.problems import load_problems

FIX = Path(__file__).parent / "fixtures" / "eval_sets"


def _by_id(rows):
    return {r["id"]: r for r in rows}


def test_mathvista_rows_and_its_own_scoring():
    rows = _by_id(read_mathvista(FIX / "mathvista"))
    assert len(rows) == 15 and all(Path(r["images"][0]).is_file() for r in rows.values())
    mc = rows["3"]
    assert mc["choices"] == ["135°", "140°", "145°", "150°"] and mc["answer"] == "145°"
    assert mc["question"].startswith("Hint: Please answer the question and provide the correct option letter")
    assert mc["meta"]["language"] == "chinese" and mc["meta"]["question_type"] == "multi_choice"
    assert rows["2"]["meta"]["unit"] == "g" and rows["1"]["meta"]["precision"] == 1
    # Bard's outputs as MathVista scored them: our normalisation gives its `prediction`, our rule its verdict.
    scored = json.loads((FIX / "mathvista" / "results" / "bard" / "output_bard.json").read_text(encoding="utf-8"))
    assert set(scored) == set(rows)
    for pid, s in scored.items():
        m = rows[pid]["meta"]
        pred = mathvista_prediction(s["extraction"], s["choices"], m["question_type"], m["answer_type"], m["precision"])
        assert pred == s["prediction"], pid
        assert answer_correct(s["extraction"], rows[pid]) is s["true_false"], pid
    assert [answer_correct(p, rows["3"]) for p in ("C", "(C) 145°", "145°", "B", "(B)")] == [1, 1, 1, 0, 0]
    assert answer_correct("92.5", rows["5"])  # nearest option by edit distance, as MathVista picks it
    assert (
        answer_correct("1000 g", rows["2"])
        and answer_correct("1,000", rows["2"])
        and not answer_correct("999", rows["2"])
    )
    assert answer_correct("1.24", rows["1"]) and not answer_correct("1.26", rows["1"])  # precision 1
    report = accuracy_breakdown([r["meta"] for r in rows.values()], [s["true_false"] for s in scored.values()])
    assert report["overall"]["total"] == 15 and report["by"]["question_type"]["multi_choice"]["total"] == 6


def test_mathverse_versions_and_its_rule():
    rows = read_mathverse(FIX / "mathverse" / "output_templates" / "output_testmini.json", image_root=FIX / "mathverse")
    versions = [r["meta"]["problem_version"] for r in rows]
    assert versions == ["Text Dominant", "Text Lite", "Vision Intensive", "Vision Dominant", "Vision Only"]
    assert {r["meta"]["problem_index"] for r in rows} == {"685"} and all(len(r["images"]) == 1 for r in rows)
    assert rows[0]["question"].startswith("Please first conduct reasoning")  # query_cot
    assert [answer_correct(p, rows[0]) for p in ("14", "14 cm", "14.32", None)] == [1, 1, 0, 0]
    report = accuracy_breakdown([r["meta"] for r in rows], [True, True, False, True, False])
    assert report["by"]["problem_version"]["Vision Only"] == {"correct": 0, "total": 1, "accuracy": 0.0}
    text_only = _by_id(read_mathverse(FIX / "mathverse", split="testmini_text_only"))
    q = text_only["2"]
    assert q["images"] == [] and q["choices"] == ["50°", "60°", "65°", "90°"] and q["answer"] == "C"
    assert [answer_correct(p, q) for p in ("C", "(C)", "C:65°", "65°", "B:60°", "B", "60°")] == [1, 1, 1, 1, 0, 0, 0]
    # MathVerse's judge-prompt examples, with their judgements
    free = {"answer": "(-2,1]", "choices": None, "meta": {"source": "mathverse", "question_type": "free-form"}}
    assert not answer_correct("\\((-2, 1)\\)", free)
    mc = {
        "answer": "C",
        "choices": ["2", "2√{3}", "√{3}", "2√{2}"],
        "meta": {"source": "mathverse", "question_type": "multi-choice"},
    }
    assert not answer_correct("B:2√{3}", mc) and not answer_correct(None, mc)


def test_mathvision_test_and_testmini():
    test = read_mathvision(FIX / "mathv", split="test", image_root=REPO_DATA / "mathv")
    mini = read_mathvision(REPO_DATA / "mathv", split="testmini")
    assert [r["id"] for r in test] == [r["id"] for r in mini] and len(test) == 37
    assert [r["question"] for r in test] == [r["question"] for r in mini]
    free, mc = _by_id(test)["4"], _by_id(test)["6"]
    assert free["answer"] == "6" and free["choices"] is None and free["meta"]["subject"] == "counting"
    assert mc["choices"] == ["A", "B", "C", "D", "E"] and mc["meta"]["source"] == "mathvision"
    assert answer_correct("6", free) and not answer_correct("7", free)
    assert answer_correct(f"({mc['answer']})", mc) and not answer_correct("(F)", mc)


def test_olympiadbench_judge_agrees_with_its_examples():
    examples = json.loads((FIX / "olympiadbench" / "scoring_examples.json").read_text(encoding="utf-8"))
    cases = [(e["GT"], a) for e in examples for a in e["Ans"]]
    assert len(cases) == 36
    for gold, a in cases:
        prec = a.get("precision", 1e-8)
        prec = float(prec) if isinstance(prec, str) else prec
        assert olympiad_equal(a["answer"], gold, prec) is a["equal"], (gold, a)


def test_olympiadbench_rows():
    rows = _by_id(read_olympiadbench(FIX / "olympiadbench"))
    assert set(rows) == {"2231", "90001", "90002", "90003"}
    assert "<image1>" in rows["2231"]["question"] and len(rows["2231"]["images"]) == 1
    two = rows["90001"]
    assert two["question"].count("<image") == 2 and len(two["images"]) == 2 and "several answers" in two["question"]
    assert answer_correct("\\boxed{(3,6),(2,1)}", two) and not answer_correct("(2,1)", two)
    assert answer_correct("5.66, 16", rows["90002"]) and not answer_correct("5.7, 16", rows["90002"])
    assert "unit of the answer is m/s" in rows["90003"]["question"]
    assert answer_correct("0.5 m/s", rows["90003"]) and answer_correct("\\frac{1}{2}", rows["90003"])
    assert not answer_correct("0.6", rows["90003"])
    assert answer_correct("$\\frac{1}{2}$", rows["2231"]) and answer_correct("0.5", rows["2231"])


FIRST_RELEASE = FIX / "olympiadbench" / "first_release" / "English_Olympiad_Mathematics.json"
_FIGURE = re.compile(r"!\[\]\([^)]*\)")  # the first release links each figure as a Mathpix crop

# OlympiadBench's own judge (eval/auto_scoring_judge.py, run outside this repository with sympy 1.12
# and antlr4 4.11) on each real row's gold answer against a model answer: (id, answer, its verdict).
JUDGED_ON_REAL_ROWS = [
    (2231, "$\\frac{1}{2}$", True),
    (2231, "\\boxed{0.5}", True),
    (2231, "C=\\frac{1}{2}", True),
    (2231, "\\frac{1}{3}", False),
    (2237, "79.67", True),
    (2237, "79.6", True),  # within the row's error 1e-1
    (2237, "79.75", True),
    (2237, "79.5", False),
    (2237, "80", False),
    (2358, "3570", True),
    (2358, "\\boxed{3570}", True),
    (2358, "3570 \\mathrm{~km}", False),  # the judge compares a unit as symbols
    (2358, "3571", False),
    (2386, "$y=-3 x+39$", True),
    (2386, "3x+y=39", True),
    (2386, "y=39-3x", True),
    (2386, "y=3x+39", False),
    (2386, "-3x+39", True),
    (2593, "\\frac{10}{3} \\sqrt{3}, \\frac{10}{\\sqrt{3}}", True),
    (2593, "\\frac{10\\sqrt{3}}{3},\\frac{10\\sqrt{3}}{3}", True),
    (2593, "\\frac{10}{\\sqrt{3}}", False),
    (2593, "5.7735,5.7735", False),
    (2595, "(4,0),(0,4),(2,0),(0,2),(-2,2),(2,-2)", True),
    (2595, "(2,-2),(-2,2),(0,2),(2,0),(0,4),(4,0)", True),
    (2595, "(4,0),(0,4),(2,0),(0,2),(-2,2)", False),
    (2595, "(4,0),(0,4),(2,0),(0,2),(-2,2),(2,2)", False),
    (3060, "1000", True),
    (3060, "10^{3}", True),
    (3060, "\\boxed{1000}", True),
    (3060, "999", False),
    (3060, "2025", False),
]


def test_olympiadbench_judge_agrees_on_real_rows():
    rows = {r["id"]: r for r in json.loads(FIRST_RELEASE.read_text(encoding="utf-8"))}
    assert {rid for rid, _, _ in JUDGED_ON_REAL_ROWS} == set(rows)
    for rid, answer, verdict in JUDGED_ON_REAL_ROWS:
        gold, error = rows[rid]["final_answer"][0], rows[rid]["error"]
        assert olympiad_equal(answer, gold, olympiad_precision(error)) is verdict, (rid, answer)


def test_olympiadbench_reader_on_real_rows(tmp_path):
    """Real rows (the first release) put in the released layout: each figure link becomes an
    `<img_N>` tag with its image in `image_k` (placeholders: the crops are not shipped)."""
    raw = json.loads(FIRST_RELEASE.read_text(encoding="utf-8"))
    (tmp_path / "images").mkdir()
    released = []
    for r in raw:
        first, *after = _FIGURE.split(r["question"])
        n = len(after)
        question = first + "".join(f"<img_{r['id']}{k}>{piece}" for k, piece in enumerate(after, start=1))
        row = {**r, "question": question, "context": None}
        for k in range(1, 6):
            row[f"image_{k}"] = f"images/{r['id']}_{k}.png" if k <= n else None
            if k <= n:
                shutil.copy(FIX / "olympiadbench" / "images" / "2231_1.png", tmp_path / row[f"image_{k}"])
        released.append(row)
    (tmp_path / "OE_MM_maths_en_COMP.json").write_text(json.dumps(released), encoding="utf-8")
    rows = _by_id(read_olympiadbench(tmp_path))
    assert list(rows) == [str(r["id"]) for r in raw]
    for r in raw:
        p, n = rows[str(r["id"])], len(_FIGURE.findall(r["question"]))
        assert len(p["images"]) == n and all(f"<image{k}>" in p["question"] for k in range(1, n + 1))
        assert "<img_" not in p["question"] and "mathpix" not in p["question"]
        assert ("several answers" in p["question"]) is r["is_multiple_answer"]
        assert (f"unit of the answer is {r['unit']}" in p["question"]) is bool(r["unit"])
        assert p["answer"] == r["final_answer"][0]
        assert {k: p["meta"][k] for k in ("subfield", "answer_type", "unit", "error")} == {
            k: r[k] for k in ("subfield", "answer_type", "unit", "error")
        }
        assert answer_correct(r["final_answer"][0], p) and answer_correct(f"\\boxed{{{p['answer']}}}", p)
    assert answer_correct("3570 km", rows["2358"])  # the prompt asks for no unit; a trailing copy is dropped
    # the built README row 2231 is the real row in the released layout
    built = json.loads((FIX / "olympiadbench" / "OE_MM_maths_en_COMP.json").read_text(encoding="utf-8"))[0]
    real = next(r for r in raw if r["id"] == 2231)
    assert built["question"] == _FIGURE.sub("<img_3362>", real["question"])
    fields = ("final_answer", "subfield", "answer_type", "unit", "error", "is_multiple_answer")
    assert {k: built[k] for k in fields} == {k: real[k] for k in fields}


def test_mmk12_rows_and_cli_writes_problems(tmp_path):
    rows = _by_id(read_mmk12(FIX / "mmk12"))
    assert answer_correct("0.8", rows["k12-0"]) and answer_correct("\\dfrac{4}{5}", rows["k12-0"])
    assert answer_correct("(C)", rows["k12-1"]) and not answer_correct("B", rows["k12-1"])
    assert answer_correct("2", rows["k12-2"]) and not answer_correct("3", rows["k12-2"])
    assert main(["eval-set", "mmk12", "--source", str(FIX / "mmk12"), "--out", str(tmp_path)]) == 0
    problems = load_problems(tmp_path / "problems.jsonl")
    assert [p.id for p in problems] == ["k12-0", "k12-1", "k12-2"] and problems[1].meta["source"] == "mmk12"
    assert main(["eval-set", "mmk12", "--source", str(tmp_path / "nowhere"), "--out", str(tmp_path)]) == 1


def test_hub_layout_reads_through_datasets(tmp_path):
    """A local copy of a Hub dataset (parquet shards, images inside) goes through `datasets.load_dataset`,
    the call a user makes with `AI4Math/MathVista`; the images are written out, rows match the JSON's."""
    datasets = pytest.importorskip("datasets")
    from PIL import Image

    raw = json.loads((FIX / "mathvista" / "testmini.json").read_text(encoding="utf-8"))
    queries = json.loads((FIX / "mathvista" / "query.json").read_text(encoding="utf-8"))
    recs = [
        {
            **r,
            "query": queries[pid],
            "metadata": json.dumps(r["metadata"]),
            "decoded_image": Image.open(FIX / "mathvista" / r["image"]),
        }
        for pid, r in list(raw.items())[:3]
    ]
    ds = datasets.Dataset.from_list(recs).cast_column("decoded_image", datasets.Image())
    ds = ds.map(lambda r: {"metadata": json.loads(r["metadata"])})
    repo = tmp_path / "AI4Math--MathVista"
    (repo / "data").mkdir(parents=True)
    ds.to_parquet(str(repo / "data" / "testmini-00000-of-00001.parquet"))
    hub = read_mathvista(repo, image_dir=tmp_path / "images")
    local = read_mathvista(FIX / "mathvista")[:3]
    assert [(r["id"], r["question"], r["answer"], r["meta"]) for r in hub] == [
        (r["id"], r["question"], r["answer"], r["meta"]) for r in local
    ]
    assert all(Path(r["images"][0]).parent == tmp_path / "images" and Path(r["images"][0]).is_file() for r in hub)


def test_rows_missing_a_released_field_are_named(tmp_path, capsys):
    """A row without a field the benchmark releases is named (source, row, id, field), not a
    KeyError, and a testmini row without its answer is not written with an empty gold answer."""

    copy = tmp_path / "mathvista"
    shutil.copytree(FIX / "mathvista", copy)
    rows = json.loads((copy / "testmini.json").read_text())
    first = next(iter(rows))
    del rows[first]["question_type"]
    rows[first]["answer"] = None
    (copy / "testmini.json").write_text(json.dumps(rows))
    with pytest.raises(ValueError, match=rf"{copy}: row 0 \(pid={first}\): question_type, answer: missing"):
        read_mathvista(copy)
    assert main(["eval-set", "mathvista", "--source", str(copy), "--out", str(tmp_path / "out")]) == 1
    assert "question_type, answer: missing" in capsys.readouterr().err
    olympiad = tmp_path / "OE_MM_maths_en_COMP.json"
    released = json.loads((FIX / "olympiadbench" / "OE_MM_maths_en_COMP.json").read_text())
    olympiad.write_text(json.dumps([{k: v for k, v in r.items() if k != "final_answer"} for r in released]))
    with pytest.raises(ValueError, match=r"row 0 \(id=\d+\): final_answer: missing"):
        read_olympiadbench(olympiad, image_root=FIX / "olympiadbench")
