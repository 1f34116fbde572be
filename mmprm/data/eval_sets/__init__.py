"""Answer benchmarks read into problems: MathVista, MathVerse, MATH-Vision, OlympiadBench, MM-K12.

Not to be confused with `mmprm.data.benchmarks` (step-level PRM benchmarks, labelled steps).
Each reader takes the benchmark's released file, its folder, a `save_to_disk` / parquet copy or a
Hub dataset id, and returns problems rows (`mmprm.data.problems`)::

    {"id", "question", "images": [absolute paths], "answer", "choices": [...] | None,
     "meta": {"source": "mathvista", <the benchmark's category columns>, "breakdown": [their names]}}

`answer_correct(pred, problem)` scores an extracted answer by the rule of the problem's own
benchmark (`meta["source"]`); `meta["breakdown"]` names the columns its own report breaks accuracy
down by. `write_problems` / `mmprm eval-set` write a problems.jsonl the recipes read.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mmprm.answers import answers_match
from mmprm.data.eval_sets.mathverse import mathverse_correct, read_mathverse
from mmprm.data.eval_sets.mathvision import mathvision_correct, read_mathvision
from mmprm.data.eval_sets.mathvista import mathvista_correct, read_mathvista
from mmprm.data.eval_sets.mmk12 import mmk12_correct, read_mmk12
from mmprm.data.eval_sets.olympiadbench import olympiadbench_correct, read_olympiadbench

Rule = Callable[[str | None, str, list[str] | None, dict[str, Any]], bool]

# name -> (reader, default split, Hub id)
READERS: dict[str, tuple[Callable[..., list[dict[str, Any]]], str, str]] = {
    "mathvista": (read_mathvista, "testmini", "AI4Math/MathVista"),
    "mathverse": (read_mathverse, "testmini", "AI4Math/MathVerse"),
    "mathvision": (read_mathvision, "testmini", "MathLLMs/MathVision"),
    "olympiadbench": (read_olympiadbench, "train", "Hothan/OlympiadBench"),
    "mmk12": (read_mmk12, "test", "Cierra0506/MM-K12"),
}


def _default_correct(pred: str | None, answer: str, choices: list[str] | None, meta: dict[str, Any]) -> bool:
    return answers_match(pred, answer, choices)


# name (a problem's meta["source"]) -> its answer rule
RULES: dict[str, Rule] = {
    "mathvista": mathvista_correct,
    "mathverse": mathverse_correct,
    "mathvision": mathvision_correct,
    "mathv": mathvision_correct,  # deprecated: the source name of problems files written before
    "olympiadbench": olympiadbench_correct,
    "mmk12": mmk12_correct,
}


def answer_correct(pred: str | None, problem: Any) -> bool:
    """Whether `pred` (an extracted final answer) is correct for `problem`, by its benchmark's rule.

    Args:
        pred: the extracted answer (`mmprm.answers.extract_answer`), or None.
        problem: a problems row (dict) or `mmprm.data.problems.Problem`; rows of other sources are
            scored by `mmprm.answers.answers_match`.
    """
    get = problem.get if isinstance(problem, dict) else lambda k: getattr(problem, k)
    meta = get("meta") or {}
    rule = RULES.get(meta.get("source"), _default_correct)
    return rule(pred, str(get("answer")), get("choices"), meta)


def read_eval_set(
    name: str,
    source: str | Path | None = None,
    split: str | None = None,
    subset: str | None = None,
    image_root: str | Path | None = None,
    image_dir: str | Path | None = None,
) -> list[dict[str, Any]]:
    """The problems rows of benchmark `name` (`READERS`) from `source` (default its Hub id), in its
    evaluation split unless `split` says otherwise. `subset` is OlympiadBench's only."""
    reader, default_split, hub = READERS[name]
    kwargs: dict[str, Any] = {"split": split or default_split, "image_root": image_root, "image_dir": image_dir}
    if subset:
        if name != "olympiadbench":
            raise ValueError(f"subset={subset!r}: only OlympiadBench has subsets, not {name}")
        kwargs["subset"] = subset
    return reader(source or hub, **kwargs)


