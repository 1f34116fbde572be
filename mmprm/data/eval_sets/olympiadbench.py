"""OlympiadBench (the OE_MM_maths_en_COMP subset MM-PRM reports) as problems, and its judge.

Released rows (`data/<subset>.json` of OlympiadBench's download; `Hothan/OlympiadBench`, config
`<subset>`, split `train`, on the Hub, with the images themselves in `image_1` ... `image_5`)::

    {"id": 2231, "subfield": "Geometry", "context": null, "question": "... <img_3362> ...",
     "solution": ["..."], "final_answer": ["$\\frac{1}{2}$"], "is_multiple_answer": false,
     "unit": null, "answer_type": "Numerical", "error": null,
     "image_1": "images/2231_1.png" | <image> | null, ..., "image_5": null}

`<img_N>` tags in the text become `<image1>`, `<image2>`, ... when there are as many tags as
images, else the images go before the question. When the problem has several answers or a unit,
the question says so (OlympiadBench's prompt does the same): answers comma-separated, unit left out.

The first release (`Chinese_Olympiad_Mathematics.json`, `Gaokao_Maths.json`, ...: pass its file
name as `subset`) has no image fields: its figures are `![](https://cdn.mathpix.com/...)` links in
the text. Those rows are read as text, links kept, and `meta["remote_figures"]` counts the links.

Scoring is `inference/judge.py`'s (github:OpenBMB/OlympiadBench@ba5b26a7e2849940b598a9159c1190daa2b9175f):
`olympiad_extract` takes the answer out of a reply, `olympiad_judge(model_answer, gold, precision)`
is its `MathJudger.judge`, with the row's `error` as precision except for Tuple answers.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mmprm.answers import call_with_timeout, math_verify_equal, sympy_answer
from mmprm.data.eval_sets._source import check_exists, image_file, load_rows, require_fields
from mmprm.data.registry import register_reader

SUBSET = "OE_MM_maths_en_COMP"
BREAKDOWN = ("subfield", "answer_type")
DEFAULT_PRECISION = 1e-8
_IMG_TAG = re.compile(r"<img_\d+>")
# The first release (Feb 2024) links each figure as a Mathpix crop: `![](https://cdn.mathpix.com/...)`.
_REMOTE_FIGURE = re.compile(r"!\[[^\]]*\]\(https?://[^)]*\)")


@register_reader("answer_benchmark", "olympiadbench")
def read_olympiadbench(
    source: str | Path,
    subset: str = SUBSET,
    split: str = "train",
    image_root: str | Path | None = None,
    image_dir: str | Path | None = None,
) -> list[dict[str, Any]]:
    """OlympiadBench problems `{id, question, images, answer, choices, solution, meta}`, in file order.

    Args:
        source: `<subset>.json` or its folder, a parquet or `save_to_disk` copy, or `Hothan/OlympiadBench`.
        subset: the file name / Hub config (`OE_MM_maths_en_COMP`: open-ended, multimodal, maths, English).
        split: the Hub split (OlympiadBench has one, `train`).
        image_root: where the rows' image paths start (default: the file's folder).
        image_dir: where images held in the rows are written.
    """
    rows, root = load_rows(source, split, (f"{subset}.json", f"data/{subset}.json"), config=subset)
    root = Path(image_root).resolve() if image_root is not None else root
    out_dir = Path(image_dir) if image_dir is not None else None
    problems = []
    for n, r in enumerate(rows):
        require_fields(r, ("id", "question", "final_answer"), source, n, "id")
        rid = str(r["id"])
        images = []
        for k in range(1, 6):
            value = r.get(f"image_{k}")
            if value is None or value == "":
                continue
            image = image_file(value, root, out_dir, f"olympiadbench-{rid}-{k}")
            images.append(str(check_exists(image, f"{source}: id={rid}", "copy OlympiadBench's images/ there")))
        text = r["question"] if not r.get("context") else f"{r['context']}\n{r['question']}"
        tags = _IMG_TAG.findall(text)
        if tags and len(tags) == len(images):
            pieces = _IMG_TAG.split(text)  # one more piece than tags
            text = pieces[0] + "".join(f"<image{k}>{piece}" for k, piece in enumerate(pieces[1:], start=1))
        else:
            text = _IMG_TAG.sub("", text)
        if r.get("is_multiple_answer"):
            text += "\nThe problem has several answers: give them all, separated by commas."
        if r.get("unit"):
            text += f"\nThe unit of the answer is {r['unit']}; leave it out of the final answer."
        final = r["final_answer"]
        answer = final[0] if isinstance(final, list) else final
        solution = r.get("solution")
        chinese = "_zh_" in subset or subset.startswith(("Chinese_", "Gaokao_"))
        problems.append(
            {
                "id": rid,
                "question": text,
                "images": images,
                "answer": str(answer),
                "choices": None,
                "solution": "\n\n".join(solution) if isinstance(solution, list) else solution,
                "meta": {
                    "source": "olympiadbench",
                    "subset": subset,
                    "subfield": r.get("subfield"),
                    "answer_type": r.get("answer_type"),
                    "is_multiple_answer": bool(r.get("is_multiple_answer")),
                    "unit": r.get("unit"),
                    "error": r.get("error"),
                    "chinese": chinese,
                    # figures that are only links cannot be shown to a model here: the row is read as text
                    "remote_figures": len(_REMOTE_FIGURE.findall(text)),
                    "breakdown": list(BREAKDOWN),
                },
            }
        )
    return problems


# ---------------------------------------------------------------- the judge, re-expressed

_REPLACE = {
    "\\left": "",
    "\\right": "",
    "∶": ":",
    "，": ",",
    "$": "",
    "\\approx": "=",
    "\\simeq": "=",
    "\\sim": "=",
    "^\\prime": "'",
    "^{\\prime}": "'",
    "^\\circ": "",
    "%": "",
}
_EDGE = "\n$,.:;^_=+`!@#$%^&*~，。"


def _boxed_all(text: str) -> list[str] | None:
    """Contents of every `\\boxed{...}`, None if there is none; ValueError if one never closes
    (the judge then finds the answer wrong)."""
    found = []
    for m in re.finditer(r"\\boxed{", text):
        depth, i = 1, m.end()
        while depth and i < len(text):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth:
            raise ValueError("mismatched braces in \\boxed{}")
        found.append(text[m.end() : i - 1])
    return found or None


def olympiad_prepare(text: str) -> str:
    """The answer text the judge compares: boxed contents (comma-joined), else the `$...$` of the
    last line, else all of it; `x \\in` dropped, `\\left`/`\\right`/`$`/`%`/degree removed, `\\approx`
    as `=`, edge punctuation stripped, `\\mathrm{X}`/`\\mathbf{X}` as X."""
    parts = _boxed_all(text)
    if parts is None:
        parts = re.findall(r"\$(.*?)\$", text.strip().split("\n")[-1]) or [text]
    s = ",".join(parts)
    if "\\in " in s:
        s = s.split("\\in ")[1]
    for old, new in _REPLACE.items():
        s = s.replace(old, new)
    s = s.strip(_EDGE)
    return re.sub(r"\\(?:mathrm|mathbf)\{~?([^}]*)\}", r"\1", s)


def _split_top_level(s: str) -> list[str]:
    """Split at commas outside (), []: "(2,1),(3,1)" -> ["(2,1)", "(3,1)"]."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        depth += (ch in "([") - (ch in ")]")
        if ch == "," and depth == 0:
            parts.append(s[start:i].strip())
            start = i + 1
    if start < len(s):
        parts.append(s[start:].strip())
    return parts


