"""The step-labelled schema: every bad input gives one actionable line naming file, line, id, field."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image
from real_data import DATA

from mmprm.data.schema import DataError, load_examples, to_hf_dataset, validate_file, write_jsonl
from mmprm.steps import STEP_TOKEN


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
    good = _write(tmp_path, [_row(), _row(id="b", labels=None)], "good.jsonl")
    bad = _write(tmp_path, [_row(labels=[0.5])], "bad.jsonl")
    ok = subprocess.run([sys.executable, "-m", "mmprm.cli", "validate", str(good)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert f"{good}: OK (2 examples, 4 steps, 1 labelled)" in ok.stderr
    fail = subprocess.run([sys.executable, "-m", "mmprm.cli", "validate", str(bad)], capture_output=True, text=True)
    assert fail.returncode == 1
    assert f"{bad}:1: id=a: labels: 1 labels for 2 steps" in fail.stdout


def test_cli_validate_a_directory_checks_each_jsonl(tmp_path):
    from mmprm.cli import main

    folder = tmp_path / "data"
    folder.mkdir()
    good = _write(folder, [_row()], "good.jsonl")
    bad = _write(folder, [_row(labels=[0.5])], "bad.jsonl")
    (folder / "notes.txt").write_text("not data")
    done = subprocess.run([sys.executable, "-m", "mmprm.cli", "validate", str(folder)], capture_output=True, text=True)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert f"{bad}:1: id=a: labels: 1 labels for 2 steps" in done.stdout and f"{good}: OK" in done.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["validate", str(empty)]) == 1
    # the library call names the directory instead of raising IsADirectoryError
    assert validate_file(folder)[1] == [
        f"{folder}: is a directory; give a JSONL file (`mmprm validate DIR` checks each *.jsonl in DIR)"
    ]
    with pytest.raises(DataError, match="is a directory"):
        from mmprm.data.problems import load_problems

        load_problems(folder)


def test_invalid_json_is_reported_at_its_real_column(tmp_path):
    row = json.dumps(_row(question="What is the sum of 2, 3?"))
    cut = row[: row.index(' "steps"')]  # cut off after a comma, 65 characters in (a crash mid-write)
    inner = row.replace('"steps"', "'steps'")  # a quote error in the middle of the line
    p = _write(tmp_path, [(cut + "\n").encode(), (inner + "\r\n").encode(), (row[:30] + "\n").encode()])
    _, problems = validate_file(p)
    assert len(cut) == 65 and problems[0] == (
        f"{p}:1: id=?: line: invalid JSON: Expecting property name enclosed "
        "in double quotes at column 66 (fix the line so it holds one JSON object)"
    )
    col = inner.index("'steps'") + 1
    assert problems[1].startswith(f"{p}:2: id=?: line: invalid JSON: ") and f"at column {col} " in problems[1]
    assert "Unterminated string starting at column 27 " in problems[2]


def test_a_row_without_id_reads_id_question_mark(tmp_path):
    row = _row(labels=[2.0, 1.0])
    del row["id"]
    p = _write(tmp_path, [row, b"{oops\n"])
    _, problems = validate_file(p)
    assert problems and all(": id=?: " in line for line in problems) and not any("None" in line for line in problems)
    from mmprm.data.benchmarks import read_reasoneval

    bad = _write(tmp_path, [{"question": "q", "model_output_step_format": "x"}], "re.json")
    with pytest.raises(DataError) as e:
        read_reasoneval(bad)
    assert e.value.problems[0].startswith(f"{bad}:1: id=?: model_output_step_format")


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_outputs_get_normal_permissions(tmp_path, umask):
    """Atomic writes give 0o666 less the umask (as open() does), not mkstemp's owner-only 0o600."""
    import os
    import stat

    from mmprm.rerank.report import _atomic_write

    old = os.umask(umask)
    try:
        write_jsonl(tmp_path / "prm_data.jsonl", [_row()])
        _atomic_write(tmp_path / "report.json", "{}")
    finally:
        os.umask(old)
    for name in ("prm_data.jsonl", "report.json"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~umask, name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prm_data.jsonl", "report.json"]  # no temp files left


def test_write_jsonl_round_trip(tmp_path):
    ex = load_examples(_write(tmp_path, [_row()]))
    out = tmp_path / "sub" / "out.jsonl"
    assert write_jsonl(out, ex) == 1
    again = load_examples(out)
    assert again[0].to_json() == ex[0].to_json()


def test_mathv_rows_with_placeholders_validate():
    data = DATA / "mathv"
    rows = [json.loads(line) for line in open(data / "testmini.jsonl")][:20]
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "m.jsonl"
        with open(p, "w") as f:
            for r in rows:
                n = max(1, len(set(__import__("re").findall(r"<image\d*>", r["question"]))))
                # MATH-V repeats placeholders for one composite figure: one image per placeholder occurrence
                n = len(__import__("re").findall(r"<image\d*>", r["question"])) or 1
                f.write(
                    json.dumps(
                        {
                            "id": r["id"],
                            "images": [str(data / r["image"])] * n,
                            "question": r["question"],
                            "steps": ["look"],
                            "answer": r["answer"],
                        }
                    )
                    + "\n"
                )
        ex = load_examples(p)
        assert len(ex) == 20
