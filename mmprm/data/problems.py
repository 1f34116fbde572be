"""Problems: the input of annotation (OmegaPRM) and of Best-of-N generation.

One JSON object per line::

    {"id": "p17",
     "images": ["imgs/p17.png"],          # relative to the JSONL file, or absolute
     "question": "<image1> What is the sum of the two bars?",
     "answer": "12",                      # the gold answer that rollouts are verified against
     "choices": ["10", "12"],             # optional: option texts in letter order
     "meta": {"source": "synthetic"}}     # optional, free-form

`load_problems` checks every row before any work starts and raises `DataError` listing every
problem as `FILE:LINE: id=...: field: what is wrong (how to fix)`. `mmprm synthetic` writes one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmprm.data.schema import DataError, check_base_fields, iter_jsonl, raise_if_bad, row_id


@dataclass
class Problem:
    """One row of a problems file: images are absolute paths after loading."""

    id: str
    question: str
    answer: str
    images: list[str] = field(default_factory=list)
    choices: list[str] | None = None
    meta: dict[str, Any] = field(default_factory=dict)


def check_problem_fields(
    obj: dict[str, Any],
    base_dir: Path,
    check_images: bool = True,
    need_answer: bool = True,
    image_cache: dict[Path, str | None] | None = None,
) -> tuple[list[tuple[str, str]], list[str]]:
    """Validate the problem fields of a row: ([(field, message)], absolute image paths).

    id, question and images are checked as in every mmprm row (`check_base_fields`). Also checks
    the problem part of a candidates row, where the gold answer may be null (`need_answer=False`).
    """
    errs, resolved = check_base_fields(obj, base_dir, check_images, image_cache)
    gold = obj.get("answer")
    if gold is None:
        if need_answer:
            errs.append(("answer", "missing (the gold answer is needed to verify generated solutions)"))
    elif isinstance(gold, bool) or not isinstance(gold, (str, int, float)) or not str(gold).strip():
        errs.append(
            (
                "answer",
                "must be the gold answer as a non-empty string or number"
                + ("" if need_answer else ", or null when unknown"),
            )
        )
    choices = obj.get("choices")
    if choices is not None and (not isinstance(choices, list) or not all(isinstance(x, str) for x in choices)):
        errs.append(("choices", "must be a list of option texts in letter order, or omitted"))
    if not isinstance(obj.get("meta") or {}, dict):
        errs.append(("meta", "must be a JSON object"))
    return errs, resolved


def load_problems(
    path: str | Path,
    check_images: bool = True,
    check_rows: Callable[[int], bool] | None = None,
    keep_rows: Callable[[int], bool] | None = None,
) -> list[Problem]:
    """Load and validate a problems JSONL file; raise DataError listing every bad row.

    With `check_images`, every image must exist and open as an image (its header is read); with
    `check_rows` too, only the images of rows i (0-based, in file order) where check_rows(i) is
    true - a worker's own share, so 8 workers do not each open all 100k images. With `keep_rows`,
    every row is still checked but only rows i where keep_rows(i) is true are returned: a worker
    holds its own share, not the whole file.
    """
    path = Path(path)
    if not path.exists():
        raise DataError(
            [f"{path}: file not found (a JSONL of {{id, images, question, answer}} rows; `mmprm synthetic` writes one)"]
        )
    problems: list[Problem] = []
    bad: list[str] = []
    seen: dict[str, int] = {}
    cache: dict[Path, str | None] = {}
    for row, (lineno, obj, err) in enumerate(iter_jsonl(path)):
        if err:
            bad.append(f"{path}:{lineno}: id=?: line: {err}")
            continue
        rid = row_id(obj)
        check = check_images and (check_rows is None or check_rows(row))
        errs, images = check_problem_fields(obj, path.parent, check, image_cache=cache)
        bad += [f"{path}:{lineno}: id={rid}: {fld}: {msg}" for fld, msg in errs]
        if errs:
            continue
        if rid in seen:
            bad.append(f"{path}:{lineno}: id={rid}: id: duplicated (first on line {seen[rid]}; make ids unique)")
            continue
        seen[str(rid)] = lineno
        if keep_rows is not None and not keep_rows(row):
            continue
        problems.append(
            Problem(
                id=str(rid),
                question=obj["question"],
                answer=str(obj["answer"]),
                images=images,
                choices=obj.get("choices"),
                meta=obj.get("meta") or {},
            )
        )
    raise_if_bad(path, bad, len(seen), what="problems file")
    return problems


def problem_ids(path: str | Path, limit: int | None = None) -> list[str]:
    """The ids of the first `limit` rows (all: None) of a problems file `load_problems` accepted,
    read without keeping the rows."""
    ids: list[str] = []
    for _, obj, _ in iter_jsonl(path):
        if len(ids) == limit:
            break
        if obj is not None:
            ids.append(str(row_id(obj)))
    return ids
