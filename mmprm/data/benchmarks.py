"""Readers for step-level PRM benchmarks: PRMBench, ReasonEval (Meta-Reasoning-MATH), ProcessBench
and VisualProcessBench.

Each reader returns `StepExample`-compatible dicts (`StepExample(**row)` works, and
`write_jsonl` writes them in the mmprm schema)::

    {"id": str, "question": str, "steps": [str], "images": [], "labels": [float],
     "answer": None, "meta": {"source", "category", "label_kind", "first_error", ...}}

`answer` stays None because the final answer is already inside the last step; the gold answer,
when the benchmark has one, is `meta["gold_answer"]`. `meta["first_error"]` is the 0-based
first error step or None, ready for `mmprm.scoring.metrics.first_error_f1`.
`meta["label_kind"]` says what a 0 means: "validity" (the step is wrong) or "redundancy"
(the step is right but useless); do not pool the two in one metric. `meta["neutral_steps"]`, where
present, lists the 0-based steps the benchmark leaves out of its step metrics (VisualProcessBench's
neutral steps); they carry label 1 so they never count as a first error.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from mmprm.data.registry import register_reader
from mmprm.data.schema import DataError, StepExample, check_image, iter_jsonl, load_examples, row_id
from mmprm.steps import IMAGE_PLACEHOLDER

PROCESSBENCH_SUBSETS = ("gsm8k", "math", "olympiadbench", "omnimath")
"""ProcessBench's splits, each released as `<subset>.json` (Qwen/ProcessBench on the HF Hub)."""


def _str_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(s, str) for s in x)


