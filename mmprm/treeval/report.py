"""report.md of a reasoning evaluation (`recipes/reasoning_eval.py`): the summary a person reads first."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def reasoning_report_md(
    title: str, s: dict[str, Any], rows: Sequence[dict[str, Any]], filter_threshold: float, pngs: Sequence[Path] = ()
) -> str:
    """Markdown: the summary table, RPTS per (lambda, h_f), why trees are missing, chat costs, one row per item.

    `s` and `rows` are the recipe's report.json "summary" and "items"; `pngs` are paths relative to
    the report's folder.
    """
    lines = [f"# {title}", "", "| metric | value |", "| --- | --- |"]
    for key in (
        "problems",
        "answered",
        "unanswered",
        "accuracy",
        "trees_scored",
        "trees_missing",
        "trees_unjudged",
        "accuracy_of_scored",
        "width",
        "depth",
        "width_soft",
        "depth_soft",
    ):
        lines.append(f"| {key} | {_fmt(s[key])} |")
    tok = s["answer_tokens"]
    lines += [
        f"| answer tokens (mean, {tok['counted_by']}) | {_fmt(tok['mean'])} |",
        "",
        f"RPTS and filtered accuracy (right answer and RPTS >= {filter_threshold}) over the "
        f"{s['trees_scored']} scored trees:",
        "",
        "| lambda, h_f | RPTS | filtered accuracy |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {k} | {_fmt(v)} | {_fmt(s['filtered_accuracy'][k])} |" for k, v in s["rpts"].items()]
    if s["tree_failures"]:
        lines += [
            "",
            "Answers without a usable tree (left out of the tree metrics):",
            "",
            "| why | count |",
            "| --- | --- |",
        ] + [f"| {k} | {v} |" for k, v in sorted(s["tree_failures"].items())]
    for name, st in s["chat"].items():
        lines.append(
            f"\n{name}: {st['requests']} requests, {st['cache_hits']} from the cache, {st['retries']} "
            f"retries, {st['unparsed']} unreadable replies, {st['prompt_tokens']} prompt + "
            f"{st['completion_tokens']} completion tokens"
        )
    first = next(iter(s["rpts"]))
    lines += [
        "",
        f"| id | correct | status | nodes | width | depth | RPTS {first} | answer tokens |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['id']} | {r['correct']} | {r['status']} | {r['nodes']} | {_fmt(r.get('width'))} | "
            f"{_fmt(r.get('depth'))} | {_fmt(r.get('rpts', {}).get(first))} | {r['answer_tokens']} |"
        )
    if pngs:
        lines += ["", "Trees:", ""] + [f"![{Path(p).stem}]({Path(p).as_posix()})" for p in pngs]
    return "\n".join(lines) + "\n"