def _expand_pm(items: list[str]) -> list[str]:
    out = []
    for it in items:
        out += [it.replace("\\pm", "+"), it.replace("\\pm", "-")] if "\\pm" in it else [it]
    return out


def _number(s: str) -> float | None:
    try:
        return float(s)
    except ValueError:
        return None


def _value(s: str) -> Any | None:
    """The right-hand side of `a = b` (or all of s), parsed to sympy; None if it does not parse."""
    s = s.split("=")[1] if "=" in s else s
    import math_verify  # noqa: F401 - outside the time limit: the first import takes seconds

    return call_with_timeout(lambda: _parse(s), None)


def _parse(s: str) -> Any | None:
    # A command in a subscript is a label (R_{\odot}), which the parser does not know as an operator.
    return sympy_answer(re.sub(r"_\{?\\([a-zA-Z]+)\}?", r"_{\1}", s.strip()))


def _too_big(expr: Any) -> bool:
    """A power tower or a power over 10^4 (10^{10^{10}}): too big to evaluate, as the judge refuses it."""
    import sympy

    for node in sympy.preorder_traversal(expr):
        if node.is_Pow and node.exp.is_number and (node.exp.has(sympy.Pow) or abs(float(node.exp)) > 1e4):
            return True
    return False


def _expressions_equal(gold: str, pred: str, tol: float) -> bool:
    """Numbers within `tol` once evaluated; symbolic expressions equal (math-verify, or a zero difference)."""
    g, p = _value(gold), _value(pred)
    if g is None or p is None:
        return False
    g_free, p_free = bool(getattr(g, "free_symbols", None)), bool(getattr(p, "free_symbols", None))
    if g_free != p_free:
        return False
    if not g_free:

        def close() -> bool:
            if _too_big(g) or _too_big(p):
                return False
            return abs(complex(g.evalf()) - complex(p.evalf())) <= tol * 1.01

        return call_with_timeout(close, False)
    lhs = gold.split("=")[1] if "=" in gold else gold
    rhs = pred.split("=")[1] if "=" in pred else pred
    if math_verify_equal(rhs.strip(), lhs.strip()):
        return True

    def zero_difference() -> bool:
        import sympy

        return abs(complex(sympy.simplify(g - p).evalf())) < 1e-3

    return call_with_timeout(zero_difference, False)


