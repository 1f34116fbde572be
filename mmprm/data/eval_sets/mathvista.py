"""MathVista (testmini, test) as problems, and MathVista's own answer rule.

Released rows (`data/testmini.json` of github:lupantech/MathVista, an object keyed by pid; the Hub's
`AI4Math/MathVista` has the same columns plus `query` and `decoded_image`)::

    {"pid": "3", "question": "...", "image": "images/3.jpg", "choices": ["135°", ...] | null,
     "unit": "g" | null, "precision": 1 | null, "answer": "145°",
     "question_type": "multi_choice" | "free_form", "answer_type": "text" | "integer" | "float" | "list",
     "metadata": {"language", "source", "category", "task", "context", "grade", "skills": [...]}}

The question fed to the model is MathVista's `query` (its hint, the question, the unit and the
lettered choices), taken from the row or from `query.json` beside the file, as MM-PRM does.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from mmprm.answers import normalize_answer
from mmprm.data.eval_sets._source import check_exists, image_file, load_rows, require_fields
from mmprm.data.registry import register_reader

_LETTER = re.compile(r"\(([a-zA-Z])\)")

# The columns MathVista's calculate_score.py breaks accuracy down by (`origin` is its `source`).
BREAKDOWN = ("question_type", "answer_type", "language", "origin", "category", "task", "context", "grade", "skills")


@register_reader("answer_benchmark", "mathvista")
def read_mathvista(
    source: str | Path,
    split: str = "testmini",
    image_root: str | Path | None = None,
    image_dir: str | Path | None = None,
) -> list[dict[str, Any]]:
    """MathVista problems `{id, question, images, answer, choices, meta}`, in the file's order.

    Args:
        source: `testmini.json` (or its folder), a parquet/`save_to_disk` copy, or `AI4Math/MathVista`.
        split: `testmini` or `test` (the test split has no answers).
        image_root: where the rows' `images/<pid>.jpg` paths start (default: the file's folder).
        image_dir: where images held in the rows (`decoded_image` from the Hub) are written.
    """
    rows, data_root = load_rows(source, split, (f"{split}.json",))
    root = Path(image_root).resolve() if image_root is not None else data_root
    queries: dict[str, str] = {}
    # query.json ships beside testmini.json in MathVista's data/, wherever the images were unzipped.
    if data_root is not None and (data_root / "query.json").is_file():
        queries = json.loads((data_root / "query.json").read_text(encoding="utf-8"))
    out_dir = Path(image_dir) if image_dir is not None else None
    problems = []
    need = ("pid", "question", "question_type", "answer_type") + (("answer",) if split != "test" else ())
    for n, r in enumerate(rows):
        require_fields(r, need, source, n, "pid")
        if r.get("image") is None and r.get("decoded_image") is None:
            require_fields(r, ("image",), source, n, "pid")
        pid = str(r["pid"])
        value = r["decoded_image"] if r.get("decoded_image") is not None else r["image"]
        image = image_file(value, root, out_dir, f"mathvista-{pid}")
        check_exists(image, f"{source}: pid={pid}", "unzip MathVista's images.zip there, or pass image_root=")
        md = r.get("metadata") or {}
        problems.append(
            {
                "id": pid,
                "question": r.get("query") or queries.get(pid) or mathvista_query(r),
                "images": [str(image)],
                "answer": str(r.get("answer") or ""),
                "choices": list(r["choices"]) if r.get("choices") else None,
                "meta": {
                    "source": "mathvista",
                    "split": split,
                    "question_type": r["question_type"],
                    "answer_type": r["answer_type"],
                    "precision": r.get("precision"),
                    "unit": r.get("unit"),
                    "language": md.get("language"),
                    "origin": md.get("source"),
                    "category": md.get("category"),
                    "task": md.get("task"),
                    "context": md.get("context"),
                    "grade": md.get("grade"),
                    "skills": list(md.get("skills") or []),
                    "breakdown": list(BREAKDOWN),
                },
            }
        )
    return problems


def mathvista_query(row: dict[str, Any]) -> str:
    """The question with its unit and lettered choices, when no `query` is at hand."""
    text = row["question"]
    if row.get("unit"):
        text += f" (Unit: {row['unit']})"
    if row.get("choices"):
        text += "\nChoices:\n" + "\n".join(f"({chr(65 + i)}) {c}" for i, c in enumerate(row["choices"]))
    return text


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions each cost 1)."""
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        cur = [i]
        for j, cb in enumerate(b, start=1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def mathvista_prediction(
    extraction: str, choices: list[str] | None, question_type: str, answer_type: str, precision: float | None
) -> str | None:
    """MathVista's normalisation of an extracted answer (calculate_score.py), before `==` with the answer.

    multi_choice: the first "(X)", X an ASCII letter, names a letter; a letter of the choices gives
    that choice's text; anything else, an empty extraction too, gives the choice with the least edit
    distance (first on ties). integer: `int(float(x))`; float: `round(float(x), int(precision))`,
    so a row without a precision never scores; list: the text. None when the number does not parse.
    """
    if question_type == "multi_choice":
        text = str(extraction).strip()
        letters = [chr(65 + i) for i in range(len(choices or []))]
        named = _LETTER.search(text)  # "(B) 12" -> "B"; "(é)" names no option
        if named:
            text = named.group(1).upper()
        if text in letters:
            return (choices or [])[letters.index(text)]
        dists = [edit_distance(text, c) for c in choices or []]
        return (choices or [])[dists.index(min(dists))] if dists else None
    try:
        if answer_type == "integer":
            return str(int(float(extraction)))
        if answer_type == "float":
            return str(round(float(extraction), int(precision)))  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return None
    return str(extraction)


def mathvista_correct(pred: str | None, answer: str, choices: list[str] | None, meta: dict[str, Any]) -> bool:
    """Whether an extracted answer scores as correct on MathVista.

    MathVista extracts answers with GPT, which drops units and formatting; here the rule-based
    extraction is cleaned the same way for free-form answers (math delimiters, `\\text{}`,
    thousands commas, the row's unit) before MathVista's normalisation and exact comparison.
    No extraction (None) is MathVista's empty extraction: calculate_score.py, by default, still maps
    it to the nearest choice of a multiple-choice question, so it can score there.
    """
    pred = "" if pred is None else pred
    if meta["question_type"] != "multi_choice" and meta["answer_type"] in ("integer", "float"):
        unit = (meta.get("unit") or "").strip()
        if unit and pred.strip().endswith(unit):
            pred = pred.strip()[: -len(unit)]
        pred = normalize_answer(pred)
    prediction = mathvista_prediction(pred, choices, meta["question_type"], meta["answer_type"], meta.get("precision"))
    return prediction is not None and prediction == answer
