"""Answer benchmarks read into problems: MathVista, MathVerse, MATH-Vision, OlympiadBench, MM-K12.

Not to be confused with `mmprm.data.benchmarks` (step-level PRM benchmarks, labelled steps).
Each reader takes the benchmark's released file, its folder, a `save_to_disk` / parquet copy or a
Hub dataset id, and returns problems rows (`mmprm.data.problems`)::

    {"id", "question", "images": [absolute paths], "answer", "choices": [...] | None,
     "meta": {"source": "mathvista", <the benchmark's category columns>, "breakdown": [their names]}}

`answer_correct(pred, problem)` scores an extracted answer by the rule of the problem's own
benchmark (`meta["source"]`); `meta["breakdown"]` names the columns its own report breaks accuracy
down by. `write_problems` / `mmprm eval-set` write a problems.jsonl the recipes read.

Scoring saved outputs (anyone's): `score_reply(name, row, reply)` takes the answer out of a whole
reply as the benchmark's own code does (`REPLY_ANSWER`) and judges it by its rule (`RULES`);
`score_answer(name, row, answer)` judges an answer already extracted. `mmprm eval-set score NAME
OUTPUTS.jsonl` prints the accuracy with the benchmark's own breakdown (docs/benchmarks.md).
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
from mmprm.data.eval_sets.olympiadbench import olympiad_extract, olympiadbench_correct, read_olympiadbench
from mmprm.data.registry import lookup, register_alias, register_reader

Rule = Callable[[str | None, str, list[str] | None, dict[str, Any]], bool]

# name -> (default split, Hub id); the readers are `mmprm.data.readers`' answer_benchmark ones
SOURCES: dict[str, tuple[str, str]] = {
    "mathvista": ("testmini", "AI4Math/MathVista"),
    "mathverse": ("testmini", "AI4Math/MathVerse"),
    "mathvision": ("testmini", "MathLLMs/MathVision"),
    "olympiadbench": ("train", "Hothan/OlympiadBench"),
    "mmk12": ("test", "Cierra0506/MM-K12"),
}
register_alias("answer_benchmark", "mathv", "mathvision")


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

# name -> how its own code takes the answer out of a whole reply; others: `extract_answer`.
# MATH-V's rule extracts by itself (what it extracts from an extracted answer is that answer).
REPLY_ANSWER: dict[str, Callable[[str, dict[str, Any]], str | None]] = {
    "mathvision": lambda reply, meta: reply,
    "olympiadbench": lambda reply, meta: olympiad_extract(reply, bool(meta.get("chinese"))),
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


def _rule(name: str) -> Rule:
    if name not in RULES:
        raise ValueError(f"benchmark {name!r}: no answer rule (known: {', '.join(sorted(RULES))})")
    return RULES[name]


def score_answer(name: str, row: dict[str, Any], answer: str | None) -> bool:
    """Whether an extracted `answer` is right for problems row `row` by benchmark `name`'s rules.

    Args:
        name: a benchmark of `RULES` (`mathvista`, `mathverse`, `mathvision`, `olympiadbench`, `mmk12`).
        row: its problems row (`read_eval_set`, or a line of a problems.jsonl `mmprm eval-set` wrote).
        answer: the model's final answer, or None (wrong).
    """
    rule = _rule(name)
    return rule(answer, str(row["answer"]), row.get("choices"), row.get("meta") or {})


def score_reply(name: str, row: dict[str, Any], reply: str) -> bool:
    """Whether a model's whole `reply` is right for `row` by benchmark `name`'s rules: its answer
    taken out as the benchmark's own code does (`REPLY_ANSWER`, else `mmprm.answers.extract_answer`),
    then judged by `score_answer`."""
    from mmprm.answers import extract_answer

    _rule(name)
    take = REPLY_ANSWER.get(name)
    answer = take(reply, row.get("meta") or {}) if take else extract_answer(reply)
    return score_answer(name, row, answer)


def read_eval_set(
    name: str,
    source: str | Path | None = None,
    split: str | None = None,
    subset: str | None = None,
    image_root: str | Path | None = None,
    image_dir: str | Path | None = None,
) -> list[dict[str, Any]]:
    """The problems rows of benchmark `name` (`SOURCES`) from `source` (default its Hub id), in its
    evaluation split unless `split` says otherwise. `subset` is OlympiadBench's only."""
    reader = lookup("answer_benchmark", name)
    default_split, hub = SOURCES[name]
    kwargs: dict[str, Any] = {"split": split or default_split, "image_root": image_root, "image_dir": image_dir}
    if subset:
        if name != "olympiadbench":
            raise ValueError(f"subset={subset!r}: only OlympiadBench has subsets, not {name}")
        kwargs["subset"] = subset
    return reader(source or hub, **kwargs)


@register_reader("answer_benchmark", "problems")
def read_problems_file(source: str | Path, image_root: str | Path | None = None) -> list[dict[str, Any]]:
    """Our problems file (`mmprm.data.problems`; what `write_problems` writes) as problems rows."""
    from mmprm.data.problems import load_problems

    if image_root is not None:
        raise ValueError(f"{source}: a problems file's images start at the file's folder; leave image_root unset")
    return [
        {
            "id": p.id,
            "question": p.question,
            "images": p.images,
            "answer": p.answer,
            "choices": p.choices,
            "meta": p.meta,
        }
        for p in load_problems(source)
    ]