def _equations_equal(gold: str, pred: str) -> bool:
    """Two equations whose sides' differences are integer multiples of each other (x^2=1-y^2 vs x^2+y^2=1)."""
    if gold.count("=") != 1 or pred.count("=") != 1:
        return False

    def proportional() -> bool:
        import sympy

        diffs = []
        for eq in (gold, pred):
            lhs, rhs = eq.split("=")
            a, b = _parse(lhs), _parse(rhs)
            if a is None or b is None:
                return False
            diffs.append(sympy.simplify(a - b))
        if diffs[0] == 0 or diffs[1] == 0:
            return False
        q1, q2 = sympy.simplify(diffs[0] / diffs[1]), sympy.simplify(diffs[1] / diffs[0])
        return any(q.is_Integer and q != 0 for q in (q1, q2))

    return call_with_timeout(proportional, False)


def _intervals_equal(gold: str, pred: str, tol: float) -> bool:
    gs, ps = gold.split("\\cup"), pred.split("\\cup")
    if len(gs) != len(ps):
        return False
    for g, p in zip(gs, ps):
        g, p = g.strip(), p.strip()
        if g[:1] != p[:1] or g[-1:] != p[-1:]:
            return False
        g_ends, p_ends = g.strip("[]()").split(","), p.strip("[]()").split(",")
        if len(g_ends) != len(p_ends):
            return False
        for a, b in zip(g_ends, p_ends):
            if a.strip() != b.strip() and not _expressions_equal(a, b, tol):
                return False
    return True


def _is_interval(s: str) -> bool:
    return s.startswith(("(", "[")) and s.endswith((")", "]"))


def _item_equal(gold: str, pred: str, tol: float) -> bool:
    if gold == pred and gold:
        return True
    if _is_interval(gold) and _is_interval(pred):
        return _intervals_equal(gold, pred, tol)
    g, p = _number(gold), _number(pred)
    if g is not None and p is not None:
        # a percentage may be written as its fraction or the other way round
        if any(abs(x - p) <= tol * 1.01 for x in (g / 100, g, g * 100)):
            return True
    if not ("=" in gold and "=" in pred) and _expressions_equal(gold, pred, tol):
        return True
    return "=" in gold and "=" in pred and _equations_equal(gold, pred)


