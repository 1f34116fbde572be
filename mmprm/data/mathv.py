"""MATH-Vision (MATH-V) problems as mmprm reads them.

`testmini.jsonl` rows are `{"id", "question", "options", "answer", "solution", "level",
"subject", "image"}` with one image per problem (`images/<id>.jpg`, relative to the folder).
Two things are adapted so the rows fit `mmprm.steps`:

- 58 questions do not hold exactly one `<imageK>` placeholder: some name parts of the one
  composite figure (`<image1>` ... `<image7>`), repeat one, or have none. Their placeholders become
  text (`[image K]`) and the image goes before the question, as for a question with none.
- Options that are texts (`["$25^\\circ$", ...]`) are appended as "Choices: (A) ... (B) ...";
  bare letters (`["A", ..., "E"]`) are not, since the choices are drawn in the image.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mmprm.steps import IMAGE_PLACEHOLDER


def has_option_texts(options: list[str]) -> bool:
    """True unless the options are just their own letters (A, B, C, ...)."""
    return bool(options) and any(o.strip().strip("()") != chr(65 + i) for i, o in enumerate(options))


def mathv_question(question: str, options: list[str]) -> str:
    """The question as mmprm feeds it: at most one image placeholder, option texts appended."""
    if has_option_texts(options):
        listed = " ".join(f"({chr(65 + i)}) {o}" for i, o in enumerate(options))
        question = f"{question}\nChoices: {listed}"
    # Options may be placeholders themselves ("(A) <image2>"), so count after appending them.
    if len(IMAGE_PLACEHOLDER.findall(question)) > 1:
        question = IMAGE_PLACEHOLDER.sub(lambda m: f"[image {m.group(1) or 1}]", question)
    return question


def read_mathv(mathv_dir: str | Path) -> list[dict[str, Any]]:
    """MATH-V problems, in file order, each `{id, question, images, answer, choices, solution, meta}`.

    Args:
        mathv_dir: folder holding `testmini.jsonl` and `images/` (e.g. `data/mathv`, the repo subset).

    `images` are absolute paths; `choices` is the options list or None for free-form answers.
    """
    root = Path(mathv_dir).resolve()
    path = root / "testmini.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path}: not found (pass the MATH-V folder that holds testmini.jsonl)")
    problems = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            r = json.loads(line)
            image = root / r["image"]
            if not image.exists():
                raise FileNotFoundError(
                    f"{path}:{lineno}: id={r['id']}: image: {image} not found "
                    "(copy MATH-V's images/ folder next to testmini.jsonl)"
                )
            problems.append(
                {
                    "id": str(r["id"]),
                    "question": mathv_question(r["question"], r["options"]),
                    "images": [str(image)],
                    "answer": str(r["answer"]),
                    "choices": list(r["options"]) or None,
                    "solution": r.get("solution"),
                    "meta": {"source": "mathv", "level": r.get("level"), "subject": r.get("subject")},
                }
            )
    return problems