def read_prmbench(path: str | Path) -> list[dict[str, Any]]:
    """PRMBench rows (e.g. `prmbench/target_data.jsonl`) as labelled step examples.

    Steps are `modified_process` and the question is `modified_question` (the problem those
    steps solve; it differs from the original for e.g. missing_condition). Labels: 0 for every
    step listed in the 1-based `error_steps`, 1 otherwise; steps after an error keep 1, as in
    PRMBench's own per-step scoring. Indices past the last step (11 rows of the classified
    subset) are dropped and kept in `meta["dropped_error_steps"]`; a number below 1 (0-based by
    mistake) is an error. The id is `"<idx>/<classification>"` because `idx` repeats across
    categories; a repeated row is an error, as in every reader here.
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
        if any(e < 1 for e in obj["error_steps"]):  # 0-based by mistake: every label would shift by one
            problems.append(f"{where}: error_steps: {obj['error_steps']} has a step number below 1 (they are 1-based)")
            continue
        errs = sorted({e - 1 for e in obj["error_steps"] if e <= len(steps)})
        dropped = [e for e in obj["error_steps"] if e > len(steps)]
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
    problems += repeated_ids(path, rows)
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
        missing = [f for f in ("question", "id") if not isinstance(obj.get(f), str if f == "question" else (str, int))]
        if missing:  # the id names the row in the report and groups it for the dev split
            problems += [f"{where}: {f}: missing (MR-MATH rows carry it)" for f in missing]
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
    problems += repeated_ids(path, rows)
    if problems:
        raise DataError(problems)
    return rows


def repeated_ids(path: str | Path, rows: list[dict[str, Any]]) -> list[str]:
    """A problem line per id that more than one row has: a repeated row would count twice in every
    metric, and rows sharing an id cannot be told apart in the report."""
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["id"]] = counts.get(r["id"], 0) + 1
    return [
        f"{path}: id={rid}: id: {n} rows have it (each row once, with its own id: drop the repeats)"
        for rid, n in counts.items()
        if n > 1
    ]


def _json_rows(path: Path) -> list[tuple[int, dict[str, Any] | None, str | None]]:
    """(position, row, error) per row of a JSON array file (1-based element) or a JSON Lines file (line)."""
    # A UTF-8 byte order mark (some editors save one) is not JSON: skip it when telling the kinds apart.
    if path.is_dir() or path.read_bytes().removeprefix(b"\xef\xbb\xbf").lstrip()[:1] != b"[":
        return list(iter_jsonl(path))
    try:
        data = json.loads(path.read_bytes().decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return [(0, None, f"invalid JSON array: {e} (use the file as released, or JSON Lines)")]
    return [(i, r, None) if isinstance(r, dict) else (i, None, "not a JSON object") for i, r in enumerate(data, 1)]


def read_processbench(path: str | Path) -> list[dict[str, Any]]:
    """ProcessBench rows (Qwen/ProcessBench) as labelled step examples.

    `path` is one subset file as released (`gsm8k.json`: a JSON array; JSON Lines, as
    `datasets.Dataset.to_json` writes, works too) or a folder holding any of `gsm8k.json`,
    `math.json`, `olympiadbench.json`, `omnimath.json`. A row is
    `{"id": "gsm8k-0", "generator", "problem", "steps": [str], "final_answer_correct", "label"}`
    where `label` is the 0-based earliest wrong step, -1 when every step is right.

    Labels: steps before `label` are 1, the labelled step and every later one 0 (the solution
    does not become valid again; ProcessBench itself scores only the first error). The
    category is the subset, the id's prefix (`gsm8k-0` -> gsm8k).
    """
    path = Path(path)
    if path.is_dir():
        files = [path / f"{s}.json" for s in PROCESSBENCH_SUBSETS if (path / f"{s}.json").is_file()]
        if not files:
            raise DataError([f"{path}: no ProcessBench subset file ({', '.join(PROCESSBENCH_SUBSETS)}.json)"])
    else:
        files = [path]
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    for file in files:
        for pos, obj, err in _json_rows(file):
            if err:
                problems.append(f"{file}:{pos}: id=?: row: {err}")
                continue
            where = f"{file}:{pos}: id={row_id(obj)}"
            steps, label = obj.get("steps"), obj.get("label")
            bad = False
            for fld, ok, what in (
                ("id", isinstance(obj.get("id"), str) and "-" in obj["id"], 'a string like "gsm8k-0"'),
                ("problem", isinstance(obj.get("problem"), str), "the problem text"),
                ("steps", _str_list(steps) and steps, "a non-empty list of step strings"),
                (
                    "label",
                    isinstance(label, int) and not isinstance(label, bool) and -1 <= label < len(steps or []),
                    f"the 0-based first wrong step in 0..{len(steps or []) - 1}, or -1 when all are right",
                ),
            ):
                if not ok:
                    problems.append(f"{where}: {fld}: missing or malformed (must be {what})")
                    bad = True
            if bad:
                continue
            first = None if label == -1 else label
            rows.append(
                {
                    "id": obj["id"],
                    "question": obj["problem"],
                    "steps": list(steps),
                    "images": [],
                    "labels": [1.0 if first is None or i < first else 0.0 for i in range(len(steps))],
                    "answer": None,
                    "meta": {
                        "source": "processbench",
                        "category": obj["id"].rsplit("-", 1)[0],
                        "label_kind": "validity",
                        "source_id": obj["id"],
                        "first_error": first,
                        "generator": obj.get("generator"),
                        "final_answer_correct": obj.get("final_answer_correct"),
                    },
                }
            )
    problems += repeated_ids(path, rows)
    if problems:
        raise DataError(problems)
    return rows


def _image_problem(images: list[str], path: Path, checked: dict[Path, str | None]) -> str | None:
    """Why a VisualProcessBench row's images cannot be used (missing, or not an image), or None;
    each file is opened once per `checked`, however many responses share it."""
    for image in images:
        if not Path(image).is_file():
            return f"not found: {image} (unzip images.zip beside {path.name})"
        if why := check_image(Path(image), checked):
            return why
    return None


def read_visualprocessbench(path: str | Path, check_images: bool = True) -> list[dict[str, Any]]:
    """VisualProcessBench rows (OpenGVLab/VisualProcessBench `test.jsonl`) as labelled step examples.

    A row is `{"image": [path], "question", "answer", "response": {"steps": [str],
    "process_correctness": [1 | 0 | -1]}, "policy_model", "data_source"}`; images are relative to
    the file's folder (unzip `images.zip` beside `test.jsonl`). `process_correctness` is 1 correct,
    -1 incorrect, 0 neutral (no reasoning in the step). Labels: 1 -> 1.0, -1 -> 0.0, neutral ->
    1.0 and listed in `meta["neutral_steps"]`, which the benchmark's F1 leaves out. Unlike
    ProcessBench, a step after an error keeps its own label (the benchmark asks for every wrong
    step). The category is `data_source`; rows have no id, so the id is `vpb-<line>`, and
    `meta["source_id"]` groups the responses to one question (for dev/test splits). Image
    placeholders in the question that do not match the image count are dropped.
    """
    path = Path(path)
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    image_checks: dict[Path, str | None] = {}
    for lineno, obj, err in iter_jsonl(path):
        if err:
            problems.append(f"{path}:{lineno}: id=?: line: {err}")
            continue
        rid = str(obj["id"]) if isinstance(obj.get("id"), (str, int)) else f"vpb-{lineno}"
        where = f"{path}:{lineno}: id={rid}"
        resp = obj.get("response") if isinstance(obj.get("response"), dict) else {}
        steps, marks = resp.get("steps"), resp.get("process_correctness")
        images = [obj["image"]] if isinstance(obj.get("image"), str) else obj.get("image", [])
        bad = False
        for fld, ok, what in (
            ("question", isinstance(obj.get("question"), str), "the question text"),
            ("image", _str_list(images), "a list of image paths relative to the file"),
            ("response.steps", _str_list(steps) and steps, "a non-empty list of step strings"),
            (
                "response.process_correctness",
                isinstance(marks, list)
                and len(marks) == len(steps or [])
                and all(m in (1, 0, -1) and not isinstance(m, bool) for m in marks),
                f"one of 1 / 0 / -1 per step ({len(steps or [])} steps)",
            ),
            ("data_source", isinstance(obj.get("data_source"), str), "the benchmark the question comes from"),
        ):
            if not ok:
                problems.append(f"{where}: {fld}: missing or malformed (must be {what})")
                bad = True
        if bad:
            continue
        resolved = [str(p if Path(p).is_absolute() else path.parent / p) for p in images]
        if check_images and (why := _image_problem(resolved, path, image_checks)):
            problems.append(f"{where}: image: {why}")
            continue
        question = obj["question"]
        if len(IMAGE_PLACEHOLDER.findall(question)) not in (0, len(resolved)):
            question = IMAGE_PLACEHOLDER.sub("", question).strip()
        key = json.dumps([obj["data_source"], obj["question"], images])
        errors = [i for i, m in enumerate(marks) if m == -1]
        meta: dict[str, Any] = {
            "source": "visualprocessbench",
            "category": obj["data_source"],
            "label_kind": "validity",
            "source_id": hashlib.sha1(key.encode("utf-8")).hexdigest()[:12],
            "first_error": errors[0] if errors else None,
            "error_steps": errors,
            "neutral_steps": [i for i, m in enumerate(marks) if m == 0],
            "policy_model": obj.get("policy_model"),
            **({"gold_answer": obj["answer"]} if isinstance(obj.get("answer"), str) else {}),
        }
        rows.append(
            {
                "id": rid,
                "question": question,
                "steps": list(steps),
                "images": resolved,
                "labels": [0.0 if m == -1 else 1.0 for m in marks],
                "answer": None,
                "meta": meta,
            }
        )
    problems += repeated_ids(path, rows)
    if problems:
        raise DataError(problems)
    return rows


# The step_benchmark readers of `mmprm.data.readers`: labelled examples, each benchmark row's
# category and first error kept in `meta`.


@register_reader("step_benchmark", "steps")
def steps_examples(path: str | Path, check_images: bool = True) -> list[StepExample]:
    """Our step-labelled JSONL (`mmprm.data.schema`), every step labelled."""
    return load_examples(path, require_labels=True, check_images=check_images)


@register_reader("step_benchmark", "prmbench")
def prmbench_examples(path: str | Path, check_images: bool = True) -> list[StepExample]:
    """PRMBench rows (`read_prmbench`) as examples; text only, so `check_images` has nothing to check."""
    return [StepExample(**r) for r in read_prmbench(path)]


@register_reader("step_benchmark", "reasoneval")
def reasoneval_examples(path: str | Path, check_images: bool = True) -> list[StepExample]:
    """ReasonEval MR-MATH rows (`read_reasoneval`) as examples; text only."""
    return [StepExample(**r) for r in read_reasoneval(path)]


@register_reader("step_benchmark", "processbench")
def processbench_examples(path: str | Path, check_images: bool = True) -> list[StepExample]:
    """ProcessBench rows (`read_processbench`) as examples; text only."""
    return [StepExample(**r) for r in read_processbench(path)]


@register_reader("step_benchmark", "visualprocessbench")
def visualprocessbench_examples(path: str | Path, check_images: bool = True) -> list[StepExample]:
    """VisualProcessBench rows (`read_visualprocessbench`) as examples."""
    return [StepExample(**r) for r in read_visualprocessbench(path, check_images=check_images)]
