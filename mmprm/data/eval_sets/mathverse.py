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
from mmprm.data.registry import register_reader

BREAKDOWN = ("problem_version", "subject", "subfield", "question_type")
_CHOICE_LINE = re.compile(r"^\s*\(?([A-H])\)?\s*[:.：]\s*(.*?)\s*$")
# An inline option opens with its letter after a space or punctuation: "...equation.A. x B. y".
_INLINE = re.compile(r"(?:^|(?<=[\s.?:;,]))(?:\(([A-H])\)|([A-H])\s*[.:：])\s*")


def _inline_options(text: str) -> list[str] | None:
    """Options written in a run ("A. x B. y", "(A) x (B) y"): the last run of A, B, ... in order."""
    opens = [(m.group(1) or m.group(2), m) for m in _INLINE.finditer(text)]
    for i in reversed([i for i, (letter, _) in enumerate(opens) if letter == "A"]):
        chain = [opens[i][1]]
        for letter, m in opens[i + 1 :]:
            if letter == chr(65 + len(chain)):
                chain.append(m)
        if len(chain) >= 2:
            ends = [m.start() for m in chain[1:]] + [len(text)]
            return [text[m.end() : end].strip() for m, end in zip(chain, ends)]
    return None


def mathverse_choices(question: str) -> list[str] | None:
    """The option texts of a question, or None (e.g. options drawn in the image).

    Options are lines after "Choices:" (or "Choice:"), as "A:50°" or "A. 50°", else written inline
    ("...determine its equation.A. x^2 = 1 B. Can not determine."), as MathVerse's questions have
    them. An empty option line ("B:") keeps its place.
    """
    head, sep, tail = question.partition("Choices:")
    if not sep:
        head, sep, tail = question.partition("Choice:")
    if sep:
        found = []
        for line in tail.splitlines():
            m = _CHOICE_LINE.match(line)
            if m and m.group(1) == chr(65 + len(found)):
                found.append(m.group(2))
        if len(found) >= 2:
            return found
    return _inline_options(tail if sep else question)


@register_reader("answer_benchmark", "mathverse")
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


# A gold answer "domain: [-4, 0) and range: (-3, 1]" has two labelled parts; labels are the words
# (not LaTeX commands, not single-letter variables) before each value.
_WRAPPED = re.compile(r"\\(?:text|textbf|textit|mathrm|mbox)\s*\{([^{}]*)\}")
_LABEL_RUN = re.compile(r"(?:(?<![\\A-Za-z])[A-Za-z]{2,}(?![A-Za-z])[\s:,;.]*)+")
_UNIT_END = re.compile(r"(?<=[\d}])\s+[a-zA-Z]{1,2}\s*(?:\^\s*\{?\d\}?)?$")
_EXPONENT = re.compile(r"\^\s*(?:\{[^{}]*\}|\d)")
_NOT_LABEL = {"and", "the", "is", "are", "on", "at", "of", "function", "answer", "extracted", "final"}


def labelled_parts(answer: str) -> list[tuple[str, str]]:
    """`(label, value)` per value of an answer: "domain: [-4, 0) and range: (-3, 1]" gives
    `[("domain", "[-4, 0)"), ("range", "(-3, 1]")]`, "2191.7 metres" gives `[("", "2191.7")]`.

    A value holds a digit (not only in an exponent), `\\infty` or a bracket; words after the last
    value (units) and filler words ("and", "the", "is", "on", ...) label nothing.
    """
    text = re.sub(r"\$|\\[()\[\]]", " ", answer)
    for _ in range(2):  # nested wrappers
        text = _WRAPPED.sub(r" \1 ", text)
    runs = list(_LABEL_RUN.finditer(text))
    bounds = [(0, 0)] + [(m.start(), m.end()) for m in runs] + [(len(text), len(text))]
    parts = []
    for (label_start, label_end), (next_start, _) in zip(bounds, bounds[1:]):
        words = re.findall(r"[A-Za-z]+", text[label_start:label_end].lower())
        label = " ".join(w for w in words if w not in _NOT_LABEL)
        for line in text[label_end:next_start].replace("~", " ").splitlines():  # one value a line
            value = _UNIT_END.sub("", line.strip(" \t:=,;."))  # "3426.49 m ^{2}": a short unit after it
            if re.search(r"\d|\\infty|[(\[]", _EXPONENT.sub("", value)):
                parts.append((label, value))
    return parts


def _letters(ans: str) -> list[str] | None:
    """The option letters an answer names, one or several ("C\nD", "A, C"), or None."""
    s = ans.strip()
    if re.fullmatch(r"\(?[A-H]\)?(?:\s*(?:[\n,;]|and)\s*\(?[A-H]\)?)+", s):
        return sorted(set(re.findall(r"[A-H]", s)))
    named = re.match(r"\(?([A-H])\)?\s*[:.]", s)  # "B:2√3" names option B, as MathVerse lists them
    letter = named.group(1) if named else choice_letter(s)
    return [letter] if letter is not None else None


def mathverse_correct(pred: str | None, answer: str, choices: list[str] | None, meta: dict[str, Any]) -> bool:
    """Whether an extracted answer scores as correct on MathVerse.

    MathVerse's quick match is string equality; otherwise a GPT judge decides, told that an answer
    is right only when it completely matches the standard answer (a free-form one may say it in
    other words). Re-expressed: equal text; multi-choice, the letters named (or an option's text)
    against the gold letters or option text; free-form, `mmprm.answers.answers_match`, and a gold
    answer of several labelled parts (`labelled_parts`) needs every part, each with its label and
    value. No offline rule equals the judge: this one refuses a partial answer the judge refuses,
    and may refuse a rewording the judge would accept.
    """
    if pred is None or not pred.strip():
        return False
    if pred.strip() == answer.strip():
        return True
    if meta.get("question_type") == "multi-choice":
        gold, named = _letters(answer), _letters(pred)
        if gold is None:  # the gold answer is an option's text ("False")
            if named is not None and len(named) == 1 and choices and ord(named[0]) - 65 < len(choices):
                return answers_match(choices[ord(named[0]) - 65], answer)
            return answers_match(pred, answer)
        if named is not None:
            return named == gold
        idx = ord(gold[0]) - 65
        return len(gold) == 1 and bool(choices) and idx < len(choices or []) and answers_match(pred, choices[idx])
    gold_parts, pred_parts = labelled_parts(answer), labelled_parts(pred)
    if not gold_parts:  # a word or an expression without numbers: "even", "\\pi"
        return answers_match(pred, answer)
    if len(gold_parts) == len(pred_parts) == 1:  # values compared, labels kept apart from math-verify
        (gold_label, gold_value), (pred_label, pred_value) = gold_parts[0], pred_parts[0]
        return (not gold_label or not pred_label or gold_label == pred_label) and answers_match(pred_value, gold_value)
    if len(gold_parts) != len(pred_parts):
        return False
    left = list(pred_parts)
    for label, value in gold_parts:
        hit = next((p for p in left if p[0] == label and answers_match(p[1], value)), None)
        if hit is None:
            return False
        left.remove(hit)
    return True
