"""Rebuild this folder from the full public sets: `python data/build_subset.py ../shared/data`.

Every file here is either an unchanged copy of the full set's file or a line-filtered copy
(lines kept byte for byte, in their order); the selection below is the whole recipe. The tests
check the copies against the full set when it is present (tests/real_data.py).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# MATH-V testmini: the first 20 problems (the Best-of-N test's slice), plus the worked solutions
# with images under 20 kB and 2955 (a 5-step solution the SFT converter test reads).
MATHV_EXTRA = (
    "1512",
    "1546",
    "1559",
    "1564",
    "1634",
    "1668",
    "1680",
    "1696",
    "1709",
    "1727",
    "1781",
    "1813",
    "1861",
    "1864",
    "1893",
    "1915",
    "2955",
)
# PRMBench: every row of these source problems: three with a multi_solutions row, error steps past
# the last step (p1_29, p1_44, p1_46, p2_613, train_p1_1), and at least 2 rows of each of the 9 categories.
PRMBENCH_IDX = (
    "prm_test_p1_0",
    "prm_test_p1_2",
    "prm_test_p1_3",
    "prm_test_p1_29",
    "prm_test_p1_44",
    "prm_test_p1_46",
    "prm_test_p2_87",
    "prm_test_p2_613",
    "prm_train_p1_0",
    "prm_train_p1_1",
)
GSM8K_LINES = 40  # the first 40 problems of test.jsonl and of example_model_solutions.jsonl
RPTS_IMAGES = ("7_0.png",)  # the smallest image of a fully covered RPTS-Eval instance
COPIED = (
    "openr_samples/samples_math-aps-tree.jsonl",
    "openr_samples/samples_math-aps.jsonl",
    "openr_samples/samples_prm800k.jsonl",
    "openr_samples/samples_math-shepherd.jsonl",
    "rpts_eval/texts_en.json",
    "rpts_eval/texts_zh.json",
)
# OlympiadBench first release: the rows the scoring tests judge (a two-answer problem, a row whose
# `error` tolerance and percent scaling matter, a Tuple answer, Chinese rows), the first row of
# each file and its first row whose figures are only Mathpix links.
OLYMPIAD_IDS = {
    "English_Olympiad_Mathematics": (1664, 1709, 2592, 2595),
    "English_Olympiad_Physics": (803, 806),
    "Chinese_Olympiad_Mathematics": (4, 356),
    "Gaokao_Maths": (),
    "Gaokao_Physics": (),
}


def keep_rows(src: Path, dst: Path, keep) -> int:
    """Write the rows of the JSON list SRC that pass KEEP(row), unchanged, serialized as SRC is."""
    rows = [r for r in json.loads(src.read_text(encoding="utf-8")) if keep(r)]
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(json.dumps(rows, ensure_ascii=False, indent=4), encoding="utf-8")
    return len(rows)


def keep_lines(src: Path, dst: Path, keep) -> int:
    """Copy the lines of SRC whose parsed JSON passes KEEP(index, row), byte for byte."""
    lines = src.read_bytes().splitlines(keepends=True)
    kept = [line for i, line in enumerate(lines) if keep(i, json.loads(line))]
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(b"".join(kept))
    return len(kept)


def build(full: Path) -> None:
    testmini = [json.loads(line) for line in (full / "mathv" / "testmini.jsonl").read_text().splitlines()]
    mathv_ids = {r["id"] for r in testmini[:20]} | set(MATHV_EXTRA)
    keep_lines(full / "mathv/testmini.jsonl", HERE / "mathv/testmini.jsonl", lambda i, r: r["id"] in mathv_ids)
    for path in sorted((full / "mathv" / "cot_testmini").glob("*.jsonl")):
        keep_lines(path, HERE / "mathv/cot_testmini" / path.name, lambda i, r: r["id"] in mathv_ids)
    (HERE / "mathv/images").mkdir(parents=True, exist_ok=True)
    for i in sorted(mathv_ids):
        shutil.copyfile(full / "mathv/images" / f"{i}.jpg", HERE / "mathv/images" / f"{i}.jpg")
    for name in ("test.jsonl", "example_model_solutions.jsonl"):
        keep_lines(full / "gsm8k" / name, HERE / "gsm8k" / name, lambda i, r: i < GSM8K_LINES)
    # Qwen2.5-Math: the 14 problems with at least one wrong response (where reranking matters),
    # idx 72 among them (the file's one mis-graded response, "10{,}000").
    keep_lines(
        full / "qwen_math_bon/math_cot_100.jsonl",
        HERE / "qwen_math_bon/math_cot_100.jsonl",
        lambda i, r: not all(r["score"]),
    )
    keep_lines(
        full / "prmbench/target_data.jsonl", HERE / "prmbench/target_data.jsonl", lambda i, r: r["idx"] in PRMBENCH_IDX
    )
    for name, ids in OLYMPIAD_IDS.items():
        src = full / "olympiadbench" / f"{name}.json"
        rows = json.loads(src.read_text(encoding="utf-8"))
        linked = next((r["id"] for r in rows if "](http" in r["question"]), None)
        keep = {rows[0]["id"], linked, *ids}
        keep_rows(src, HERE / "olympiadbench" / f"{name}.json", lambda r, keep=keep: r["id"] in keep)
    for rel in COPIED:
        (HERE / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(full / rel, HERE / rel)
    (HERE / "rpts_eval/images").mkdir(parents=True, exist_ok=True)
    for name in RPTS_IMAGES:
        shutil.copyfile(full / "rpts_eval/images" / name, HERE / "rpts_eval/images" / name)


if __name__ == "__main__":
    build(Path(sys.argv[1] if len(sys.argv) > 1 else HERE.parent.parent / "shared" / "data"))
