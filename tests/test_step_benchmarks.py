"""ProcessBench and VisualProcessBench readers on rows in each benchmark's released schema.

The fixtures are rows in each benchmark's released schema built for these tests (no copy of the
benchmarks is reachable offline; tests/fixtures/step_benchmarks/README.md). When the full sets sit in
../shared/data (processbench/, visualprocessbench/), the same checks run on them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from real_data import SHARED_DATA

from mmprm.data.benchmarks import read_processbench, read_visualprocessbench
from mmprm.data.schema import DataError
from mmprm.scoring import metrics as M

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "step_benchmarks"
PB_DIR = SHARED_DATA / "processbench" if (SHARED_DATA / "processbench").is_dir() else FIXTURES / "processbench"
VPB_FILE = (
    SHARED_DATA / "visualprocessbench" / "test.jsonl"
    if (SHARED_DATA / "visualprocessbench" / "test.jsonl").is_file()
    else FIXTURES / "visualprocessbench" / "test.jsonl"
)
SUBSETS = ("gsm8k", "math", "olympiadbench", "omnimath")


def released_processbench() -> list[dict]:
    return [
        r for s in SUBSETS if (PB_DIR / f"{s}.json").is_file() for r in json.loads((PB_DIR / f"{s}.json").read_text())
    ]


def released_vpb() -> list[tuple[str, dict]]:
    lines = VPB_FILE.read_text(encoding="utf-8").splitlines()
    return [(f"vpb-{n}", json.loads(line)) for n, line in enumerate(lines, 1) if line.strip()]


# ---- readers


def test_processbench_reader_folder_file_and_jsonl(tmp_path):
    rows = read_processbench(PB_DIR)
    released = released_processbench()
    assert [r["id"] for r in rows] == [r["id"] for r in released]
    assert {r["meta"]["category"] for r in rows} == set(SUBSETS)
    for r, d in zip(rows, released):
        first = None if d["label"] == -1 else d["label"]
        assert r["meta"]["first_error"] == first == M.first_error(r["labels"])
        # once a step is wrong the solution stays wrong
        assert r["labels"] == [1.0 if first is None or i < first else 0.0 for i in range(len(d["steps"]))]
        assert r["question"] == d["problem"] and r["steps"] == d["steps"] and r["images"] == []
    one = read_processbench(PB_DIR / "gsm8k.json")
    assert [r["id"] for r in one] == [r["id"] for r in rows if r["meta"]["category"] == "gsm8k"]
    # JSON Lines, as datasets' to_json writes a split, reads the same
    jsonl = tmp_path / "gsm8k.jsonl"
    jsonl.write_text("".join(json.dumps(d) + "\n" for d in released if d["id"].startswith("gsm8k-")))
    assert read_processbench(jsonl) == one


def test_processbench_reader_names_bad_rows(tmp_path):
    bad = tmp_path / "math.json"
    good = {"id": "math-0", "generator": "g", "problem": "p", "steps": ["a", "b"], "final_answer_correct": True}
    bad.write_text(json.dumps([{**good, "label": 2}, {**good, "id": "math-1", "steps": [], "label": -1}, 3]))
    with pytest.raises(DataError) as e:
        read_processbench(bad)
    msg = str(e.value)
    assert f"{bad}:1: id=math-0: label: missing or malformed (must be the 0-based first wrong step in 0..1" in msg
    assert f"{bad}:2: id=math-1: steps" in msg and f"{bad}:3: id=?: row: not a JSON object" in msg
    with pytest.raises(DataError, match="no ProcessBench subset file"):
        read_processbench(tmp_path / "..")


def test_visualprocessbench_reader(tmp_path):
    rows = read_visualprocessbench(VPB_FILE)
    released = released_vpb()
    assert [r["id"] for r in rows] == [rid for rid, _ in released]
    for r, (_, d) in zip(rows, released):
        marks = d["response"]["process_correctness"]
        assert r["labels"] == [0.0 if m == -1 else 1.0 for m in marks]
        assert r["meta"]["neutral_steps"] == [i for i, m in enumerate(marks) if m == 0]
        assert r["meta"]["error_steps"] == [i for i, m in enumerate(marks) if m == -1]
        assert r["meta"]["category"] == d["data_source"] and r["meta"]["gold_answer"] == d["answer"]
        assert [Path(p) for p in r["images"]] == [VPB_FILE.parent / p for p in d["image"]]
        assert all(Path(p).is_file() for p in r["images"])
    # one question answered by several policy models is one source problem (for the dev split)
    by_q: dict[str, set] = {}
    for r in rows:
        by_q.setdefault(r["question"] + r["images"][0], set()).add(r["meta"]["source_id"])
    assert all(len(v) == 1 for v in by_q.values()) and len(by_q) < len(rows)
    # images are checked unless the PRM does not see them
    row = dict(released[0][1], question="<image1> <image2> Which bar is taller?")
    f = tmp_path / "test.jsonl"
    f.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=r"test.jsonl:1: id=vpb-1: image: not found: .* \(unzip images.zip"):
        read_visualprocessbench(f)
    (r1,) = read_visualprocessbench(f, check_images=False)
    assert r1["question"] == "Which bar is taller?"  # 2 placeholders for 1 image: dropped
    f.write_text(json.dumps({**row, "response": {"steps": ["a", "b"], "process_correctness": [1, 2]}}) + "\n")
    with pytest.raises(DataError, match="response.process_correctness: missing or malformed"):
        read_visualprocessbench(f, check_images=False)
