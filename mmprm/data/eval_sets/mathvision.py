"""MATH-Vision (MATH-V, test and testmini) as problems, and its official answer extraction and judge.

Released rows (`data/test.jsonl`, `data/testmini.jsonl` of github:mathllm/MATH-V, images in the
repository's `images/`; `MathLLMs/MathVision` on the Hub, splits `test` and `testmini`, with the
image itself in `decoded_image`)::

    {"id": "4", "question": "...<image1>", "options": ["A", ..., "E"] | [], "answer": "E",
     "solution": null, "level": 3, "subject": "metric geometry - angle", "image": "images/4.jpg"}

Two things are adapted so the rows fit `mmprm.steps`:

- 58 testmini questions do not hold exactly one `<imageK>` placeholder: some name parts of the one
  composite figure (`<image1>` ... `<image7>`), repeat one, or have none. Their placeholders become
  text (`[image K]`) and the image goes before the question, as for a question with none.
- Options that are texts (`["$25^\\circ$", ...]`) are appended as "Choices: (A) ... (B) ...";
  bare letters (`["A", ..., "E"]`) are not, since the choices are drawn in the image.

Scoring is MATH-V's own (`evaluation/evaluate.py` and `evaluation/utils.py` at
github:mathllm/MATH-V@a1f5cc3add200c0cd080fad463e500f44ef1fb41): `mathvision_extract` takes the
answer out of a reply as `evaluate(..., regen_answer=True)` does, `mathvision_equal` is `is_equal`
(lowercase, tuples evaluated, latex2sympy values equal to 2 decimals), and a reply is right when its
answer equals the gold letter or the gold option's value.
"""

from __future__ import annotations

import functools
import math
import re
from pathlib import Path
from typing import Any

from mmprm.answers import call_with_timeout
from mmprm.data.eval_sets._source import check_exists, image_file, load_rows
from mmprm.data.registry import register_reader
from mmprm.steps import IMAGE_PLACEHOLDER

BREAKDOWN = ("subject", "level")


def has_option_texts(options: list[str]) -> bool:
    """True unless the options are just their own letters (A, B, C, ...)."""
    return bool(options) and any(o.strip().strip("()") != chr(65 + i) for i, o in enumerate(options))


def mathv_question(question: str, options: list[str]) -> str:
    """The question as mmprm feeds it: at most one image placeholder, option texts appended."""
    if has_option_texts(options):
        listed = " ".join(f"({chr(65 + i)}) {o}" for i, o in enumerate(options))
        question = f"{question}\nChoices: {listed}"
    # Options may be placeholders themselves ("(A) <image2>"), so count after appending them.
    if len(IMAGE_PLACEHOLDER.findall(question)) > 1:
        question = IMAGE_PLACEHOLDER.sub(lambda m: f"[image {m.group(1) or 1}]", question)
    return question


def _refuse(where: str, field: str, why: str) -> ValueError:
    return ValueError(f"{where}: {field}: {why} (use MATH-V's rows as released)")


