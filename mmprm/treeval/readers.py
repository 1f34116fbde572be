"""Readers of reasoning trees and of RPTS-Eval, registered in `mmprm.data.readers`.

tree_format readers (`recipes/tree_eval.py`'s `data.format`), each
`(path, image_dir=None, response_field="response") -> Iterator[item]`, one item at a time::

    {"id": str, "tree": Tree, "correct": bool | None, "reference": gold answer or None,
     "where": "<file>:<line>: id=<id>" for messages}

    rpts      RPTS-Eval texts (`texts_en.json`, or JSONL of its records): the gold reasoning's tree
    think360  JSONL rows whose `response_field` holds `[NODE:...]` blocks
    steps     our step JSONL (`mmprm.data.schema`): a chain
    mc_tree   openr / MCTS annotation trees with MC values

RPTS-Eval is read here only (`rpts_records`): the tree reader above and the answer_benchmark
reader `rpts` (its problems, for `recipes/reasoning_eval.py`) both go through it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from mmprm.data.registry import register_reader
from mmprm.data.schema import DataError, iter_jsonl, row_id, scan_examples
from mmprm.treeval.builders import from_annotation_tree, from_rpts_record, from_steps, from_think360_blocks
from mmprm.treeval.extract import rpts_answer_prompt


def jsonl_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, row) for each row of a JSONL file, one at a time; a line that is not a JSON
    object stops the run, named."""
    for lineno, row, err in iter_jsonl(path):
        if err:
            raise DataError([f"{path}:{lineno}: id=?: line: {err}"])
        yield lineno, row


