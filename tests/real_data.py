"""Where the tests read real data: the full sets when present, else the subset in the repository.

`data/` (committed; sources and licenses in data/README.md) holds small line-filtered subsets
with the same layout and file names as the full sets in `../shared/data`. The tests prefer the
full sets and fall back to the subset, so a fresh clone runs every real-data test;
MMPRM_SHARED_DATA=DIR points at the full sets elsewhere (a path that does not exist forces the
subset). A test whose numbers depend on the set asserts `full_or_subset(full=..., subset=...)`:
the full sets' published counts there, the subset's own counts here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[1]
REPO_DATA = REPO / "data"
SHARED_DATA = Path(os.environ.get("MMPRM_SHARED_DATA") or REPO.parent / "shared" / "data")

FULL = (SHARED_DATA / "mathv" / "testmini.jsonl").is_file()
DATA = SHARED_DATA if FULL else REPO_DATA


def full_or_subset(full: T, subset: T) -> T:
    """The expectation for the data the tests read: FULL's value or the repo subset's."""
    return full if FULL else subset


def reasoneval_files(tmp: Path) -> tuple[Path, Path, bool]:
    """ReasonEval's (invalid-errors, redundant-errors) files and whether they are the real ones.

    ReasonEval states no license, so the repository does not carry it: the real files are used
    when the full sets have them; otherwise TMP gets files in the same JSON Lines format, made from
    the PRMBench subset (Apache-2.0). Invalid errors: per PRMBench row, its original (correct)
    process with first error "N/A", then its modified process whose first in-range error step is
    the first error; redundant errors: the modified process, rating 0 on its error steps, 1 elsewhere.
    Each step becomes its list of lines, as ReasonEval stores them.
    """
    import json

    real = SHARED_DATA / "reasoneval"
    if FULL and (real / "mr-math_invalid_errors.json").is_file():
        return real / "mr-math_invalid_errors.json", real / "mr-math_redundant_errors.json", True
    rows = [json.loads(line) for line in (DATA / "prmbench" / "target_data.jsonl").read_text().splitlines()]
    invalid, redundant = [], []
    for k, r in enumerate(rows):
        steps = r["modified_process"]
        errors = [e for e in r["error_steps"] if 1 <= e <= len(steps)]
        question = {"question": r["modified_question"], "ground_truth_answer": "", "generator": "PRMBench"}
        for process, first in ((r["original_process"], None), (steps, min(errors) if errors else None)):
            invalid.append(
                {
                    "id": len(invalid),
                    **question,
                    "model_output_step_format": [s.split("\n") for s in process],
                    "model_output_answer_correctness": "correct",
                    "model_output_solution_correctness": "correct" if first is None else "wrong",
                    "model_output_solution_first_error_step": "N/A" if first is None else first,
                }
            )
        redundant.append(
            {
                "id": k,
                **question,
                "model_output_step_format": [s.split("\n") for s in steps],
                "rating": [0 if i + 1 in errors else 1 for i in range(len(steps))],
            }
        )
    tmp.mkdir(parents=True, exist_ok=True)
    paths = tmp / "mr-math_invalid_errors.json", tmp / "mr-math_redundant_errors.json"
    for path, items in zip(paths, (invalid, redundant)):
        path.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in items), encoding="utf-8")
    return paths[0], paths[1], False