@register_reader("answer_benchmark", "mathvision")
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

    Raises:
        ValueError: a row lacks a field or holds a wrong one (named by file, line and field).
        FileNotFoundError: the file, or a row's image, is not there.
    """
    rows, root = load_rows(source, split, (f"{split}.jsonl",))
    path = Path(source) / f"{split}.jsonl" if Path(source).is_dir() else source
    root = Path(image_root).resolve() if image_root is not None else root
    out_dir = Path(image_dir) if image_dir is not None else None
    problems = []
    for n, r in enumerate(rows):
        where = f"{path}:{n + 1}: id={r.get('id')}"
        for field in ("id", "question", "answer"):
            if r.get(field) is None:
                raise _refuse(where, field, "missing")
        options = r.get("options") or []
        if not isinstance(options, list):
            raise _refuse(where, "options", f"a list of option texts, not {type(options).__name__}")
        answer = str(r["answer"])
        if options and (len(answer) != 1 or not 0 <= ord(answer) - 65 < len(options)):
            raise _refuse(where, "answer", f"{answer!r} is not a letter of the {len(options)} options")
        value = r["decoded_image"] if r.get("decoded_image") is not None else r.get("image")
        if value is None:
            raise _refuse(where, "image", "missing")
        rid = str(r["id"])
        image = image_file(value, root, out_dir, f"mathvision-{rid}")
        if isinstance(value, str) and not image.is_file() and root is not None and image_root is None:
            image = (root.parent / value).resolve()  # MATH-V's data/ folder, images/ beside it
        check_exists(image, where, "copy MATH-V's images/ folder there, or pass image_root=")
        problems.append(
            {
                "id": rid,
                "question": mathv_question(r["question"], options),
                "images": [str(image)],
                "answer": answer,
                "choices": list(options) or None,
                "solution": r.get("solution"),
                "meta": {
                    "source": "mathvision",
                    "split": split,
                    "level": r.get("level"),
                    "subject": r.get("subject"),
                    "breakdown": list(BREAKDOWN),
                },
            }
        )
    return problems


# ---------------------------------------------------------------- the official extraction


def _fix_sqrt(s: str) -> str:
    if "\\sqrt" not in s:
        return s
    parts = s.split("\\sqrt")
    out = parts[0]
    for part in parts[1:]:
        out += "\\sqrt{" + part[0] + "}" + part[1:] if part and part[0] != "{" else "\\sqrt" + part
    return out


def _fix_fracs(s: str) -> str:
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part[:1] == "{":
            out += part
            continue
        if len(part) < 2:
            return s
        a, b, rest = part[0], part[1], part[2:]
        out += "{" + a + "}{" + b + "}" + rest if b != "{" else "{" + a + "}" + b + rest
    return out


def _fix_a_slash_b(s: str) -> str:
    if len(s.split("/")) != 2:
        return s
    a, b = s.split("/")
    try:
        ia, ib = int(a), int(b)
    except ValueError:
        return s
    return "\\frac{" + str(ia) + "}{" + str(ib) + "}" if s == f"{ia}/{ib}" else s


def _strip_string(s: str) -> str:
    """utils.py `_strip_string`, step for step (units after `\\text{ ` dropped, `=`'s right side kept)."""
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac").replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "").replace("$", "")
    s = s.split("\\text{ ")[0]
    s = s.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    if len(s.split("=")) == 2:
        s = s.split("=")[-1]
    if len(s.split("\\approx")) == 2:
        s = s.split("\\approx")[-1]
    if "sqrt" in s:
        s = _fix_sqrt(s)
    s = s.replace(" ", "")
    if "sqrt" in s:  # the official code fixes fractions only where a root is
        s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_a_slash_b(s)


def find_math_answer(s: str) -> str:
    """utils.py `find_math_answer`: the last `\\boxed{}` (else all of `s`), lowercased and cleaned."""
    s = s.lower().replace("{}", "")
    found = re.findall("oxed{(.*)}", s, flags=re.S)
    ans = found[-1] if found else s
    if ans.find("}") != -1 and (ans.find("{") == -1 or ans.find("}") < ans.find("{")):
        ans = ans.split("}")[0]
    ans = ans.split("=")[-1].split("\\approx")[-1]
    for old, new in (
        (" ", ""), ("\\,", ""), ("∞", "\\infty"), ("+\\infty", "\\infty"), ("\\\\", "\\"), ("\n", ""),
        ("\\text", ""), ("\\mbox", ""), ("bmatrix", "pmatrix"), ("\\left", ""), ("\\right", ""),
        ("^{\\circ}", ""), ("^\\circ", ""), ("{m}^3", ""), ("m^3", ""), ("{units}", ""), ("units", ""),
        ("{km}", ""), ("km", ""),
    ):  # fmt: skip
        ans = ans.replace(old, new)
    return _strip_string(ans)


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


_PHRASES = ("the final answer is", "the answer is", "the correct answer is", "the answer should be")


def mathvision_extract(reply: str) -> str:
    """The answer MATH-V's `evaluate.py` takes out of a reply (its `model_answer`), lowercased.

    A reply ending " C." / starting "C\\n" is that letter; a number after the last "is " is kept;
    without a `\\boxed{`, the text after the last answer phrase (first line, first sentence); then
    `find_math_answer` and "(a)"/"{a}" as "a".
    """
    ans = reply.strip()
    for c in "ABCDE":
        if ans.endswith((f" {c}.", f" ({c}).")) or ans.startswith((f"{c}\n", f"({c})\n", f"({c}) {c}\n")):
            ans = c
    if _is_number(ans.split("is ")[-1].rstrip(".")):
        ans = ans.split("is ")[-1].rstrip(".")
    if "oxed{" not in ans:
        for flag in _PHRASES:
            for phrase in (flag, flag.replace("the", "The")):
                raw = ans
                ans = ans.split(phrase)[-1].strip()
                if phrase in raw:
                    ans = ans.split("\n")[0].split(". ")[0]
    elif ans.count("oxed{") > 1:
        ans = "\\boxed{" + ans.split("oxed{")[-1]
    ans = find_math_answer(ans)
    for c in "abcde":
        ans = ans.replace(f"({c})", c).replace(f"{{{c}}}", c)
    return ans.rstrip(".").lstrip(":").strip()


# ---------------------------------------------------------------- the official judge

# `is_equal` evaluates sympy's text of an answer with Python's eval inside utils.py, where
# `from math import *` is in scope: math's names and plain arithmetic only, no other builtins.
_EVAL_NAMES: dict[str, Any] = {k: getattr(math, k) for k in dir(math) if not k.startswith("_")}
_EVAL_NAMES.update({"abs": abs, "round": round, "min": min, "max": max, "pow": pow, "int": int, "float": float})


def _parse_prefix(s: str) -> str:
    """The text MATH-V's latex2sympy (ANTLR, no end-of-input rule) reads: up to the first unmatched
    `}` (`2\\sqrt{3}}.so, ...` -> `2\\sqrt{3}`) or the first period not before a digit, without
    `$`, one outer `{...}` as a group."""
    depth = 0
    for i, ch in enumerate(s):
        depth += (ch == "{") - (ch == "}")
        if depth < 0:
            s = s[:i]
            break
    s = re.sub(r"(?<!\\)\$", "", s).strip()
    s = re.split(r"\.(?!\d)", s, maxsplit=1)[0]  # nor a period that ends a sentence: `5.so, ...` -> `5`
    if s.startswith("{") and s.endswith("}") and _parse_prefix(s[1:-1]) == s[1:-1]:
        s = s[1:-1]
    return s


_NOT_PARSED = ("\\circ", "\\$", "\\!", "\\boxed", "%", "π")


@functools.lru_cache(maxsize=65536)
def _rounded(s: str) -> float | None:
    """round(eval(str(latex2sympy(s))), 2), as `is_equal` computes a value; None where that fails."""
    import latex2sympy2_extended  # noqa: F401 - outside the time limit: the first import takes seconds

    return call_with_timeout(lambda: _evaluate(s), None)


def _evaluate(s: str) -> float:
    import sympy
    from latex2sympy2_extended import latex2sympy
    from latex2sympy2_extended.math_normalization import NormalizationConfig

    # MATH-V's latex2sympy2 (1.9) fails on these, which this parser's grammar and clean-ups accept:
    # refuse them, and keep the clean-ups off.
    s = _parse_prefix(s).replace("\\displaystyle", "")
    if any(t in s for t in _NOT_PARSED):
        raise ValueError("not parsed by MATH-V's latex2sympy")
    off = NormalizationConfig(
        basic_latex=False, units=False, malformed_operators=False, nits=False, boxed="none", equations=False
    )
    expr = latex2sympy(s, normalization_config=off)
    # Python's integer power cannot be interrupted: a power tower would never return.
    for node in sympy.preorder_traversal(expr):
        if node.is_Pow and node.exp.is_number and (node.exp.has(sympy.Pow) or abs(complex(node.exp)) > 1e4):
            raise ValueError("too big to evaluate")
    return round(eval(str(expr), {"__builtins__": {}}, _EVAL_NAMES), 2)  # noqa: S307 - sympy's text, math names only


def _eval_tuple(s: str) -> str:
    """utils.py `eval_tuple`: "(2*3, 5+2)" -> "(6,7)"; any other text unchanged."""
    items = s[1:-1].split(",")
    if len(s) < 2 or len(items) < 2 or (s[0], s[-1]) not in (("(", ")"), ("[", "]")):
        return s
    values = [x if "infty" in x or x in ("a", "-a") else _rounded(x) for x in items]
    if any(v is None for v in values):  # as the official code: a tuple an item of fails keeps its text
        return s
    inner = ",".join(str(v) for v in values)
    return f"{s[0]}{inner}{s[-1]}"


def mathvision_equal(a: str, b: str) -> bool:
    """utils.py `is_equal`: equal lowercased texts, equal evaluated tuples, or latex2sympy values
    equal when rounded to 2 decimals (an answer that does not parse or evaluate is not equal)."""
    a, b = a.lower(), b.lower()
    if not a.replace(" ", "") or not b.replace(" ", ""):
        return False
    if a.strip() == b.strip():
        return True
    a, b = _eval_tuple(a), _eval_tuple(b)
    if a == b:
        return True

    value_a = _rounded(a)
    return value_a is not None and value_a == _rounded(b)


def mathvision_correct(pred: str | None, answer: str, choices: list[str] | None, meta: dict[str, Any]) -> bool:
    """Whether a reply (or its extracted answer) is right on MATH-V, as `evaluate.py` scores it:
    `mathvision_extract` of it equals the gold answer, or the text of the gold option."""
    if pred is None:
        return False
    model_answer = mathvision_extract(pred)
    value = ""
    if choices and len(answer) == 1 and 0 <= ord(answer) - 65 < len(choices):
        value = choices[ord(answer) - 65]
    return mathvision_equal(answer, model_answer) or mathvision_equal(value, model_answer)