def olympiad_judge(expression1: str, expression2: str, precision: float | list[float] = DEFAULT_PRECISION) -> bool:
    """OlympiadBench's `MathJudger.judge(expression1, expression2, precision)`, re-expressed.

    Both are prepared (`olympiad_prepare`); equal texts match. Otherwise both split into answers at
    top-level commas (`\\pm` giving two), the counts must agree, and each answer of `expression1`,
    taken in the judge's order with its own precision, must match a different one of `expression2`:
    as intervals, as numbers within the precision (`expression1`'s value, x100 or /100, for
    percentages), as expressions (evaluated within the precision, or symbolically equal), or as
    equations that are multiples of each other. The scaling and the precisions belong to
    `expression1`: the ground truth in the judge's examples, the model's answer in
    `inference/judge.py`.

    Args:
        expression1: the reference side (a `\\boxed{}` in it is found).
        expression2: the other side.
        precision: absolute tolerance, one for all answers or one per answer (OlympiadBench's `error`).
    """
    try:
        e1, e2 = olympiad_prepare(expression1), olympiad_prepare(expression2)
    except Exception:  # noqa: BLE001 - as the judge: unpreparable text is wrong
        return False
    if e1 == e2:
        return True
    e1, e2 = re.sub(r"[\u4e00-\u9fff]+", "", e1), re.sub(r"[\u4e00-\u9fff]+", "", e2)
    items1, items2 = _expand_pm(_split_top_level(e1)), _expand_pm(_split_top_level(e2))
    tols = list(precision) if isinstance(precision, list) else [precision]
    if len(tols) <= 1:
        tols = tols * len(items1)
    if len(items1) != len(items2):
        return False
    # The judge's own walk: a rotating index over what is left, removing each matched pair.
    idx = -1
    while items1:
        idx = (idx + 1) % len(items1)
        item, tol = items1[idx], tols[idx] if idx < len(tols) else DEFAULT_PRECISION
        hit = next((cand for cand in items2 if _item_equal(item, cand, tol)), None)
        if hit is None:
            return False
        items1.remove(item)
        items2.remove(hit)
        if tol in tols:
            tols.remove(tol)
    return True


def olympiad_equal(pred: str, gold: str, precision: float | list[float] = DEFAULT_PRECISION) -> bool:
    """The judge with the gold answer as reference, as its examples call it: `judge(gold, pred)`."""
    return olympiad_judge(gold, pred, precision)


_FINAL = {False: re.compile("So the final answer is (.*)"), True: re.compile("所以最终答案是(.*)")}


def olympiad_extract(reply: str, chinese: bool = False) -> str:
    """The answer text `inference/judge.py` `extract_answer` hands the judge: the rest of the line
    after the last "So the final answer is" ("所以最终答案是" for Chinese rows), else the whole
    reply, whose every `\\boxed{}` the judge then joins with commas."""
    found = _FINAL[chinese].findall(reply)
    return found[-1].strip() if found else reply


def olympiad_precision(error: str | float | None) -> float | list[float]:
    """The tolerance a row's `error` field gives: "1e-2", "0.01,0.5" (one per answer, empty = 1e-8), or none."""
    if error in (None, ""):
        return DEFAULT_PRECISION
    if isinstance(error, (int, float)):
        return float(error)
    if "," in error:
        return [float(e) if e.strip() else DEFAULT_PRECISION for e in error.split(",")]
    return float(error)


def olympiadbench_correct(pred: str | None, answer: str, choices: list[str] | None, meta: dict[str, Any]) -> bool:
    """Whether a reply (or its extracted answer) is right on OlympiadBench, as `inference/judge.py`
    scores it: `olympiad_extract`, then `judge(model_answer, gold, precision)` with the row's
    `error` as precision, none for Tuple answers. A trailing copy of the row's unit is dropped
    first: the prompt asks for the answer without it, and the judge would compare it as a symbol."""
    if pred is None or not pred.strip():
        return False
    pred = olympiad_extract(pred, bool(meta.get("chinese")))
    unit = (meta.get("unit") or "").strip()
    if unit and pred.strip().endswith(unit):
        pred = pred.strip()[: -len(unit)].strip()
    tuple_answer = "Tuple" in (meta.get("answer_type") or "")
    precision = DEFAULT_PRECISION if tuple_answer else olympiad_precision(meta.get("error"))
    return olympiad_judge(pred, answer, precision)
