"""PRMBench and ReasonEval readers on real files (the full sets or the repo subset), plus bad input."""

import json
import re

import pytest
from real_data import DATA, full_or_subset, reasoneval_files

from mmprm.data.benchmarks import read_prmbench, read_reasoneval
from mmprm.data.schema import DataError, StepExample, load_examples, write_jsonl
from mmprm.scoring.metrics import first_error


def test_prmbench(tmp_path):
    rows = read_prmbench(DATA / "prmbench" / "target_data.jsonl")
    n = full_or_subset(full=394, subset=35)
    assert len(rows) == n and len({r["id"] for r in rows}) == n
    by_id = {r["id"]: r for r in rows}
    first = by_id["prm_test_p1_0/confidence"]  # error_steps [5, 6] of 6 steps
    assert first["labels"] == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    assert first["meta"]["first_error"] == 4 and first["meta"]["category"] == "confidence"
    assert first["question"].startswith("Three pencils and a jumbo eraser cost $1.24.")
    # error_steps [52, 54] with 53 steps: 54 is dropped and recorded.
    oor = by_id["prm_test_p1_29/confidence"]
    assert len(oor["labels"]) == 53 and oor["labels"][51] == 0.0 and oor["labels"].count(0.0) == 1
    assert oor["meta"]["dropped_error_steps"] == [54]
    assert sum("dropped_error_steps" in r["meta"] for r in rows) == full_or_subset(full=11, subset=6)
    multi = [r for r in rows if r["meta"]["category"] == "multi_solutions"]
    assert len(multi) == full_or_subset(full=10, subset=3)
    assert all(
        min(r["labels"]) == 1.0 and r["meta"]["first_error"] is None and "gold_answer" in r["meta"] for r in multi
    )
    for r in rows:
        assert len(r["labels"]) == len(r["steps"])
        assert r["meta"]["first_error"] == first_error(r["labels"])
    # The rows are valid mmprm examples, in memory and through a JSONL round trip.
    assert StepExample(**rows[0]).steps == rows[0]["steps"]
    write_jsonl(tmp_path / "prmbench.jsonl", rows)
    loaded = load_examples(tmp_path / "prmbench.jsonl", require_labels=True)
    assert [e.labels for e in loaded] == [r["labels"] for r in rows]


def test_reasoneval_invalid_errors(tmp_path):
    path, _, real = reasoneval_files(tmp_path)
    rows = read_reasoneval(path)
    raws = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    # subset: 35 PRMBench rows, each as its correct original and its modified process; 32 of the
    # modified ones have an error step in range (3 are multi_solutions rows, correct too)
    assert len(rows) == len(raws) == (159 if real else 70)
    wrong = [r for r in rows if r["meta"]["first_error"] is not None]
    flagged = sum(x["model_output_solution_correctness"] == "wrong" for x in raws)
    assert len(wrong) == flagged == (83 if real else 32) and len(rows) - len(wrong) == (76 if real else 38)
    for r, raw in zip(rows, raws):
        fe = r["meta"]["first_error"]
        want = [1.0] * len(r["steps"]) if fe is None else [1.0] * fe + [0.0] * (len(r["steps"]) - fe)
        assert r["labels"] == want
        assert fe == (
            None
            if raw["model_output_solution_first_error_step"] == "N/A"
            else raw["model_output_solution_first_error_step"] - 1
        )
        assert r["meta"]["label_kind"] == "validity" and r["meta"]["category"] == "invalid_errors"
        assert r["steps"] == ["\n".join(lines) for lines in raw["model_output_step_format"]]
    assert rows[0]["id"] == "reasoneval-invalid-0" and rows[0]["answer"] is None


def test_reasoneval_redundant_errors(tmp_path):
    _, path, real = reasoneval_files(tmp_path)
    rows = read_reasoneval(path)
    assert len(rows) == (300 if real else 35)
    labels = [y for r in rows for y in r["labels"]]
    if real:  # the data README's counts
        assert labels.count(1.0) == 2642 and labels.count(0.0) == 353
        assert sum(0.0 in r["labels"] for r in rows) == 150
    else:  # one 0 per in-range PRMBench error step
        prm = [json.loads(line) for line in (DATA / "prmbench" / "target_data.jsonl").read_text().splitlines()]
        zeros = sum(len({e for e in x["error_steps"] if 1 <= e <= len(x["modified_process"])}) for x in prm)
        assert labels.count(0.0) == zeros and labels.count(1.0) == len(labels) - zeros
        assert sum(0.0 in r["labels"] for r in rows) == 32
    assert all(r["meta"]["label_kind"] == "redundancy" and r["meta"]["first_error"] is None for r in rows)


def test_bad_rows_name_file_line_id_field(tmp_path):
    pb = tmp_path / "prm.jsonl"
    good = {
        "idx": "a",
        "classification": "circular",
        "modified_question": "q?",
        "modified_process": ["s1", "s2"],
        "error_steps": [2],
    }
    pb.write_text(json.dumps(good) + "\n" + json.dumps({**good, "error_steps": ["2"]}) + "\n{oops\n")
    with pytest.raises(DataError) as e:
        read_prmbench(pb)
    assert e.value.problems[0].startswith(f"{pb}:2: id=a/circular: error_steps: missing or malformed")
    assert e.value.problems[1].startswith(f"{pb}:3: id=?: line: invalid JSON")

    re_ = tmp_path / "re.json"
    row = {
        "id": 7,
        "question": "q",
        "model_output_step_format": [["a"], ["b"]],
        "model_output_solution_first_error_step": 3,
    }
    re_.write_text(
        json.dumps(row)
        + "\n"
        + json.dumps({"id": 8, "question": "q", "rating": [1], "model_output_step_format": [["a"], ["b"]]})
        + "\n"
    )
    with pytest.raises(DataError) as e:
        read_reasoneval(re_)
    assert e.value.problems[0] == (
        f'{re_}:1: id=7: model_output_solution_first_error_step: 3 is not a step number in 1..2 or "N/A"'
    )
    assert e.value.problems[1].startswith(f"{re_}:2: id=8: rating: must be one 0/1 per step")


def test_repeated_rows_missing_ids_and_zero_based_errors_are_refused(tmp_path):
    pb = tmp_path / "prm.jsonl"
    good = {"idx": "a", "classification": "circular", "modified_question": "q?", "modified_process": ["s1", "s2"]}
    pb.write_text("".join(json.dumps({**good, "error_steps": [2]}) + "\n" for _ in range(2)))
    with pytest.raises(DataError, match=re.escape(f"{pb}: id=a/circular: id: 2 rows have it")):
        read_prmbench(pb)  # a repeated row would count twice
    pb.write_text(json.dumps({**good, "error_steps": [0]}) + "\n")
    with pytest.raises(
        DataError, match=re.escape(f"{pb}:1: id=a/circular: error_steps: [0] has a step number below 1")
    ):
        read_prmbench(pb)  # 0-based by mistake, not dropped as if past the end

    re_ = tmp_path / "re.json"
    row = {"question": "q", "model_output_step_format": [["a"], ["b"]], "model_output_solution_first_error_step": 1}
    re_.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=re.escape(f"{re_}:1: id=?: id: missing")):
        read_reasoneval(re_)
