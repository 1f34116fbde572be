"""The step-labelled schema: every bad input gives one actionable line naming file, line, id, field."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from mmprm.data.schema import DataError, load_examples, to_hf_dataset, validate_file, write_jsonl
from mmprm.steps import STEP_TOKEN
from real_data import DATA


def _row(**kw):
    row = {"id": "a", "images": [], "question": "What is 2+3?", "steps": ["2+3=5.", "So 5."], "labels": [1.0, 0.7]}
    row.update(kw)
    return row


def _write(tmp_path, rows, name="data.jsonl"):
    p = tmp_path / name
    with open(p, "wb") as f:
        for r in rows:
            f.write(r if isinstance(r, bytes) else (json.dumps(r) + "\n").encode())
    return p


@pytest.fixture
def image(tmp_path):
    Image.new("RGB", (8, 8), "red").save(tmp_path / "img.png")
    return "img.png"


def test_clean_file_loads_with_relative_images_and_float_labels(tmp_path, image):
    p = _write(tmp_path, [_row(images=[image]), _row(id="b", question="<image1> Sum?", images=[image])])
    ex = load_examples(p, require_labels=True)
    assert [e.id for e in ex] == ["a", "b"]
    assert ex[0].images == [str((tmp_path / image).resolve())]
    assert ex[0].labels == [1.0, 0.7] and isinstance(ex[0].labels[1], float)
    ds = to_hf_dataset(ex)
    assert ds[0]["labels"] == [1.0, 0.7]


def test_unlabelled_rows_allowed_for_scoring(tmp_path):
    row = _row()
    del row["labels"]
    assert load_examples(_write(tmp_path, [row]))[0].labels is None
    _, problems = validate_file(_write(tmp_path, [row], "b.jsonl"), require_labels=True)
    assert problems == [f"{tmp_path / 'b.jsonl'}:1: id=a: labels: missing (training needs one float in [0,1] per step)"]


BAD_CASES = {
    "invalid_json": (b'{"id": "a", "question": \n', "line: invalid JSON"),
    "missing_field": (_row(question=None), "question: missing or empty"),
    "missing_image": (_row(images=["nope.png"]), "images[0]: image not found"),
    "unreadable_image": ("BROKEN", "images[0]: image unreadable"),
    "placeholder_mismatch": ("PLACEHOLDER", "images: question has 2 image placeholder(s) but 1 image(s)"),
    "length_mismatch": (_row(labels=[1.0]), "labels: 1 labels for 2 steps"),
    "label_out_of_range": (_row(labels=[1.0, 1.5]), "labels[1]: 1.5 is outside [0,1]"),
    "label_nan": (b'{"id": "a", "question": "q", "steps": ["s"], "labels": [NaN]}\n', "labels[0]: nan is not a finite"),
    "empty_steps": (_row(steps=[], labels=[]), "steps: empty list"),
    "empty_step_text": (_row(steps=["ok", "  "]), "steps[1]: empty step text"),
    "step_token_literal": (_row(steps=["ok", f"bad {STEP_TOKEN}"]), "steps[1]: contains the reserved step token"),
    "step_token_in_question": (_row(question=f"q {STEP_TOKEN}"), "question: contains the reserved step token"),
    "non_utf8": (b'{"id": "a", "question": "caf\xe9", "steps": ["s"]}\n', "line: not UTF-8"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_each_bad_input_gives_one_actionable_line(tmp_path, image, case):
    row, expected = BAD_CASES[case]
    if row == "BROKEN":
        (tmp_path / "broken.png").write_bytes(b"not a png at all")
        row = _row(images=["broken.png"])
    if row == "PLACEHOLDER":
        row = _row(question="<image1> and <image2>: which is larger?", images=[image])
    p = _write(tmp_path, [row])
    with pytest.raises(DataError) as e:
        load_examples(p, require_labels=True)
    assert len(e.value.problems) == 1, e.value.problems
    line = e.value.problems[0]
    assert line.startswith(f"{p}:1: id="), line
    assert expected in line, line
    assert "(" in line and line.endswith(")"), f"no fix suggested: {line}"


def test_duplicate_id_names_both_lines(tmp_path):
    p = _write(tmp_path, [_row(), _row(), _row(id="c")])
    _, problems = validate_file(p)
    assert problems == [f"{p}:2: id=a: id: duplicated (first on line 1; make ids unique)"]


def test_all_problems_reported_not_just_first(tmp_path):
    p = _write(tmp_path, [_row(labels=[2.0, 1.0]), b"{oops\n", _row(id="z", steps=[], labels=[])])
    _, problems = validate_file(p)
    assert [pr.split(":")[1] for pr in problems] == ["1", "2", "3"]


def test_cli_validate_exit_codes(tmp_path):
    good = _write(tmp_path, [_row()], "good.jsonl")
    bad = _write(tmp_path, [_row(labels=[0.5])], "bad.jsonl")
    ok = subprocess.run([sys.executable, "-m", "mmprm.cli", "validate", str(good)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    fail = subprocess.run([sys.executable, "-m", "mmprm.cli", "validate", str(bad)], capture_output=True, text=True)
    assert fail.returncode == 1
    assert f"{bad}:1: id=a: labels: 1 labels for 2 steps" in fail.stdout


def test_write_jsonl_round_trip(tmp_path):
    ex = load_examples(_write(tmp_path, [_row()]))
    out = tmp_path / "sub" / "out.jsonl"
    assert write_jsonl(out, ex) == 1
    again = load_examples(out)
    assert again[0].to_json() == ex[0].to_json()


def test_mathv_rows_with_placeholders_validate():
    data = DATA / "mathv"
    rows = [json.loads(l) for l in open(data / "testmini.jsonl")][:20]
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "m.jsonl"
        with open(p, "w") as f:
            for r in rows:
                n = max(1, len(set(__import__("re").findall(r"<image\d*>", r["question"]))))
                # MATH-V repeats placeholders for one composite figure: one image per placeholder occurrence
                n = len(__import__("re").findall(r"<image\d*>", r["question"])) or 1
                f.write(json.dumps({"id": r["id"], "images": [str(data / r["image"])] * n,
                                    "question": r["question"], "steps": ["look"], "answer": r["answer"]}) + "\n")
        ex = load_examples(p)
        assert len(ex) == 20
