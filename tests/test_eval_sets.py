"""Answer-benchmark readers on shipped rows (tests/fixtures/eval_sets, README there), and each
benchmark's answer rule against the benchmark's own verdicts: MathVista's scored outputs (Bard's
`prediction` / `true_false`), OlympiadBench's judged examples, MathVerse's judge-prompt examples."""

from __future__ import annotations

import json
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
from mmprm.data.eval_sets.olympiadbench import olympiad_equal
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
    assert mc["choices"] == ["A", "B", "C", "D", "E"] and mc["meta"]["source"] == "mathv"
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