register_alias("answer_benchmark", "jsonl", "problems")


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


def _read_outputs(path: Path) -> list[tuple[int, dict[str, Any]]]:
    import json

    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
            if not isinstance(obj, dict) or obj.get("id") is None:
                raise ValueError(f"{path}:{lineno}: id: missing (each line is {{id, response | extracted}})")
            if not isinstance(obj.get("response"), str) and "extracted" not in obj:
                raise ValueError(f"{path}:{lineno}: id={obj['id']}: response: missing (or give extracted)")
            out.append((lineno, obj))
    return out


def score_outputs(name: str, rows: list[dict[str, Any]], outputs: str | Path) -> dict[str, Any]:
    """Score a saved outputs file against benchmark `name`'s problems `rows`.

    Each line of `outputs` is `{"id", "response"}` (a whole reply, `score_reply`) or
    `{"id", "extracted"}` (an answer, `score_answer`); ids are the rows' `id`s. Returns
    `accuracy_breakdown`'s report with `benchmark`, `outputs` and `remote_figures` (rows whose
    figures are only links, read as text) added.
    """
    by_id = {str(r["id"]): r for r in rows}
    metas, verdicts, remote = [], [], 0
    for lineno, obj in _read_outputs(Path(outputs)):
        row = by_id.get(str(obj["id"]))
        if row is None:
            raise ValueError(
                f"{outputs}:{lineno}: id={obj['id']}: id: not a problem of {name} (wrong split or subset?)"
            )
        if isinstance(obj.get("response"), str):
            verdicts.append(score_reply(name, row, obj["response"]))
        else:
            verdicts.append(score_answer(name, row, obj.get("extracted")))
        metas.append(row.get("meta") or {})
        remote += bool((row.get("meta") or {}).get("remote_figures"))
    return {"benchmark": name, "outputs": str(outputs), **accuracy_breakdown(metas, verdicts), "remote_figures": remote}


def cli_eval_set_score(argv: list[str]) -> int:
    """`mmprm eval-set score NAME OUTPUTS.jsonl [--problems F | --source S [--split X] [--subset C]]`."""
    import json

    ap = argparse.ArgumentParser(
        prog="mmprm eval-set score",
        description="Score saved model outputs by a benchmark's own rules; print accuracy and its breakdown as JSON.",
    )
    ap.add_argument("name", choices=sorted(SOURCES))
    ap.add_argument("outputs", help="JSONL: one {id, response} (a reply) or {id, extracted} (an answer) per line")
    ap.add_argument("--problems", help="a problems.jsonl `mmprm eval-set NAME --out` wrote (instead of --source)")
    ap.add_argument("--source", help="the released file or folder, or a Hub id (default)")
    ap.add_argument("--split", help="the split (default: the benchmark's evaluation split)")
    ap.add_argument("--subset", help="OlympiadBench's subset (its file name without .json)")
    ap.add_argument("--image-root", help="where the rows' relative image paths start")
    args = ap.parse_args(argv)
    try:
        if args.problems:
            rows = [
                json.loads(line)
                for line in Path(args.problems).read_text(encoding="utf-8").splitlines()
                if line.strip()
            ]
        else:
            rows = read_eval_set(args.name, args.source, args.split, args.subset, args.image_root)
        report = score_outputs(args.name, rows, args.outputs)
    except (FileNotFoundError, ValueError) as e:
        print(f"mmprm eval-set score: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=1, ensure_ascii=False))
    o = report["overall"]
    print(f"{args.name}: {o['correct']}/{o['total']} = {100 * o['accuracy']:.2f}%", file=sys.stderr)
    return 0


def cli_eval_set(argv: list[str]) -> int:
    """`mmprm eval-set NAME --source S --out DIR [--split X] [--subset C] [--image-root R]`, or
    `mmprm eval-set score NAME OUTPUTS.jsonl ...` (`cli_eval_set_score`)."""
    if argv[:1] == ["score"]:
        return cli_eval_set_score(argv[1:])
    ap = argparse.ArgumentParser(
        prog="mmprm eval-set",
        description="Write an answer benchmark as DIR/problems.jsonl (+ DIR/images/).",
        epilog="`mmprm eval-set score NAME OUTPUTS.jsonl` scores saved outputs by the benchmark's rules.",
    )
    ap.add_argument("name", choices=sorted(SOURCES))
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
    remote = sum(bool(r["meta"].get("remote_figures")) for r in rows)
    note = f", {remote} with figures only as remote links, read as text" if remote else ""
    print(f"{out / 'problems.jsonl'}: {n} problems ({args.name}{note})", file=sys.stderr)
    return 0


__all__ = [
    "SOURCES",
    "REPLY_ANSWER",
    "RULES",
    "answer_correct",
    "score_answer",
    "score_outputs",
    "score_reply",
    "accuracy_breakdown",
    "breakdown_groups",
    "read_eval_set",
    "read_problems_file",
    "write_problems",
    "read_mathvista",
    "read_mathverse",
    "read_mathvision",
    "read_olympiadbench",
    "read_mmk12",
]