def rpts_records(path: str | Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """("file: item i" or "file:line", record) for each RPTS-Eval record: the released JSON array
    (`texts_en.json`), or a JSONL file of records."""
    path = Path(path)
    if path.suffix != ".json":
        yield from ((f"{path}:{n}", r) for n, r in jsonl_rows(path))
        return
    try:
        rows = json.loads(path.read_text(encoding="utf-8-sig"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError([f"{path}: not a JSON array of items ({e}); RPTS-Eval's texts_*.json is one"]) from None
    if not isinstance(rows, list):
        raise DataError([f"{path}: a JSON {type(rows).__name__}, where a JSON array of items is expected"])
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise DataError([f"{path}: item {i}: a JSON {type(r).__name__}, where an object is expected"])
        yield f"{path}: item {i}", r


def verdict(value: Any, where: str) -> bool | None:
    """A row's `correct`: true, false or absent. Text such as "false" is refused rather than read
    as true, which would count a wrong answer as right."""
    if value is None or isinstance(value, bool):
        return value
    if type(value) is int and value in (0, 1):
        return bool(value)
    raise DataError([f"{where}: correct: {value!r} is not true or false (write a JSON boolean, or leave it out)"])


def built(where: str, build: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """build(*args, **kwargs), its refusal of a malformed row named by file, line and id."""
    try:
        return build(*args, **kwargs)
    except (ValueError, TypeError, KeyError) as e:
        raise DataError([f"{where}: {e}"]) from None


@register_reader("tree_format", "rpts")
def rpts_trees(path: Path, image_dir: str | None = None, response_field: str = "response") -> Iterator[dict[str, Any]]:
    """The gold reasoning of each RPTS-Eval record as a tree; `image_dir` (default
    `<path folder>/images`) holds the visual clues."""
    image_dir = image_dir or str((path.parent / "images").resolve())
    for i, (where, r) in enumerate(rpts_records(path)):
        where = f"{where}: id={row_id(r)}"
        if not isinstance(r.get("reasoning"), list):
            raise DataError([f"{where}: reasoning: missing or not a list of step lines"])
        tree = built(where, from_rpts_record, r, image_dir=image_dir, source=f"{path.name}: id={row_id(r)}")
        gold = str(r.get("answer", "")).strip().lower()
        if "correct" in r:
            correct = verdict(r["correct"], where)
        elif "prediction" in r:
            correct = bool(gold) and str(r["prediction"]).strip().lower() == gold
        else:
            correct = True if gold else None  # gold reasoning reaches the gold answer
        yield {"id": str(r.get("id", i)), "tree": tree, "correct": correct, "reference": gold or None, "where": where}


@register_reader("tree_format", "think360")
def think360_trees(
    path: Path, image_dir: str | None = None, response_field: str = "response"
) -> Iterator[dict[str, Any]]:
    """A tree from the `[NODE:...]` blocks of each row's `response_field`; images relative to the file."""
    for i, (lineno, r) in enumerate(jsonl_rows(path)):
        source = f"{path.name}:{lineno}"  # the report's warnings name the file, not its folder
        where = f"{path}:{lineno}: id={row_id(r)}"
        if not isinstance(r.get(response_field), str):
            raise DataError(
                [f"{where}: {response_field}: missing; it must hold the [NODE:...] blocks (or set data.response_field)"]
            )
        images = [str((path.parent / p).resolve()) for p in r.get("images", [])]
        text, question = r[response_field], r.get("question", "")
        tree = built(where, from_think360_blocks, text, question=question, images=images, source=source)
        correct = verdict(r.get("correct"), where)
        yield {
            "id": str(r.get("id", i)),
            "tree": tree,
            "correct": correct,
            "reference": r.get("answer"),
            "where": where,
        }


@register_reader("tree_format", "steps")
def step_trees(path: Path, image_dir: str | None = None, response_field: str = "response") -> Iterator[dict[str, Any]]:
    """Each example of our step JSONL as a chain; `meta.correct` is its verdict."""
    problems = []  # every bad row is named, after the good ones before it were read
    for ex, lines in scan_examples(path, check_images=False):
        problems += lines
        if ex is not None and not problems:
            tree = from_steps(ex.steps, question=ex.question, images=ex.images)
            where = f"{path}: id={ex.id}"
            correct = verdict(ex.meta.get("correct"), f"{where}: meta")
            yield {"id": ex.id, "tree": tree, "correct": correct, "reference": ex.answer, "where": where}
    if problems:
        raise DataError(problems)


@register_reader("tree_format", "mc_tree")
def mc_trees(path: Path, image_dir: str | None = None, response_field: str = "response") -> Iterator[dict[str, Any]]:
    """Each annotation tree (openr / `recipes/mcts_annotate.py`), its nodes' MC values kept."""
    for i, (lineno, r) in enumerate(jsonl_rows(path)):
        rid = r.get("id", r.get("question_id", i))
        source, where = f"{path.name}:{lineno}", f"{path}:{lineno}: id={rid}"
        tree = built(where, from_annotation_tree, r, source=source)
        yield {
            "id": f"{rid}#{i}",
            "tree": tree,
            "correct": verdict(r.get("correct"), where),
            "reference": r.get("final_answer", r.get("answer")),
            "where": where,
        }


@register_reader("answer_benchmark", "rpts")
def rpts_problems(source: str | Path, image_root: str | Path | None = None) -> list[dict[str, Any]]:
    """RPTS-Eval records as problems: the statement to judge (`rpts_answer_prompt`), its gold
    verdict as `answer`, the gold reasoning as `solution` and the record in `meta["record"]`
    (the RPTS judge reads its clues). `image_root` (default `<file folder>/images`) holds the clues."""
    path = Path(source)
    root = Path(image_root) if image_root else path.parent / "images"
    out = []
    for where, r in rpts_records(path):
        missing = [k for k in ("id", "answer") if k not in r]
        if missing:
            raise DataError([f"{where}: id={row_id(r)}: {', '.join(missing)}: missing (an RPTS-Eval record has both)"])
        out.append(
            {
                "id": str(r["id"]),
                "question": rpts_answer_prompt(r),
                "answer": r["answer"],
                "choices": None,
                "images": [str((root / v).resolve()) for v in r.get("visual_clue", [])],
                "solution": "\n".join(r.get("reasoning", [])),
                "meta": {"source": "rpts", "record": r},
            }
        )
    return out
