"""Readers for step-level PRM benchmarks: PRMBench and ReasonEval (Meta-Reasoning-MATH).

Each reader returns `StepExample`-compatible dicts (`StepExample(**row)` works, and
`write_jsonl` writes them in the mmprm schema)::

    {"id": str, "question": str, "steps": [str], "images": [], "labels": [float],
     "answer": None, "meta": {"source", "category", "label_kind", "first_error", ...}}

`answer` stays None because the final answer is already inside the last step; the gold answer,
when the benchmark has one, is `meta["gold_answer"]`. `meta["first_error"]` is the 0-based
first error step or None, ready for `mmprm.scoring.metrics.first_error_f1`.
`meta["label_kind"]` says what a 0 means: "validity" (the step is wrong) or "redundancy"
(the step is right but useless); do not pool the two in one metric.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mmprm.data.schema import DataError, iter_jsonl, row_id


def _str_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(s, str) for s in x)


def read_prmbench(path: str | Path) -> list[dict[str, Any]]:
    """PRMBench rows (e.g. `prmbench/target_data.jsonl`) as labelled step examples.

    Steps are `modified_process` and the question is `modified_question` (the problem those
    steps solve; it differs from the original for e.g. missing_condition). Labels: 0 for every
    step listed in the 1-based `error_steps`, 1 otherwise; steps after an error keep 1, as in
    PRMBench's own per-step scoring. Indices past the last step (11 rows of the classified
    subset) are dropped and kept in `meta["dropped_error_steps"]`. The id is
    `"<idx>/<classification>"` because `idx` repeats across categories.
    """
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    for lineno, obj, err in iter_jsonl(path):
        if err:
            problems.append(f"{path}:{lineno}: id=?: line: {err}")
            continue
        rid = f"{row_id(obj, 'idx')}/{row_id(obj, 'classification')}"
        where = f"{path}:{lineno}: id={rid}"
        bad = False
        for fld, ok, what in (
            ("idx", isinstance(obj.get("idx"), str), "a string problem id"),
            ("classification", isinstance(obj.get("classification"), str), "the error category string"),
            ("modified_question", isinstance(obj.get("modified_question"), str), "the problem text"),
            (
                "modified_process",
                _str_list(obj.get("modified_process")) and obj.get("modified_process"),
                "a non-empty list of step strings",
            ),
            (
                "error_steps",
                isinstance(obj.get("error_steps"), list)
                and all(isinstance(e, int) and not isinstance(e, bool) for e in obj.get("error_steps", [None])),
                "a list of 1-based step numbers ([] when there is no error)",
            ),
        ):
            if not ok:
                problems.append(f"{where}: {fld}: missing or malformed (must be {what})")
                bad = True
        if bad:
            continue
        steps = obj["modified_process"]
        errs = sorted({e - 1 for e in obj["error_steps"] if 1 <= e <= len(steps)})
        dropped = [e for e in obj["error_steps"] if not 1 <= e <= len(steps)]
        labels = [0.0 if i in errs else 1.0 for i in range(len(steps))]
        meta: dict[str, Any] = {
            "source": "prmbench",
            "category": obj["classification"],
            "label_kind": "validity",
            "source_id": obj["idx"],
            "first_error": errs[0] if errs else None,
            "error_steps": errs,
        }
        if dropped:
            meta["dropped_error_steps"] = dropped
        if isinstance(obj.get("ground_truth"), str):
            meta["gold_answer"] = obj["ground_truth"]
        rows.append(
            {
                "id": rid,
                "question": obj["modified_question"],
                "steps": list(steps),
                "images": [],
                "labels": labels,
                "answer": None,
                "meta": meta,
            }
        )
    if problems:
        raise DataError(problems)
    return rows


def read_reasoneval(path: str | Path) -> list[dict[str, Any]]:
    """ReasonEval MR-MATH rows (`mr-math_invalid_errors.json` or `mr-math_redundant_errors.json`).

    Both files are JSON Lines despite the extension. A step is its lines joined by newlines.

    * invalid errors (rows with `model_output_solution_first_error_step`, 1-based or "N/A"):
      steps before the first error are 1, the first error is 0, and every step after it is 0
      too: once a process has gone wrong it does not become valid again (the Math-Shepherd /
      ProcessBench convention). category "invalid_errors", label_kind "validity".
    * redundant errors (rows with `rating`): the label is the rating, 1 useful and 0 correct
      but redundant. category "redundant_errors", label_kind "redundancy", first_error None.

    The id is `"reasoneval-<kind>-<id>"`.
    """
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    for lineno, obj, err in iter_jsonl(path):
        if err:
            problems.append(f"{path}:{lineno}: id=?: line: {err}")
            continue
        fmt = obj.get("model_output_step_format")
        kind = "redundant" if "rating" in obj else "invalid"
        where = f"{path}:{lineno}: id={row_id(obj)}"
        if not isinstance(fmt, list) or not fmt or not all(_str_list(s) for s in fmt):
            problems.append(
                f"{where}: model_output_step_format: missing or malformed "
                "(must be a non-empty list of steps, each a list of line strings)"
            )
            continue
        if not isinstance(obj.get("question"), str):
            problems.append(f"{where}: question: missing (the problem text)")
            continue
        steps = ["\n".join(lines) for lines in fmt]
        if kind == "redundant":
            rating = obj["rating"]
            if not isinstance(rating, list) or len(rating) != len(steps) or any(r not in (0, 1) for r in rating):
                problems.append(f"{where}: rating: must be one 0/1 per step ({len(steps)} steps)")
                continue
            labels = [float(r) for r in rating]
            first = None
        else:
            fe = obj.get("model_output_solution_first_error_step")
            if fe == "N/A":
                first = None
            elif isinstance(fe, int) and not isinstance(fe, bool) and 1 <= fe <= len(steps):
                first = fe - 1
            else:
                problems.append(
                    f"{where}: model_output_solution_first_error_step: {fe!r} is not a step "
                    f'number in 1..{len(steps)} or "N/A"'
                )
                continue
            labels = [1.0 if first is None or i < first else 0.0 for i in range(len(steps))]
        meta: dict[str, Any] = {
            "source": "reasoneval",
            "category": f"{kind}_errors",
            "label_kind": "redundancy" if kind == "redundant" else "validity",
            "source_id": obj.get("id"),
            "first_error": first,
            "generator": obj.get("generator"),
        }
        if isinstance(obj.get("ground_truth_answer"), str):
            meta["gold_answer"] = obj["ground_truth_answer"]
        rows.append(
            {
                "id": f"reasoneval-{kind}-{obj.get('id')}",
                "question": obj["question"],
                "steps": steps,
                "images": [],
                "labels": labels,
                "answer": None,
                "meta": meta,
            }
        )
    if problems:
        raise DataError(problems)
    return rows
