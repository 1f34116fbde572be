"""MATH-Vision (MATH-V) testmini from its folder: `mmprm.data.eval_sets.mathvision` is the one reader.

Kept for the callers that take a MATH-V folder (`testmini.jsonl` and `images/`, as `data/mathv`):
the rows, the question adaptation and the errors are `read_mathvision`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mmprm.data.eval_sets.mathvision import has_option_texts, mathv_question, read_mathvision


def read_mathv(mathv_dir: str | Path) -> list[dict[str, Any]]:
    """MATH-V testmini problems, in file order, each `{id, question, images, answer, choices, solution, meta}`.

    Args:
        mathv_dir: folder holding `testmini.jsonl` and `images/` (e.g. `data/mathv`, the repo subset).
    """
    path = Path(mathv_dir).resolve() / "testmini.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found (pass the MATH-V folder that holds testmini.jsonl)")
    return read_mathvision(path.parent, split="testmini")


__all__ = ["has_option_texts", "mathv_question", "read_mathv"]
