"""MathVerse (testmini) as problems, with its problem versions kept, and MathVerse's answer rule.

Released rows (`data/testmini.json` of github:ZrrSkywalker/MathVerse: 788 problems x 5 versions;
`AI4Math/MathVerse`, config `testmini`, on the Hub, with the image itself in `image`)::

    {"sample_index": "3421", "problem_index": "685", "problem_version": "Text Dominant",
     "question": "...", "image": "images_version_1-4/image_685.png", "answer": "14" | "C",
     "question_type": "free-form" | "multi-choice",
     "metadata": {"split", "source", "subject", "subfield"}, "query_wo": "...", "query_cot": "..."}

The question is `query_cot` (the CoT prompt MathVerse and MM-PRM use). One problem appears once per
version (Text Dominant, Text Lite, Vision Intensive, Vision Dominant, Vision Only; Text Only in
`testmini_text_only.json`, without an image): `meta["problem_version"]` keeps it so that a report
gives the accuracy per version, as MathVerse's score_answer_s2.py does.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mmprm.answers import answers_match, choice_letter
from mmprm.data.eval_sets._source import check_exists, image_file, load_rows, require_fields

BREAKDOWN = ("problem_version", "subject", "subfield", "question_type")
_CHOICE_LINE = re.compile(r"^\s*\(?([A-H])\)?\s*[:.：]\s*(.+?)\s*$")


def mathverse_choices(question: str) -> list[str] | None:
    """The option texts listed after "Choices:" ("A:50°" lines), or None (e.g. drawn in the image)."""
    head, sep, tail = question.partition("Choices:")
    if not sep:
        return None
    found = []
    for line in tail.splitlines():
        m = _CHOICE_LINE.match(line)
        if m and m.group(1) == chr(65 + len(found)):
            found.append(m.group(2))
    return found or None


def read_mathverse(
    source: str | Path,
    split: str = "testmini",
    image_root: str | Path | None = None,
    image_dir: str | Path | None = None,
) -> list[dict[str, Any]]:
    """MathVerse samples `{id, question, images, answer, choices, meta}` (one per problem version).

    Args:
        source: `testmini.json` or `testmini_text_only.json` (or their folder), a parquet or
            `save_to_disk` copy, or `AI4Math/MathVerse` (the Hub's config is the split's name).
        split: `testmini` or `testmini_text_only`.
        image_root: where the rows' `images_version_*/...` paths start (default: the file's folder).
        image_dir: where images held in the rows (the Hub's `image`) are written.
    """
    rows, root = load_rows(source, split, (f"{split}.json",), config=split)
    root = Path(image_root).resolve() if image_root is not None else root
    out_dir = Path(image_dir) if image_dir is not None else None
    problems = []
    need = ("sample_index", "problem_index", "problem_version", "question", "question_type", "answer")
    for n, r in enumerate(rows):
        require_fields(r, need, source, n, "sample_index")
        sid = str(r["sample_index"])
        images = []
        if r.get("image") not in (None, ""):  # Text Only rows have no image
            image = image_file(r["image"], root, out_dir, f"mathverse-{sid}")
            images.append(str(check_exists(image, f"{source}: sample_index={sid}", "unzip MathVerse's images there")))
        md = r.get("metadata") or {}
        if isinstance(md, str):  # some exports keep it as the text of a dict
            import ast

            md = ast.literal_eval(md)
        mc = r["question_type"] == "multi-choice"
        problems.append(
            {
                "id": sid,
                "question": r.get("query_cot") or r.get("query") or r["question"],
                "images": images,
                "answer": str(r["answer"]),
                "choices": mathverse_choices(r["question"]) if mc else None,
                "meta": {
                    "source": "mathverse",
                    "split": split,
                    "problem_index": str(r["problem_index"]),
                    "problem_version": r["problem_version"],
                    "question_type": r["question_type"],
                    "subject": md.get("subject"),
                    "subfield": md.get("subfield"),
                    "origin": md.get("source"),
                    "question": r["question"],  # MathVerse's LLM judge reads the raw question
                    "breakdown": list(BREAKDOWN),
                },
            }
        )
    return problems


def mathverse_correct(pred: str | None, answer: str, choices: list[str] | None, meta: dict[str, Any]) -> bool:
    """Whether an extracted answer scores as correct on MathVerse.

    MathVerse's quick match is string equality; otherwise a GPT judge decides, told that a
    multiple-choice answer is right only when it is the right option, and that a free-form answer
    is right when it means the same. Re-expressed: equal text; multi-choice, the named letter (or the
    option's own text) against the gold letter; free-form, `mmprm.answers.answers_match`.
    """
    if pred is None or not pred.strip():
        return False
    if pred.strip() == answer.strip():
        return True
    if meta.get("question_type") == "multi-choice":
        # "B:2√3" names option B, as MathVerse lists its options
        named = re.match(r"\(?([A-H])\)?\s*[:.]", pred.strip())
        letter = named.group(1) if named else choice_letter(pred)
        if letter is not None:
            return letter == choice_letter(answer)
        idx = ord(choice_letter(answer) or "?") - 65
        return bool(choices) and 0 <= idx < len(choices) and answers_match(pred, choices[idx])
    return answers_match(pred, answer)
