"""MM-K12's test split (MM-PRM's in-domain benchmark) as problems, and the answer rule MM-PRM uses.

MM-PRM reads its problems as a JSON list of `{"id", "question", "correct_answer", "image_path"}`
(its README's seed format; eval/prm/evaluate_k12_prm.py opens `image_path` under the images'
root). `Cierra0506/MM-K12` on the Hub: `answer` and an in-memory `image` are read as well, in
case the Hub copy names them so; `subject`, when present, is kept for the breakdown.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mmprm.answers import answers_match
from mmprm.data.eval_sets._source import check_exists, image_file, load_rows, require_fields
from mmprm.data.registry import register_reader

BREAKDOWN = ("subject",)


@register_reader("answer_benchmark", "mmk12")
def read_mmk12(
    source: str | Path,
    split: str = "test",
    image_root: str | Path | None = None,
    image_dir: str | Path | None = None,
) -> list[dict[str, Any]]:
    """MM-K12 problems `{id, question, images, answer, choices, meta}`, in file order.

    Args:
        source: `<split>.json` (or `.jsonl`, or its folder), a parquet or `save_to_disk` copy, or
            `Cierra0506/MM-K12`.
        split: `test` (MM-PRM's evaluation split) or `train`.
        image_root: where `image_path` starts (default: the file's folder).
        image_dir: where images held in the rows are written.
    """
    rows, root = load_rows(source, split, (f"{split}.json", f"{split}.jsonl"))
    root = Path(image_root).resolve() if image_root is not None else root
    out_dir = Path(image_dir) if image_dir is not None else None
    problems = []
    for n, r in enumerate(rows):
        require_fields(r, ("question",), source, n, "id")
        rid = str(r.get("id", n))
        value = r.get("image_path") if r.get("image_path") is not None else r.get("image")
        images = []
        if value is not None and value != "":
            image = image_file(value, root, out_dir, f"mmk12-{rid}")
            images.append(str(check_exists(image, f"{source}: id={rid}", "copy MM-K12's images there")))
        answer = r.get("correct_answer", r.get("answer"))
        if answer is None:
            raise ValueError(f"{source}: id={rid}: correct_answer: missing (MM-K12 rows carry the gold answer)")
        problems.append(
            {
                "id": rid,
                "question": r["question"],
                "images": images,
                "answer": str(answer),
                "choices": None,
                "meta": {
                    "source": "mmk12",
                    "split": split,
                    "subject": r.get("subject"),
                    "breakdown": list(BREAKDOWN) if r.get("subject") is not None else [],
                },
            }
        )
    return problems


def mmk12_correct(pred: str | None, answer: str, choices: list[str] | None, meta: dict[str, Any]) -> bool:
    """Whether an extracted answer is correct, as MM-PRM labels its MM-K12 solutions.

    MM-PRM asks an LLM judge whether the model's answer means the gold answer, ignoring formatting
    (LaTeX, `\\boxed`, `$`); `mmprm.answers.answers_match` is that comparison done by rules
    (normalised text, option letters, numbers, then math-verify).
    """
    return answers_match(pred, answer, choices)
