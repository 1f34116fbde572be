"""Import public PRM data into our step-labelled schema (`mmprm.data.schema`).

    mmprm convert --from math_shepherd --input math-shepherd.jsonl --out data/shepherd.jsonl

One function per source format; each takes parsed rows and returns a `Converted`: the examples
plus one `FILE:ROW: id=...: field: why` line per row it could not convert. Nothing is guessed:
a row whose labels cannot be lined up with its steps is skipped and counted, never mislabelled.

| format          | input row                                                        | labels            |
| --------------- | ---------------------------------------------------------------- | ----------------- |
| `trl`           | `{"prompt", "completions": [str], "labels": [bool], "images"?}`   | True/False -> 1/0 |
| `math_shepherd` | `{"input", "label", "task"}`, steps end in `ки`, label has `+`/`-` | + -> 1, - -> 0     |
| `prm800k`       | raw PRM800K phase-1/2 row (`question`, `label.steps[...]`)        | rating 1/0/-1     |
| `openr_tree`    | openr / OmegaPRM nested tree (`reasoning_steps` node)             | node `mc_value`   |
| `openr_flat`    | openr `reasoning_steps: [{"solution_prefix", "mc_value"}]`         | prefix `mc_value` |
| `mmprm_prm`     | MM-PRM `{"question", "image", "process": "s1<prm>s2<prm>", labels}` | floats as given   |

Images become absolute paths (relative ones resolve against `image_root`, default the input
file's folder). `answer` holds the gold final answer where the source has one (PRM800K,
openr), never a model's prediction. Every example is checked with `schema.check_row` last.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import os
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmprm.data.registry import register_reader
from mmprm.data.schema import DataError, StepExample, atomic_write, check_row, iter_jsonl

FORMATS = ("trl", "math_shepherd", "prm800k", "openr_tree", "openr_flat", "mmprm_prm")

SHEPHERD_TAG = "ки"
SHEPHERD_LABELS = {"+": 1.0, "-": 0.0}
_SHEPHERD_STEP = re.compile(r"^Step\s*\d+\s*:\s*")
_SHEPHERD_FIRST = re.compile(r"(?:^|\s)Step\s*1\s*:")
PRM800K_FINISH = ("solution", "found_error", "give_up")


@dataclass
class Converted:
    """What a converter made of its rows.

    examples: the converted examples, all passing `schema.check_row` (empty with a `sink`).
    skipped: one `SOURCE:ROW: id=...: field: why` line per row left out.
    reasons: skipped rows counted by kind of reason (for the summary).
    notes: non-fatal fixes counted by kind ("empty step dropped", "duplicate path merged", ...).
    rows: how many input rows were read.
    count, steps: examples kept and their steps.
    sink: where each kept example goes as it is made (a file's writer), instead of `examples`:
        a conversion of any size then holds no examples.
    """

    examples: list[StepExample] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    reasons: Counter = field(default_factory=Counter)
    notes: Counter = field(default_factory=Counter)
    rows: int = 0
    count: int = 0
    steps: int = 0
    sink: Callable[[StepExample], None] | None = field(default=None, repr=False, compare=False)
    _image_checks: dict[Path, str | None] = field(default_factory=dict, repr=False, compare=False)

    def keep(self, where: str, ex: StepExample, check_images: bool) -> None:
        """`ex` through `check_row`: skipped with the schema's reason, or counted and kept."""
        errs, _ = check_row(
            ex.to_json(), Path("/"), require_labels=True, check_images=check_images, image_cache=self._image_checks
        )
        if errs:
            fld, msg = errs[0]
            self.skip(where, ex.id, RowError(fld, f"fails schema check: {fld.split('[')[0]}", msg))
            return
        self.count += 1
        self.steps += len(ex.steps)
        if self.sink is None:
            self.examples.append(ex)
        else:
            self.sink(ex)

    def skip(self, where: str, rid: Any, err: RowError) -> None:
        self.skipped.append(f"{where}: id={rid}: {err.field}: {err.detail}")
        self.reasons[err.kind] += 1

    def summary(self, show: int = 10) -> str:
        """Human summary: counts, skip reasons, notes and the first `show` skipped rows."""
        lines = [
            f"read {self.rows} rows -> {self.count} examples ({self.steps} steps); skipped {len(self.skipped)} rows"
        ]
        lines += [f"  skipped {n:>6}  {kind}" for kind, n in self.reasons.most_common()]
        lines += [f"  note    {n:>6}  {kind}" for kind, n in self.notes.most_common()]
        lines += [f"  {line}" for line in self.skipped[:show]]
        if len(self.skipped) > show:
            lines.append(f"  ... and {len(self.skipped) - show} more skipped rows")
        return "\n".join(lines)


class RowError(ValueError):
    """A row that cannot be converted: `field` is where, `kind` is counted, `detail` says what to fix."""

    def __init__(self, field_: str, kind: str, detail: str | None = None):
        super().__init__(kind)
        self.field, self.kind, self.detail = field_, kind, detail or kind


# ---------------------------------------------------------------------------------------------
# Shared pieces


def _text(row: dict[str, Any], keys: tuple[str, ...]) -> str:
    """The first non-empty string field among `keys`."""
    for key in keys:
        value = row.get(key)
        if isinstance(value, str) and value.strip():
            return value.strip()
    raise RowError(keys[0], f"missing {'/'.join(keys)}", f"missing or empty (one of {', '.join(keys)} must hold text)")


def _images(row: dict[str, Any], image_root: Path) -> list[str]:
    """Absolute image paths from `images`, `image` or `image_path` (a path or a list of paths)."""
    for key in ("images", "image", "image_path"):
        value = row.get(key)
        if value is None:
            continue
        items = value if isinstance(value, list) else [value]
        paths = []
        for item in items:
            if isinstance(item, dict):  # a datasets Image column read with decode=False
                if item.get("bytes"):
                    raise RowError(
                        key,
                        "embedded image bytes",
                        "image bytes are embedded in the dataset (pass image_dir to convert_file, "
                        "or use the CLI, to save them as files)",
                    )
                item = item.get("path")
            if not isinstance(item, str) or not item:
                raise RowError(
                    key,
                    "image is not a file path",
                    "not a file path (embedded images: save them as files and list their paths)",
                )
            paths.append(item if os.path.isabs(item) else str((image_root / item).resolve()))
        return paths
    return []


def _label(x: Any, where: str) -> float:
    """A label as a float in [0, 1]; bools map to 1/0."""
    if isinstance(x, bool):
        return float(x)
    if isinstance(x, (int, float)) and not math.isnan(x) and 0.0 <= x <= 1.0:
        return float(x)
    raise RowError(where, "label is not a number in [0,1]", f"{x!r} is not a bool or a number in [0,1]")


def _drop_empty_steps(steps: list[str], labels: list[float], notes: Counter) -> tuple[list[str], list[float]]:
    """Strip steps; an empty step goes together with its label (the PRM has nothing to read there)."""
    kept = [(s.strip(), y) for s, y in zip(steps, labels) if s.strip()]
    if len(kept) < len(steps):
        notes["empty step dropped (with its label)"] += len(steps) - len(kept)
    if not kept:
        raise RowError("steps", "no non-empty steps", "no step holds any text (nothing to label)")
    return [s for s, _ in kept], [y for _, y in kept]


def _row_id(row: dict[str, Any], fmt: str, n: int) -> str:
    for key in ("id", "question_id", "idx"):
        value = row.get(key)
        if isinstance(value, (str, int)) and not isinstance(value, bool) and str(value).strip():
            return str(value).strip()
    return f"{fmt}-{n}"


class _Ids:
    """Unique ids: the first use of a base id keeps it, later ones get `~2`, `~3`, ..."""

    def __init__(self, prefix: str = ""):
        self.prefix, self.used = prefix, set[str]()
        self.last_suffix: dict[str, int] = {}  # base -> the last k tried: each base's search resumes there

    def __call__(self, base: str) -> str:
        rid, k = f"{self.prefix}{base}", self.last_suffix.get(base, 1)
        if k > 1 or rid in self.used:
            k += 1
            rid = f"{self.prefix}{base}~{k}"
            while rid in self.used:  # a base id that itself ends in ~k took this one
                k += 1
                rid = f"{self.prefix}{base}~{k}"
            self.last_suffix[base] = k
        self.used.add(rid)
        return rid


class _PathPool:
    """Root-to-leaf paths of search trees, deduplicated across the whole input.

    The same (question, images, steps) reached twice (two tree nodes with equal text, a prefix
    listed twice) is one example; its labels are averaged, since each copy is a Monte-Carlo
    estimate of the same prefix values.
    """

    def __init__(self) -> None:
        self.paths: dict[tuple, list[Any]] = {}

    def add(
        self,
        where: str,
        base_id: str,
        question: str,
        images: list[str],
        steps: list[str],
        labels: list[float],
        answer: str | None,
        meta: dict[str, Any],
    ) -> None:
        key = (question, tuple(images), tuple(steps))
        if key in self.paths:
            self.paths[key][2].append(labels)
        else:
            self.paths[key] = [where, base_id, [labels], answer, meta]

    def examples(self, ids: _Ids, notes: Counter) -> list[tuple[str, StepExample]]:
        """(row location, example) per distinct path, ids `<base>-<k>` in input order."""
        out, counters = [], Counter[str]()
        for (question, images, steps), (where, base, copies, answer, meta) in self.paths.items():
            if len(copies) > 1:
                notes["duplicate path merged (labels averaged)"] += len(copies) - 1
            labels = [sum(ys) / len(ys) for ys in zip(*copies)]
            k = counters[base]
            counters[base] += 1
            out.append(
                (
                    where,
                    StepExample(
                        id=ids(f"{base}-{k}"),
                        question=question,
                        steps=list(steps),
                        images=list(images),
                        labels=labels,
                        answer=answer,
                        meta=dict(meta),
                    ),
                )
            )
        return out


def _finish(result: Converted, examples: Iterable[tuple[str, StepExample]], check_images: bool) -> Converted:
    """Each (row location, example) through `Converted.keep`."""
    for where, ex in examples:
        result.keep(where, ex, check_images)
    return result


# ---------------------------------------------------------------------------------------------
# Converters: rows in, Converted out


def convert_trl(
    rows: Iterable[dict[str, Any]],
    source: str = "rows",
    image_root: str | Path = ".",
    id_prefix: str = "",
    check_images: bool = True,
    sink: Callable[[StepExample], None] | None = None,
) -> Converted:
    """TRL stepwise supervision: `{"prompt", "completions": [str], "labels": [bool], "images"?}`.

    One example per row; labels True/False -> 1.0/0.0 (floats in [0,1] are kept as they are).
    """
    result, ids = Converted(sink=sink), _Ids(id_prefix)
    for n, row in enumerate(rows, start=1):
        result.rows += 1
        rid = _row_id(row, "trl", n)
        try:
            if not isinstance(row.get("prompt"), str):
                raise RowError(
                    "prompt",
                    "prompt is not text",
                    "missing or not a string (conversational prompts: keep the user text only)",
                )
            question = _text(row, ("prompt",))
            steps, labels = row.get("completions"), row.get("labels")
            if not isinstance(steps, list) or not all(isinstance(s, str) for s in steps):
                raise RowError("completions", "completions is not a list of strings", "must be a list of step strings")
            if not isinstance(labels, list) or len(labels) != len(steps):
                raise RowError(
                    "labels",
                    "steps/labels count mismatch",
                    f"{len(labels) if isinstance(labels, list) else 'no'} labels for "
                    f"{len(steps)} completions (give one label per step)",
                )
            ys = [_label(y, f"labels[{i}]") for i, y in enumerate(labels)]
            steps, ys = _drop_empty_steps(steps, ys, result.notes)
            images = _images(row, Path(image_root))
        except RowError as e:
            result.skip(f"{source}:{n}", rid, e)
            continue
        example = StepExample(
            id=ids(rid), question=question, steps=steps, images=images, labels=ys, meta={"source": "trl"}
        )
        result.keep(f"{source}:{n}", example, check_images)
    return result


def split_math_shepherd(text: str, label: str) -> tuple[str, list[str], list[float]]:
    """Question, steps and labels of one Math-Shepherd row.

    `text` ends each step with the tag `ки`; `label` is the same text with each tag replaced by
    `+` or `-`. The two are walked together, so a label is only read where a tag stood. The
    question is everything before the `Step 1:` that opens the first step; the `Step k:`
    prefixes are dropped. Raises RowError when the two texts do not line up.

    >>> split_math_shepherd("Q? Step 1: a ки\\nStep 2: b ки", "Q? Step 1: a +\\nStep 2: b -")
    ('Q?', ['a', 'b'], [1.0, 0.0])
    """
    segments = text.split(SHEPHERD_TAG)
    if len(segments) < 2:
        raise RowError("input", "no step tags", f"no {SHEPHERD_TAG!r} step tag found (each step must end with it)")
    if segments[-1].strip():
        raise RowError(
            "input",
            "text after the last step tag",
            f"text after the last {SHEPHERD_TAG!r} tag has no label: {segments[-1].strip()[:40]!r}",
        )
    labels, pos = [], 0
    for k, seg in enumerate(segments[:-1]):
        if not label.startswith(seg, pos) or label[pos + len(seg) : pos + len(seg) + 1] not in SHEPHERD_LABELS:
            raise RowError(
                "label",
                "label text does not match input",
                f"differs from input at step tag {k + 1} "
                "(label must be the input with each tag replaced by '+' or '-')",
            )
        labels.append(SHEPHERD_LABELS[label[pos + len(seg)]])
        pos += len(seg) + 1
    if label[pos:] != segments[-1]:
        raise RowError("label", "label text does not match input", "has extra text after the last step label")
    # The question may itself say "Step 1:"; the real one is the last in the first segment.
    firsts = list(_SHEPHERD_FIRST.finditer(segments[0]))
    if not firsts:
        raise RowError(
            "input", "no 'Step 1:' before the first tag", "no 'Step 1:' found (cannot split question from steps)"
        )
    question = segments[0][: firsts[-1].start()].strip()
    if not question:
        raise RowError("input", "empty question", "nothing before 'Step 1:' (the question is missing)")
    steps = [segments[0][firsts[-1].end() :]] + segments[1:-1]
    steps = [_SHEPHERD_STEP.sub("", s.strip(), count=1) for s in steps]
    return question, steps, labels


def convert_math_shepherd(
    rows: Iterable[dict[str, Any]],
    source: str = "rows",
    id_prefix: str = "",
    check_images: bool = True,
    sink: Callable[[StepExample], None] | None = None,
) -> Converted:
    """Math-Shepherd `{"input", "label", "task"}` rows (see `split_math_shepherd`); no gold answer."""
    result, ids = Converted(sink=sink), _Ids(id_prefix)
    for n, row in enumerate(rows, start=1):
        result.rows += 1
        rid = _row_id(row, "math_shepherd", n)
        try:
            text, label = row.get("input"), row.get("label")
            if not isinstance(text, str) or not isinstance(label, str):
                raise RowError(
                    "input" if not isinstance(text, str) else "label",
                    "missing input/label",
                    "missing or not a string (Math-Shepherd rows hold 'input' and 'label' text)",
                )
            question, steps, labels = split_math_shepherd(text, label)
            steps, labels = _drop_empty_steps(steps, labels, result.notes)
        except RowError as e:
            result.skip(f"{source}:{n}", rid, e)
            continue
        meta = {"source": "math_shepherd"} | ({"task": row["task"]} if isinstance(row.get("task"), str) else {})
        example = StepExample(id=ids(rid), question=question, steps=steps, labels=labels, meta=meta)
        result.keep(f"{source}:{n}", example, check_images)
    return result


def _prm800k_rating(rating: Any, neutral: float, where: str) -> float:
    if rating == 1 and not isinstance(rating, bool):
        return 1.0
    if rating == 0 and not isinstance(rating, bool):
        return neutral
    if rating == -1:
        return 0.0
    raise RowError(where, "rating is not -1/0/1", f"rating {rating!r} is not -1, 0 or 1")


def prm800k_path(
    label: dict[str, Any], neutral: float = 1.0, pre_generated: list[str] | None = None, alternatives: bool = False
) -> tuple[list[tuple[str, float]], list[tuple[int, str, float]], str]:
    """The labelled steps a PRM800K labeler followed, and (optionally) the rated steps not taken.

    Per step: the chosen completion if any, else the human-written one (rating null -> 1.0: a
    labeler writes a step to continue a correct solution). A step with neither ends the path:
    on `found_error` the step rated -1 is appended with label 0.0 (the pre-generated step in
    phase 2, else the first -1 completion); on `give_up` (or null completions) the path stops
    unfinished. The path also stops right after any step rated -1, since what follows a wrong
    step is not labelled for a correct prefix. Ratings: 1 -> 1.0, 0 -> `neutral` (default 1.0,
    the PRM800K paper's "neutral counts as ok" convention), -1 -> 0.0.

    Returns:
        path: [(step text, label)] along the followed solution.
        alternatives: [(step index, text, label)] of rated completions not taken (when asked).
        why: how the path ended ("solution", "found_error", "give_up" or "stopped at -1").
    """
    steps = label.get("steps")
    if not isinstance(steps, list) or not steps:
        raise RowError("label.steps", "no steps", "missing or empty (no labelled steps)")
    finish = label.get("finish_reason")
    path: list[tuple[str, float]] = []
    others: list[tuple[int, str, float]] = []
    for i, step in enumerate(steps):
        where = f"label.steps[{i}]"
        if not isinstance(step, dict):
            raise RowError(where, "step is not an object", "not a JSON object")
        comps = step.get("completions") or []
        chosen, human = step.get("chosen_completion"), step.get("human_completion")
        if not isinstance(comps, list) or not all(isinstance(c, dict) for c in comps):
            raise RowError(f"{where}.completions", "completions malformed", "must be a list of objects or null")
        taken: int | None = None  # index of the completion on the path (None: human step / stop)
        if chosen is not None:
            if not isinstance(chosen, int) or isinstance(chosen, bool) or not 0 <= chosen < len(comps):
                raise RowError(
                    f"{where}.chosen_completion",
                    "chosen_completion out of range",
                    f"{chosen!r} is not an index into {len(comps)} completions",
                )
            taken, text, rating = chosen, comps[chosen].get("text"), comps[chosen].get("rating")
        elif isinstance(human, dict):
            text, rating = human.get("text"), human.get("rating")
            rating = 1 if rating is None else rating
        elif finish == "found_error":
            bad = [k for k, c in enumerate(comps) if c.get("rating") == -1]
            if pre_generated is not None and i < len(pre_generated):
                bad = [k for k in bad if comps[k].get("text") == pre_generated[i]] or bad
            if not bad:
                raise RowError(
                    where, "found_error without a -1 step", "finish_reason is found_error but no completion is rated -1"
                )
            taken, text, rating = bad[0], comps[bad[0]].get("text"), -1
        else:  # give_up, or nothing chosen at the end of a finished solution: the path ends here
            text = rating = None
        if alternatives:  # rated completions not followed, also at the step where the path ends
            for k, c in enumerate(comps):
                if k != taken and c.get("rating") is not None and isinstance(c.get("text"), str):
                    others.append((i, c["text"], _prm800k_rating(c["rating"], neutral, f"{where}.completions[{k}]")))
        if rating is None:
            break
        if not isinstance(text, str):
            raise RowError(f"{where}.text", "step text missing", "the followed step has no text")
        path.append((text, _prm800k_rating(rating, neutral, where)))
        if rating == -1:
            return path, others, "found_error" if finish == "found_error" else "stopped at -1"
    return path, others, finish if isinstance(finish, str) else "unknown"


def convert_prm800k(
    rows: Iterable[dict[str, Any]],
    source: str = "rows",
    neutral: float = 1.0,
    alternatives: bool = False,
    id_prefix: str = "",
    check_images: bool = True,
    sink: Callable[[StepExample], None] | None = None,
) -> Converted:
    """Raw PRM800K phase rows: the followed path per row (see `prm800k_path`).

    With `alternatives`, each rated completion not taken also becomes an example: the followed
    prefix before it plus that completion (id `<row>-alt<step>-<k>`), e.g. the five -1 steps a
    labeler rejected before writing their own.
    """
    if not 0.0 <= neutral <= 1.0:
        raise ValueError(f"neutral label {neutral} is outside [0,1] (use 1.0 for 'ok' or 0.0 for 'bad')")
    result, ids = Converted(sink=sink), _Ids(id_prefix)
    for n, row in enumerate(rows, start=1):
        result.rows += 1
        rid = _row_id(row, "prm800k", n)
        where = f"{source}:{n}"
        try:
            q, label, question, finish = _prm800k_parts(row)
            pre = q.get("pre_generated_steps")
            path, others, ended = prm800k_path(label, neutral, pre if isinstance(pre, list) else None, alternatives)
            if not path:
                raise RowError("label.steps", "no labelled steps", f"{finish}: the labeler stopped before any step")
            steps, labels = _drop_empty_steps([t for t, _ in path], [y for _, y in path], result.notes)
        except RowError as e:
            result.skip(where, rid, e)
            continue
        answer = q.get("ground_truth_answer")
        meta = {
            "source": "prm800k",
            "finish_reason": finish,
            "ended": ended,
            **{
                k: row[k]
                for k in ("labeler", "generation", "is_quality_control_question", "is_initial_screening_question")
                if k in row
            },
        }
        answer = answer if isinstance(answer, str) else None
        example = StepExample(id=ids(rid), question=question, steps=steps, labels=labels, answer=answer, meta=meta)
        result.keep(where, example, check_images)
        for example in _prm800k_alternatives(rid, question, answer, meta, path, others, ids, result.notes):
            result.keep(where, example, check_images)
    return result


def _prm800k_parts(row: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], str, Any]:
    """(question object, label object, problem text, finish_reason) of a raw PRM800K row; a row
    that is not one, or whose finish_reason carries no usable labels, is a RowError."""
    q, label = row.get("question"), row.get("label")
    if not isinstance(q, dict) or not isinstance(label, dict):
        raise RowError(
            "question" if not isinstance(q, dict) else "label",
            "not a PRM800K row",
            "missing or not an object (expected raw PRM800K phase rows)",
        )
    question = _text(q, ("problem",))
    finish = label.get("finish_reason")
    if finish not in PRM800K_FINISH:
        raise RowError(
            "label.finish_reason",
            f"finish_reason {finish!r}",
            f"{finish!r} is not one of {', '.join(PRM800K_FINISH)} "
            "(e.g. bad_problem: the labeler flagged the problem; no usable labels)",
        )
    return q, label, question, finish


