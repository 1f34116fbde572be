"""The problems loader: a good file loads; each bad input is named by file, line, id and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from mmprm.data.problems import Problem, load_problems, problem_ids
from mmprm.data.schema import DataError
from mmprm.steps import STEP_TOKEN


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _errors(tmp_path: Path, rows: list) -> list[str]:
    with pytest.raises(DataError) as e:
        load_problems(_write(tmp_path / "problems.jsonl", rows))
    return e.value.problems


def _ok(**row) -> dict:
    return {"id": "p1", "images": [], "question": "What is 2 + 3?", "answer": "5", **row}


def test_good_file_loads_with_absolute_images(tmp_path):
    Image.new("RGB", (4, 4)).save(tmp_path / "a.png")
    path = _write(
        tmp_path / "problems.jsonl",
        [
            _ok(id=7, images=["a.png"], question="<image1> How many?", answer=3, choices=["2", "3"], meta={"s": 1}),
            _ok(id="p2"),
        ],
    )
    first, second = load_problems(path)
    assert first == Problem(
        id="7",
        question="<image1> How many?",
        answer="3",
        images=[str((tmp_path / "a.png").resolve())],
        choices=["2", "3"],
        meta={"s": 1},
    )
    assert (second.id, second.images, second.choices, second.meta) == ("p2", [], None, {})


def test_missing_file(tmp_path):
    with pytest.raises(DataError) as e:
        load_problems(tmp_path / "nowhere.jsonl")
    assert e.value.problems[0].startswith(f"{tmp_path / 'nowhere.jsonl'}: file not found")


def test_empty_file(tmp_path):
    assert _errors(tmp_path, []) == [
        f"{tmp_path / 'problems.jsonl'}:0: id=?: file: no rows (the problems file is empty)"
    ]


def test_invalid_json(tmp_path):
    (line,) = _errors(tmp_path, [_ok(), '{"id": "p2", "question": '])
    assert line.startswith(f"{tmp_path / 'problems.jsonl'}:2: id=?: line: invalid JSON")


def test_not_utf8(tmp_path):
    path = tmp_path / "problems.jsonl"
    path.write_bytes(json.dumps(_ok()).encode() + b"\n" + b'{"id": "\xff"}\n')
    with pytest.raises(DataError) as e:
        load_problems(path)
    assert e.value.problems == [f"{path}:2: id=?: line: not UTF-8: byte 8 is b'\\xff' (re-save the file as UTF-8)"]


def test_missing_id(tmp_path):
    row = _ok()
    del row["id"]
    (line,) = _errors(tmp_path, [row])
    assert line.endswith(":1: id=?: id: missing (add a unique string id to every row)")


def test_id_of_wrong_type(tmp_path):
    (line,) = _errors(tmp_path, [_ok(id=["p1"])])
    assert line.endswith(":1: id=['p1']: id: must be a string, got list")


def test_duplicated_id(tmp_path):
    (line,) = _errors(tmp_path, [_ok(), _ok(question="Again?")])
    assert line.endswith(":2: id=p1: id: duplicated (first on line 1; make ids unique)")


def test_missing_question(tmp_path):
    (line,) = _errors(tmp_path, [_ok(question="")])
    assert line.endswith(":1: id=p1: question: missing or empty (add the problem text)")


def test_reserved_step_token_in_question(tmp_path):
    (line,) = _errors(tmp_path, [_ok(question=f"What is 2 + 3? {STEP_TOKEN}")])
    assert line.endswith(
        f":1: id=p1: question: contains the reserved step token {STEP_TOKEN!r} (remove it from the text)"
    )


def test_missing_answer(tmp_path):
    row = _ok()
    del row["answer"]
    (line,) = _errors(tmp_path, [row])
    assert line.endswith(":1: id=p1: answer: missing (the gold answer is needed to verify generated solutions)")


def test_answer_of_wrong_type(tmp_path):
    (line,) = _errors(tmp_path, [_ok(answer=True)])
    assert line.endswith(":1: id=p1: answer: must be the gold answer as a non-empty string or number")


def test_missing_image(tmp_path):
    (line,) = _errors(tmp_path, [_ok(images=["gone.png"], question="<image1> How many?")])
    assert line == (
        f"{tmp_path / 'problems.jsonl'}:1: id=p1: images[0]: image not found: {tmp_path / 'gone.png'} "
        "(paths are relative to the JSONL file's folder)"
    )


def test_unreadable_image(tmp_path):
    (tmp_path / "broken.png").write_bytes(b"\x89PNG not really")
    (line,) = _errors(tmp_path, [_ok(images=["broken.png"])])
    assert line.endswith(
        f":1: id=p1: images[0]: image unreadable: {tmp_path / 'broken.png'}: "
        "UnidentifiedImageError (replace or re-export the file)"
    )


def test_images_not_a_list(tmp_path):
    (line,) = _errors(tmp_path, [_ok(images="a.png")])
    assert line.endswith(":1: id=p1: images: must be a list of image paths (use [] for text-only)")


def test_placeholders_and_images_disagree(tmp_path):
    (line,) = _errors(tmp_path, [_ok(question="<image1> and <image2>: which is larger?")])
    assert line.endswith(
        ":1: id=p1: images: question has 2 image placeholder(s) but 0 image(s) are listed "
        "(list one image per placeholder, or remove the placeholders)"
    )


def test_choices_not_a_list_of_strings(tmp_path):
    (line,) = _errors(tmp_path, [_ok(choices="AB")])
    assert line.endswith(":1: id=p1: choices: must be a list of option texts in letter order, or omitted")


def test_meta_not_an_object(tmp_path):
    (line,) = _errors(tmp_path, [_ok(meta=["x"])])
    assert line.endswith(":1: id=p1: meta: must be a JSON object")


def test_every_bad_row_is_reported_at_once(tmp_path):
    lines = _errors(tmp_path, [_ok(question=""), _ok(id="p2", answer=None), "[1, 2]"])
    assert [line.split(": ")[1:3] for line in lines] == [["id=p1", "question"], ["id=p2", "answer"], ["id=?", "line"]]


def test_check_images_false_skips_the_files(tmp_path):
    (p,) = load_problems(_write(tmp_path / "problems.jsonl", [_ok(images=["gone.png"])]), check_images=False)
    assert p.images == [str((tmp_path / "gone.png").resolve())]


def test_only_the_selected_rows_have_their_images_opened(tmp_path):
    """8 workers each check their own share of 100k images, not all of them 8 times; a missing
    image in a worker's own rows is still named with its file, line and id."""
    import json

    from PIL import Image

    from mmprm.data.problems import load_problems
    from mmprm.data.schema import DataError

    Image.new("RGB", (8, 8)).save(tmp_path / "ok.png")
    rows = [
        {"id": f"p{i}", "images": ["ok.png" if i != 3 else "gone.png"], "question": "q", "answer": "1"}
        for i in range(6)
    ]
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert len(load_problems(path, check_rows=lambda i: i % 2 == 0)) == 6  # row 3 is another worker's
    with pytest.raises(DataError, match=r"problems.jsonl:4: id=p3: images"):
        load_problems(path, check_rows=lambda i: i % 2 == 1)
    with pytest.raises(DataError, match=r"id=p3"):
        load_problems(path)


def test_a_worker_keeps_only_its_rows_but_every_row_is_checked(tmp_path):
    rows = [_ok(id=f"p{i}", images=[]) for i in range(5)]
    path = _write(tmp_path / "problems.jsonl", [rows[0], "", *rows[1:]])  # a blank line is not a row
    mine = lambda i: i % 2 == 1  # noqa: E731
    assert [p.id for p in load_problems(path, keep_rows=mine)] == ["p1", "p3"]
    assert load_problems(path, keep_rows=lambda i: False) == []  # an empty share of a full file
    assert problem_ids(path) == [f"p{i}" for i in range(5)] and problem_ids(path, limit=2) == ["p0", "p1"]
    rows[4]["answer"] = None  # outside this worker's share, still refused
    with pytest.raises(DataError, match="id=p4: answer"):
        load_problems(_write(path, rows), keep_rows=mine)