def breakdown_groups(metas: Sequence[dict[str, Any]]) -> dict[str, dict[str, list[int]]]:
    """{column: {value: indices of the problems with that value}} for each column a problem's
    benchmark breaks its results down by (`meta["breakdown"]`). A list-valued column (MathVista's
    `skills`) puts the problem under each of its values, as MathVista's own report does."""
    groups: dict[str, dict[str, list[int]]] = {}
    for i, meta in enumerate(metas):
        for col in meta.get("breakdown") or []:
            values = meta.get(col)
            for v in values if isinstance(values, list) else [values]:
                groups.setdefault(col, {}).setdefault(str(v), []).append(i)
    return {col: dict(sorted(values.items())) for col, values in groups.items()}


def accuracy_breakdown(metas: list[dict[str, Any]], correct: list[bool]) -> dict[str, Any]:
    """Accuracy overall and per value of each column the benchmark breaks down by (`meta["breakdown"]`).

    A list-valued column (MathVista's `skills`) counts the problem under each of its values, as
    MathVista's own report does. Returns `{"overall": {correct, total, accuracy},
    "by": {column: {value: {correct, total, accuracy}}}}`.
    """
    if len(metas) != len(correct):
        raise ValueError(f"{len(metas)} problems but {len(correct)} verdicts")

    def acc(hits: list[bool]) -> dict[str, Any]:
        return {"correct": sum(hits), "total": len(hits), "accuracy": sum(hits) / len(hits) if hits else 0.0}

    hits = [bool(c) for c in correct]
    return {
        "overall": acc(hits),
        "by": {
            col: {v: acc([hits[i] for i in idx]) for v, idx in values.items()}
            for col, values in breakdown_groups(metas).items()
        },
    }


def write_problems(rows: list[dict[str, Any]], path: str | Path) -> int:
    """Write problems rows as JSONL, image paths relative to the file where they lie beside it."""
    from mmprm.data.schema import write_jsonl

    base = Path(path).resolve().parent
    out = []
    for r in rows:
        images = []
        for im in r["images"]:
            p = Path(im)
            images.append(str(p.relative_to(base)) if p.is_relative_to(base) else str(p))
        out.append({**r, "images": images})
    return write_jsonl(path, out)


def cli_eval_set(argv: list[str]) -> int:
    """`mmprm eval-set NAME --source S --out DIR [--split X] [--subset C] [--image-root R]`."""
    ap = argparse.ArgumentParser(
        prog="mmprm eval-set", description="Write an answer benchmark as DIR/problems.jsonl (+ DIR/images/)."
    )
    ap.add_argument("name", choices=sorted(READERS))
    ap.add_argument("--source", help="the released file or folder, a save_to_disk folder, or a Hub id (default)")
    ap.add_argument("--out", required=True, help="output folder: problems.jsonl, and images/ for in-memory images")
    ap.add_argument("--split", help="the split (default: the benchmark's evaluation split)")
    ap.add_argument("--subset", help="OlympiadBench's subset (default OE_MM_maths_en_COMP)")
    ap.add_argument("--image-root", help="where the rows' relative image paths start (default: the file's folder)")
    args = ap.parse_args(argv)
    if args.subset and args.name != "olympiadbench":
        ap.error("--subset is OlympiadBench's")
    out = Path(args.out)
    try:
        rows = read_eval_set(args.name, args.source, args.split, args.subset, args.image_root, out / "images")
    except (FileNotFoundError, ValueError) as e:
        print(f"mmprm eval-set: {e}", file=sys.stderr)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    n = write_problems(rows, out / "problems.jsonl")
    print(f"{out / 'problems.jsonl'}: {n} problems ({args.name})", file=sys.stderr)
    return 0


__all__ = [
    "READERS",
    "RULES",
    "answer_correct",
    "accuracy_breakdown",
    "breakdown_groups",
    "read_eval_set",
    "write_problems",
    "read_mathvista",
    "read_mathverse",
    "read_mathvision",
    "read_olympiadbench",
    "read_mmk12",
]
