"""PRMBench and ReasonEval readers on the real files in ../shared/data, plus bad input."""

import json
from pathlib import Path

import pytest

from mmprm.data.benchmarks import read_prmbench, read_reasoneval
from mmprm.data.schema import DataError, StepExample, load_examples, write_jsonl
from mmprm.scoring.metrics import first_error

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
needs_data = pytest.mark.skipif(not (DATA / "prmbench").exists(), reason="../shared/data not present")


@needs_data
def test_prmbench(tmp_path):
    rows = read_prmbench(DATA / "prmbench" / "target_data.jsonl")
    assert len(rows) == 394 and len({r["id"] for r in rows}) == 394
    by_id = {r["id"]: r for r in rows}
    first = by_id["prm_test_p1_0/confidence"]  # error_steps [5, 6] of 6 steps
    assert first["labels"] == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    assert first["meta"]["first_error"] == 4 and first["meta"]["category"] == "confidence"
    assert first["question"].startswith("Three pencils and a jumbo eraser cost $1.24.")
    # error_steps [52, 54] with 53 steps: 54 is dropped and recorded.
    oor = by_id["prm_test_p1_29/confidence"]
    assert len(oor["labels"]) == 53 and oor["labels"][51] == 0.0 and oor["labels"].count(0.0) == 1
    assert oor["meta"]["dropped_error_steps"] == [54]
    assert sum("dropped_error_steps" in r["meta"] for r in rows) == 11
    multi = [r for r in rows if r["meta"]["category"] == "multi_solutions"]
    assert len(multi) == 10
    assert all(min(r["labels"]) == 1.0 and r["meta"]["first_error"] is None and "gold_answer" in r["meta"]
               for r in multi)
    for r in rows:
        assert len(r["labels"]) == len(r["steps"])
        assert r["meta"]["first_error"] == first_error(r["labels"])
    # The rows are valid mmprm examples, in memory and through a JSONL round trip.
    assert StepExample(**rows[0]).steps == rows[0]["steps"]
    write_jsonl(tmp_path / "prmbench.jsonl", rows)
    loaded = load_examples(tmp_path / "prmbench.jsonl", require_labels=True)
    assert [e.labels for e in loaded] == [r["labels"] for r in rows]


@needs_data
def test_reasoneval_invalid_errors():
    rows = read_reasoneval(DATA / "reasoneval" / "mr-math_invalid_errors.json")
    assert len(rows) == 159
    wrong = [r for r in rows if r["meta"]["first_error"] is not None]
    assert len(wrong) == 83 and len(rows) - len(wrong) == 76
    for r in rows:
        fe = r["meta"]["first_error"]
        want = [1.0] * len(r["steps"]) if fe is None else [1.0] * fe + [0.0] * (len(r["steps"]) - fe)
        assert r["labels"] == want
        assert r["meta"]["label_kind"] == "validity" and r["meta"]["category"] == "invalid_errors"
    raw = json.loads((DATA / "reasoneval" / "mr-math_invalid_errors.json").open().readline())
    assert rows[0]["steps"][0] == "\n".join(raw["model_output_step_format"][0])
    assert rows[0]["id"] == "reasoneval-invalid-0" and rows[0]["answer"] is None


@needs_data
def test_reasoneval_redundant_errors():
    rows = read_reasoneval(DATA / "reasoneval" / "mr-math_redundant_errors.json")
    assert len(rows) == 300
    labels = [y for r in rows for y in r["labels"]]
    assert labels.count(1.0) == 2642 and labels.count(0.0) == 353
    assert sum(0.0 in r["labels"] for r in rows) == 150
    assert all(r["meta"]["label_kind"] == "redundancy" and r["meta"]["first_error"] is None for r in rows)


def test_bad_rows_name_file_line_id_field(tmp_path):
    pb = tmp_path / "prm.jsonl"
    good = {"idx": "a", "classification": "circular", "modified_question": "q?",
            "modified_process": ["s1", "s2"], "error_steps": [2]}
    pb.write_text(json.dumps(good) + "\n" + json.dumps({**good, "error_steps": ["2"]}) + "\n{oops\n")
    with pytest.raises(DataError) as e:
        read_prmbench(pb)
    assert e.value.problems[0].startswith(f"{pb}:2: id=a/circular: error_steps: missing or malformed")
    assert e.value.problems[1].startswith(f"{pb}:3: id=?: line: invalid JSON")

    re_ = tmp_path / "re.json"
    row = {"id": 7, "question": "q", "model_output_step_format": [["a"], ["b"]],
           "model_output_solution_first_error_step": 3}
    re_.write_text(json.dumps(row) + "\n" + json.dumps({"id": 8, "question": "q", "rating": [1],
                                                        "model_output_step_format": [["a"], ["b"]]}) + "\n")
    with pytest.raises(DataError) as e:
        read_reasoneval(re_)
    assert e.value.problems[0] == (f"{re_}:1: id=7: model_output_solution_first_error_step: 3 is not a step "
                                   "number in 1..2 or \"N/A\"")
    assert e.value.problems[1].startswith(f"{re_}:2: id=8: rating: must be one 0/1 per step")
