"""`mmprm.data.readers`: every kind maps names to readers, unknown names are refused by name, and
RPTS-Eval and MATH-Vision are each read by one reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmprm.data.readers import KINDS, UnknownReaderError, get_reader, reader_names, register_reader

DATA = Path(__file__).resolve().parents[1] / "data"


def test_every_kind_has_its_builtin_readers():
    assert set(KINDS) == {"step_benchmark", "answer_benchmark", "tree_format", "candidates", "sft", "prm_data"}
    assert reader_names("step_benchmark") == ["prmbench", "processbench", "reasoneval", "steps", "visualprocessbench"]
    assert {"mathvista", "mathverse", "mathvision", "olympiadbench", "mmk12", "rpts", "problems"} <= set(
        reader_names("answer_benchmark")
    )
    assert reader_names("tree_format") == ["mc_tree", "rpts", "steps", "think360"]
    assert {"mmprm", "mathv", "gsm8k", "qwen_math", "text"} <= set(reader_names("candidates"))
    assert {"steps", "gsm8k", "mathv"} <= set(reader_names("sft"))
    assert reader_names("prm_data") == sorted(
        ["trl", "math_shepherd", "prm800k", "openr_tree", "openr_flat", "mmprm_prm"]
    )


def test_a_prm_data_reader_is_convert_file_of_its_format():
    from mmprm.data.convert import convert_file

    path = DATA / "openr_samples" / "samples_math-shepherd.jsonl"
    got = get_reader("prm_data", "math_shepherd")(path, limit=3)
    want = convert_file("math_shepherd", path, limit=3)
    assert [ex.to_json() for ex in got.examples] == [ex.to_json() for ex in want.examples] and got.count > 0


def test_an_unknown_name_is_refused_with_the_kind_and_the_known_names():
    with pytest.raises(UnknownReaderError) as e:
        get_reader("tree_format", "think361")
    assert str(e.value) == "tree_format reader 'think361': unknown; the known names are mc_tree, rpts, steps, think360"
    with pytest.raises(UnknownReaderError, match="unknown reader kind 'trees': the kinds are step_benchmark"):
        get_reader("trees", "rpts")  # type: ignore[arg-type]


def test_a_name_is_held_by_one_reader():
    with pytest.raises(ValueError, match=r"tree_format reader 'rpts': already registered \(mmprm.treeval.readers"):
        register_reader("tree_format", "rpts")(lambda path, **kw: iter(()))


def test_mathv_is_a_deprecated_name_of_the_one_mathvision_reader():
    from mmprm.data.eval_sets import read_mathvision
    from mmprm.data.mathv import read_mathv

    with pytest.warns(FutureWarning, match="answer_benchmark reader 'mathv' is deprecated: use 'mathvision'"):
        assert get_reader("answer_benchmark", "mathv") is read_mathvision
    assert get_reader("answer_benchmark", "mathvision")(DATA / "mathv") == read_mathv(DATA / "mathv")


def test_rpts_eval_is_parsed_once_for_trees_and_for_problems():
    path = DATA / "rpts_eval" / "texts_en.json"
    records = json.loads(path.read_text(encoding="utf-8"))
    problems = get_reader("answer_benchmark", "rpts")(path)
    trees = list(get_reader("tree_format", "rpts")(path))
    assert [p["id"] for p in problems] == [str(r["id"]) for r in records] == [t["id"] for t in trees]
    assert problems[0]["meta"]["record"] == records[0]
    assert problems[0]["solution"] == "\n".join(records[0]["reasoning"])
    assert trees[0]["reference"] == str(records[0]["answer"]).strip().lower()


def test_a_bad_rpts_record_is_named(tmp_path):
    bad = tmp_path / "texts.json"
    bad.write_text(json.dumps([{"id": 7, "reasoning": []}, {"answer": "agree"}]), encoding="utf-8")
    from mmprm.data.schema import DataError

    with pytest.raises(DataError, match=r"texts.json: item 0: id=7: answer: missing"):
        get_reader("answer_benchmark", "rpts")(bad)


def test_step_benchmark_readers_give_the_benchmark_rows_as_examples():
    from mmprm.data.benchmarks import read_prmbench

    path = DATA / "prmbench" / "target_data.jsonl"
    rows, examples = read_prmbench(path), get_reader("step_benchmark", "prmbench")(path)
    assert [(ex.id, ex.steps, ex.labels, ex.meta) for ex in examples] == [
        (r["id"], r["steps"], r["labels"], r["meta"]) for r in rows
    ]