def _prm800k_alternatives(
    rid: str,
    question: str,
    answer: str | None,
    meta: dict[str, Any],
    path: list[tuple[str, float]],
    others: list[tuple[int, str, float]],
    ids: _Ids,
    notes: Counter,
) -> Iterator[StepExample]:
    """One example per rated completion not taken: the followed steps before it, then it (id
    `<rid>-alt<step>-<k>`); empty completions are counted in `notes` and dropped."""
    counts = Counter[int]()
    for i, text, y in others:
        if not text.strip():
            notes["empty alternative dropped"] += 1
            continue
        prefix = [(t.strip(), yy) for t, yy in path[:i] if t.strip()]
        counts[i] += 1
        yield StepExample(
            id=ids(f"{rid}-alt{i}-{counts[i] - 1}"),
            question=question,
            steps=[t for t, _ in prefix] + [text.strip()],
            labels=[yy for _, yy in prefix] + [y],
            answer=answer,
            meta=meta | {"alternative_of_step": i},
        )


def _mc(node: Any, where: str) -> float:
    value = node.get("mc_value") if isinstance(node, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise RowError(where, "mc_value is not in [0,1]", f"mc_value {value!r} is not a number in [0,1]")
    return float(value)


def openr_tree_paths(root: dict[str, Any]) -> list[tuple[list[str], list[float]]]:
    """Root-to-leaf paths of an openr/OmegaPRM tree: (step texts, mc_values), root excluded.

    The root holds the question, so it is not a step; every other node is one step labelled
    with its own mc_value (the Monte-Carlo success rate of rollouts from that prefix).
    """
    out: list[tuple[list[str], list[float]]] = []
    stack: list[tuple[dict[str, Any], list[str], list[float], str]] = [(root, [], [], "reasoning_steps")]
    while stack:  # iterative, so deep trees cannot hit the recursion limit
        node, steps, labels, where = stack.pop()
        children = node.get("children") or []
        if not isinstance(children, list):
            raise RowError(f"{where}.children", "children is not a list", "must be a list of nodes")
        if not children and steps:
            out.append((steps, labels))
        for k in range(len(children) - 1, -1, -1):  # reversed push keeps left-to-right order
            child, cwhere = children[k], f"{where}.children[{k}]"
            if not isinstance(child, dict) or not isinstance(child.get("text"), str):
                raise RowError(cwhere, "node without text", "node must be an object with a 'text' string")
            stack.append((child, steps + [child["text"]], labels + [_mc(child, cwhere)], cwhere))
    return out


def _convert_paths(
    rows: Iterable[dict[str, Any]],
    fmt: str,
    read: Callable[[dict[str, Any], Counter[str]], tuple[str, list[str], list[tuple[list[str], list[float]]]]],
    source: str,
    id_prefix: str,
    check_images: bool,
    sink: Callable[[StepExample], None] | None,
) -> Converted:
    """The loop the search-tree formats share: `read` turns one row into (question, images,
    [(steps, labels)]) or raises RowError (the row is skipped, named); paths go through one
    `_PathPool`, so a path repeated anywhere in the input is one example."""
    result, pool = Converted(sink=sink), _PathPool()
    for n, row in enumerate(rows, start=1):
        result.rows += 1
        rid = _row_id(row, fmt, n)
        try:
            question, images, paths = read(row, result.notes)
        except RowError as e:
            result.skip(f"{source}:{n}", rid, e)
            continue
        answer = row.get("final_answer")
        for steps, labels in paths:
            pool.add(
                f"{source}:{n}",
                rid,
                question,
                images,
                steps,
                labels,
                answer if isinstance(answer, str) else None,
                {"source": fmt, "question_id": rid},
            )
    return _finish(result, pool.examples(_Ids(id_prefix), result.notes), check_images)


def convert_openr_tree(
    rows: Iterable[dict[str, Any]],
    source: str = "rows",
    image_root: str | Path = ".",
    id_prefix: str = "",
    check_images: bool = True,
    sink: Callable[[StepExample], None] | None = None,
) -> Converted:
    """openr / OmegaPRM trees: one example per distinct root-to-leaf path (see `openr_tree_paths`).

    Empty node texts are dropped with their label (the next node's value covers the same
    prefix). Paths that repeat (equal texts on sibling nodes) are merged by `_PathPool`.
    """

    def read(row: dict[str, Any], notes: Counter[str]) -> tuple[str, list[str], list[tuple[list[str], list[float]]]]:
        root = row.get("reasoning_steps")
        if not isinstance(root, dict):
            raise RowError("reasoning_steps", "no tree", "missing or not a node object {text, mc_value, children}")
        question = _text(row, ("question",)) if row.get("question") else _text(root, ("text",))
        images = _images(row, Path(image_root))
        paths = openr_tree_paths(root)
        if not paths:
            raise RowError("reasoning_steps", "tree has no steps", "the root has no children")
        cleaned = []
        for steps, labels in paths:
            try:
                cleaned.append(_drop_empty_steps(steps, labels, notes))
            except RowError:
                notes["path of empty steps dropped"] += 1
        return question, images, cleaned

    return _convert_paths(rows, "openr_tree", read, source, id_prefix, check_images, sink)


def prefix_paths(
    question: str, prefixes: list[tuple[str, float]], notes: Counter
) -> list[tuple[list[str], list[float]]]:
    """Longest step paths from openr flat prefixes (each `question + steps so far` with a value).

    A prefix's parent is the longest other prefix it extends at a whitespace boundary (guards
    against "x = 3" matching "x = 30"); the text between them is one step, labelled with the
    longer prefix's mc_value. Prefixes that nothing extends are leaves: one path each. The bare
    question (root) is not a step; a prefix listed twice gets the mean of its values.
    """
    values: dict[str, list[float]] = {}
    for text, mc in prefixes:
        if not text.startswith(question):
            notes["prefix without the question text dropped"] += 1
            continue
        rest = text[len(question) :]
        if rest.strip():
            values.setdefault(rest.rstrip(), []).append(mc)
    notes["duplicate prefix merged (values averaged)"] += sum(len(v) - 1 for v in values.values())
    rests = sorted(values, key=len)
    parent: dict[str, str | None] = {}
    has_child: set[str] = set()
    for i, rest in enumerate(rests):
        parent[rest] = None
        for cand in reversed(rests[:i]):  # longest first
            if rest.startswith(cand) and (rest[len(cand)].isspace() or cand[-1].isspace()):
                parent[rest] = cand
                has_child.add(cand)
                break
    out = []
    for leaf in values:  # input order
        if leaf in has_child:
            continue
        chain, node = [], leaf
        while node is not None:
            chain.append(node)
            node = parent[node]
        chain.reverse()
        starts = [0] + [len(c) for c in chain[:-1]]
        steps = [c[s:].strip() for c, s in zip(chain, starts)]
        out.append((steps, [sum(values[c]) / len(values[c]) for c in chain]))
    return out


def convert_openr_flat(
    rows: Iterable[dict[str, Any]],
    source: str = "rows",
    image_root: str | Path = ".",
    id_prefix: str = "",
    check_images: bool = True,
    sink: Callable[[StepExample], None] | None = None,
) -> Converted:
    """openr flat rows `reasoning_steps: [{"solution_prefix", "mc_value"}]` (see `prefix_paths`)."""

    def read(row: dict[str, Any], notes: Counter[str]) -> tuple[str, list[str], list[tuple[list[str], list[float]]]]:
        question = _text(row, ("question",))
        items = row.get("reasoning_steps")
        if not isinstance(items, list):
            raise RowError("reasoning_steps", "no prefixes", "missing or not a list of {solution_prefix, mc_value}")
        prefixes = []
        for k, item in enumerate(items):
            if not isinstance(item, dict) or not isinstance(item.get("solution_prefix"), str):
                raise RowError(f"reasoning_steps[{k}]", "prefix without text", "needs a 'solution_prefix' string")
            prefixes.append((item["solution_prefix"], _mc(item, f"reasoning_steps[{k}]")))
        images = _images(row, Path(image_root))
        paths = prefix_paths(question.strip(), [(p.strip(), v) for p, v in prefixes], notes)
        if not paths:
            raise RowError(
                "reasoning_steps",
                "no steps after the question",
                "no prefix extends the question text (nothing to label)",
            )
        return question, images, [_drop_empty_steps(steps, labels, notes) for steps, labels in paths]

    return _convert_paths(rows, "openr_flat", read, source, id_prefix, check_images, sink)


_MMPRM_HUMAN = re.compile(r"^(?:\s*<image>\s*\n)*\s*Question:\s*(.*?)\nProcess:\s*(.*)$", re.S)


def convert_mmprm_prm(
    rows: Iterable[dict[str, Any]],
    source: str = "rows",
    separator: str = "<prm>",
    image_root: str | Path = ".",
    id_prefix: str = "",
    check_images: bool = True,
    sink: Callable[[StepExample], None] | None = None,
) -> Converted:
    """MM-PRM rows: a process string with steps joined by `separator`, plus one float label per step.

    Accepts `{"question"|"prompt", "image"|"images"|"image_path", "process"|"response", "labels"}`
    and MM-PRM's own training rows `{"image", "conversations": [{"value": "Question: ...\\nProcess:
    ..."}, {"value": [labels]}]}`. A trailing separator ends the last step (MM-PRM writes
    `s1<prm>s2<prm>`); a step count that differs from the label count skips the row.
    """
    if not separator:
        raise ValueError("separator must be a non-empty string such as '<prm>'")
    result, ids = Converted(sink=sink), _Ids(id_prefix)
    for n, row in enumerate(rows, start=1):
        result.rows += 1
        rid = _row_id(row, "mmprm_prm", n)
        try:
            conv = row.get("conversations")
            if isinstance(conv, list) and len(conv) >= 2 and all(isinstance(c, dict) for c in conv):
                m = _MMPRM_HUMAN.match(conv[0].get("value") or "") if isinstance(conv[0].get("value"), str) else None
                if m is None:
                    raise RowError(
                        "conversations[0].value",
                        "no 'Question: ...\\nProcess: ...' text",
                        "must read 'Question: <text>\\nProcess: <steps joined by the separator>'",
                    )
                question, process, labels = m.group(1).strip(), m.group(2), conv[1].get("value")
            else:
                question = _text(row, ("question", "prompt"))
                process = _text(row, ("process", "response"))
                labels = row.get("labels")
            if isinstance(labels, str):  # some dumps store the label list as JSON text
                try:
                    labels = json.loads(labels)
                except json.JSONDecodeError:
                    pass
            if not isinstance(labels, list):
                raise RowError("labels", "labels is not a list", "missing or not a list of floats in [0,1]")
            parts = process.split(separator)
            if not parts[-1].strip():
                parts = parts[:-1]
            if len(parts) != len(labels):
                raise RowError(
                    "labels",
                    "steps/labels count mismatch",
                    f"{len(labels)} labels for {len(parts)} steps split on {separator!r} "
                    "(fix the separator with --separator or the label list)",
                )
            ys = [_label(y, f"labels[{i}]") for i, y in enumerate(labels)]
            steps, ys = _drop_empty_steps(parts, ys, result.notes)
            images = _images(row, Path(image_root))
        except RowError as e:
            result.skip(f"{source}:{n}", rid, e)
            continue
        example = StepExample(
            id=ids(rid), question=question, steps=steps, images=images, labels=ys, meta={"source": "mmprm_prm"}
        )
        result.keep(f"{source}:{n}", example, check_images)
    return result


# ---------------------------------------------------------------------------------------------
# Files and the CLI


def _save_embedded(item: Any, image_dir: Path | None) -> Any:
    """A datasets image `{"bytes", "path"}` as a file path: embedded bytes go to `image_dir`."""
    if not isinstance(item, dict) or not item.get("bytes") or image_dir is None:
        return item
    data = item["bytes"]
    suffix = Path(item.get("path") or "").suffix or ".png"
    # Content-hash names: the same image used by many rows is written once.
    target = image_dir / f"{hashlib.sha1(data).hexdigest()[:20]}{suffix}"
    if not target.exists():
        image_dir.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return str(target.resolve())


def read_input_rows(path: str | Path, image_dir: str | Path | None = None) -> Iterator[dict[str, Any]]:
    """Rows of a `.jsonl` file, a `.json` array, a `.parquet` file or a `datasets.save_to_disk` folder.

    Image columns of a datasets input are read as paths, never decoded; images embedded as
    bytes (as `save_to_disk` and the Hub store them) are written once to `image_dir` (left as
    `{"bytes", "path"}` when it is None). Raises DataError naming the line for a broken JSONL
    line: a half-written input file should be fixed, not half converted.
    """
    path = Path(path)
    if not path.exists():
        raise DataError([f"{path}: file not found (check --input)"])
    if path.is_dir() or path.suffix == ".parquet":
        import datasets

        ds = datasets.load_from_disk(str(path)) if path.is_dir() else datasets.Dataset.from_parquet(str(path))
        if isinstance(ds, datasets.DatasetDict):
            raise DataError([f"{path}: holds splits {list(ds)} (pass one split's folder as --input)"])
        image_cols = []
        for name, feat in ds.features.items():
            if isinstance(feat, datasets.Image):
                ds = ds.cast_column(name, datasets.Image(decode=False))
                image_cols.append(name)
            elif isinstance(feat, (datasets.List, datasets.Sequence)) and isinstance(feat.feature, datasets.Image):
                ds = ds.cast_column(name, datasets.List(datasets.Image(decode=False)))
                image_cols.append(name)
        out_dir = Path(image_dir) if image_dir is not None else None
        for row in ds:
            for name in image_cols:
                value = row[name]
                row[name] = (
                    [_save_embedded(v, out_dir) for v in value]
                    if isinstance(value, list)
                    else _save_embedded(value, out_dir)
                )
            yield row
        return
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    if head.startswith(b"["):  # one JSON array (MM-PRM writes these)
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise DataError([f"{path}:{e.lineno}: id=?: file: invalid JSON: {e.msg} (fix the file)"]) from None
        for k, obj in enumerate(data):
            if not isinstance(obj, dict):
                raise DataError([f"{path}:item {k}: id=?: item: not a JSON object (each item must be one row)"])
            yield obj
        return
    for lineno, obj, err in iter_jsonl(path):
        if err:
            raise DataError([f"{path}:{lineno}: id=?: line: {err}"])
        yield obj


def convert_file(
    fmt: str,
    path: str | Path,
    image_root: str | Path | None = None,
    id_prefix: str = "",
    check_images: bool = True,
    neutral: float = 1.0,
    alternatives: bool = False,
    separator: str = "<prm>",
    limit: int | None = None,
    image_dir: str | Path | None = None,
    sink: Callable[[StepExample], None] | None = None,
) -> Converted:
    """Convert one input file of format `fmt` (one of FORMATS).

    `image_dir` receives images embedded as bytes in a datasets/parquet input (see `read_input_rows`);
    `sink` takes each example as it is made (see `Converted`).
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    path = Path(path)
    root = Path(image_root) if image_root is not None else (path if path.is_dir() else path.parent)
    rows: Iterable[dict[str, Any]] = read_input_rows(path, image_dir)
    if limit is not None:
        rows = itertools.islice(rows, limit)
    common = {"source": str(path), "id_prefix": id_prefix, "check_images": check_images, "sink": sink}
    converters: dict[str, Callable[[], Converted]] = {
        "trl": lambda: convert_trl(rows, image_root=root, **common),
        "math_shepherd": lambda: convert_math_shepherd(rows, **common),
        "prm800k": lambda: convert_prm800k(rows, neutral=neutral, alternatives=alternatives, **common),
        "openr_tree": lambda: convert_openr_tree(rows, image_root=root, **common),
        "openr_flat": lambda: convert_openr_flat(rows, image_root=root, **common),
        "mmprm_prm": lambda: convert_mmprm_prm(rows, separator=separator, image_root=root, **common),
    }
    return converters[fmt]()


def _prm_data_reader(fmt: str) -> Callable[..., Converted]:
    def read(path: str | Path, **options: Any) -> Converted:
        return convert_file(fmt, path, **options)

    read.__doc__ = f"`convert_file({fmt!r}, path, **options)`: {fmt} rows as step-labelled examples."
    read.__qualname__ = f"convert_file[{fmt}]"
    return read


# The prm_data readers of `mmprm.data.readers`, one per input format.
for _fmt in FORMATS:
    register_reader("prm_data", _fmt)(_prm_data_reader(_fmt))


def cli_convert(argv: list[str]) -> int:
    """`mmprm convert --from FORMAT --input PATH --out OUT.jsonl`: exit 0 when examples were written."""
    parser = argparse.ArgumentParser(
        prog="mmprm convert",
        description="Import PRM data into mmprm's step-labelled JSONL.",
        epilog="Skipped rows are listed on stderr with the reason. Images embedded in a datasets/parquet input "
        "are written to OUT_images/ next to the output.",
    )
    parser.add_argument("--from", dest="fmt", required=True, choices=FORMATS, help="input format")
    parser.add_argument("--input", required=True, help=".jsonl, .json array, .parquet or datasets folder")
    parser.add_argument("--out", required=True, help="output step-labelled JSONL")
    parser.add_argument("--image-root", default=None, help="folder for relative image paths (default: the input's)")
    parser.add_argument("--id-prefix", default="", help="prepended to every id, e.g. 'shepherd-'")
    parser.add_argument("--no-image-check", action="store_true", help="do not open image files")
    parser.add_argument("--neutral", type=float, default=1.0, help="prm800k: label of a 0 (neutral) rating")
    parser.add_argument(
        "--alternatives", action="store_true", help="prm800k: also emit rated completions the labeler did not follow"
    )
    parser.add_argument("--separator", default="<prm>", help="mmprm_prm: step separator in the process text")
    parser.add_argument("--limit", type=int, default=None, help="convert only the first N rows")
    parser.add_argument("--show", type=int, default=10, help="how many skipped rows to list on stderr")
    args = parser.parse_args(argv)
    out = Path(args.out)
    result = None
    try:
        # Each example is written as it is made (memory does not grow with the input); the file
        # appears only once the whole input is converted, and not at all when nothing was.
        with atomic_write(out) as f:
            result = convert_file(
                args.fmt,
                args.input,
                args.image_root,
                args.id_prefix,
                not args.no_image_check,
                args.neutral,
                args.alternatives,
                args.separator,
                args.limit,
                image_dir=out.parent / f"{out.stem}_images",
                sink=lambda ex: f.write(json.dumps(ex.to_json(), ensure_ascii=False) + "\n"),
            )
            if not result.count:
                raise _NothingConverted
    except _NothingConverted:
        print(result.summary(args.show), file=sys.stderr)
        print(
            f"mmprm convert: no example could be converted from {args.input}; nothing written "
            f"(is --from {args.fmt} the right format?)",
            file=sys.stderr,
        )
        return 1
    except (DataError, ValueError) as e:
        print(f"mmprm convert: {e}", file=sys.stderr)
        return 1
    print(result.summary(args.show), file=sys.stderr)
    print(f"wrote {result.count} examples to {args.out}", file=sys.stderr)
    return 0


class _NothingConverted(Exception):
    """No row converted: the output is not written."""
