"""MATH-Vision (test and testmini) as problems; the answer rule is `mmprm.answers.answers_match`.

Released rows (`data/test.jsonl`, `data/testmini.jsonl` of github:mathllm/MATH-V, images in the
repository's `images/`; `MathLLMs/MathVision` on the Hub, splits `test` and `testmini`, with the
image itself in `decoded_image`)::

    {"id": "4", "question": "...<image1>", "options": ["A", ..., "E"] | [], "answer": "E",
     "solution": null, "level": 3, "subject": "metric geometry - angle", "image": "images/4.jpg"}

The question is adapted as `mmprm.data.mathv.read_mathv` does (option texts appended, surplus
image placeholders made text).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mmprm.data.eval_sets._source import check_exists, image_file, load_rows, require_fields
from mmprm.data.mathv import mathv_question

BREAKDOWN = ("subject", "level")


def read_mathvision(
    source: str | Path,
    split: str = "testmini",
    image_root: str | Path | None = None,
    image_dir: str | Path | None = None,
) -> list[dict[str, Any]]:
    """MATH-V problems `{id, question, images, answer, choices, solution, meta}`, in file order.

    Args:
        source: `<split>.jsonl` or its folder (`data/mathv` here, or MATH-V's `data/`), a parquet or
            `save_to_disk` copy, or `MathLLMs/MathVision`.
        split: `testmini` (304 problems) or `test` (3,040).
        image_root: where `images/<id>.jpg` starts (default: the file's folder, else its parent,
            which is MATH-V's own layout).
        image_dir: where images held in the rows (`decoded_image`) are written.
    """
    rows, root = load_rows(source, split, (f"{split}.jsonl",))
    root = Path(image_root).resolve() if image_root is not None else root
    out_dir = Path(image_dir) if image_dir is not None else None
    problems = []
    for n, r in enumerate(rows):
        require_fields(r, ("id", "question", "answer"), source, n, "id")
        if r.get("image") is None and r.get("decoded_image") is None:
            require_fields(r, ("image",), source, n, "id")
        rid = str(r["id"])
        value = r["decoded_image"] if r.get("decoded_image") is not None else r["image"]
        image = image_file(value, root, out_dir, f"mathvision-{rid}")
        if isinstance(value, str) and not image.is_file() and root is not None and image_root is None:
            image = (root.parent / value).resolve()  # MATH-V's data/ folder, images/ beside it
        check_exists(image, f"{source}: id={rid}", "copy MATH-V's images/ folder there, or pass image_root=")
        options = list(r.get("options") or [])
        problems.append(
            {
                "id": rid,
                "question": mathv_question(r["question"], options),
                "images": [str(image)],
                "answer": str(r["answer"]),
                "choices": options or None,
                "solution": r.get("solution"),
                "meta": {
                    "source": "mathv",
                    "split": split,
                    "level": r.get("level"),
                    "subject": r.get("subject"),
                    "breakdown": list(BREAKDOWN),
                },
            }
        )
    return problems
