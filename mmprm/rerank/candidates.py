"""Best-of-N candidates: N solutions per problem, ready for PRM scoring and selection.

JSONL, one problem per line::

    {"id": "mathv-1546",
     "images": ["images/1546.jpg"],       # relative to the JSONL file, or absolute
     "question": "... What is the size of angle $V W Y$ ? <image1>\\nChoices: (A) ...",
     "answer": "D",                       # gold answer; null when unknown (no accuracy then)
     "choices": ["$25^{\\circ}$", ...],   # optional: option texts in letter order
     "meta": {"source": "mathv"},         # optional, free-form
     "candidates": [
        {"text": "full solution ...",     # "text" or "steps" (or both)
         "steps": ["step 1", "step 2"],   # what the PRM scores; derived from "text" when absent
         "answer": "40^\\circ",           # optional: extracted from the text when absent
         "correct": true,                 # optional: verified against the gold answer when absent
         "meta": {"model": "qwen-vl-max"}}]}

Steps come from our `<step>` tags when present (answer attached to the last step, as
`mmprm.steps.prm_steps` does), else from `mmprm.data.sft.split_solution` (blank lines, else lines,
else sentences). `steps: []` is allowed (a generation nothing could be parsed from): the PRM then
scores the whole text as one step (`ProblemWithCandidates.prm_inputs`); a candidate with no text either scores 0.

`load_problems_for_generation` reads the input of generation (`mmprm.data.problems`) as problems without candidates.

Converters turn public BoN data into this format: MATH-V (3 models' CoTs per problem),
GSM8K's example model solutions (4), Qwen2.5-Math's rm@8 example (8), and a generic
`{id, question, answer, solutions: [str]}` file. Where the source ships a correctness flag, the
candidate records both the flag and our verifier's verdict (`meta.flag_correct`,
`meta.verifier_correct`); `label` picks which one becomes `correct`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from mmprm.answers import answers_match, extract_answer
from mmprm.data.problems import check_problem_fields
from mmprm.data.problems import load_problems as load_problem_rows
from mmprm.data.registry import register_reader
from mmprm.data.schema import DataError, iter_jsonl, raise_if_bad, row_id, write_jsonl
from mmprm.data.sft import FINAL_ANSWER_LINE, split_solution
from mmprm.steps import STEP_TOKEN, parse_solution, prm_steps

Label = Literal["file", "verifier"]
GSM8K_MODELS = ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification")
_CANDIDATE_KEYS = {"text", "steps", "answer", "correct", "meta"}


@dataclass
class Candidate:
    """One solution of a problem. `extra` keeps unknown keys (e.g. `step_probs`) for round trips."""

    text: str | None
    steps: list[str]
    answer: str | None = None
    correct: bool | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        row: dict[str, Any] = {}
        if self.text is not None:
            row["text"] = self.text
        row.update(steps=list(self.steps), answer=self.answer, correct=self.correct)
        if self.meta:
            row["meta"] = self.meta
        row.update(self.extra)
        return row


@dataclass
class ProblemWithCandidates:
    """A problem with its gold answer and N candidate solutions. `images` are absolute paths."""

    id: str
    question: str
    answer: str | None
    candidates: list[Candidate]
    images: list[str] = field(default_factory=list)
    choices: list[str] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        row: dict[str, Any] = {
            "id": self.id,
            "images": list(self.images),
            "question": self.question,
            "answer": self.answer,
        }
        if self.choices is not None:
            row["choices"] = list(self.choices)
        if self.meta:
            row["meta"] = self.meta
        row["candidates"] = [c.to_json() for c in self.candidates]
        return row

    def prm_inputs(self) -> list[dict[str, Any]]:
        """One `{question, steps, images}` dict per candidate, as `PRMScorer.score` takes them.

        A candidate with no steps but some text (a generation nothing could be parsed from) is
        scored on its whole text as one step, so the PRM still judges it; one with neither gets
        `steps: []` and must not be sent to the scorer (the aggregators score it 0).
        """
        return [
            {
                "question": self.question,
                "images": self.images,
                "steps": c.steps or ([c.text.strip()] if c.text and c.text.strip() else []),
            }
            for c in self.candidates
        ]


def candidate_steps(text: str) -> list[str]:
    """The steps a PRM scores for a solution text (see the module docstring)."""
    parsed = parse_solution(text, mode="tags")
    if parsed.steps:
        return prm_steps(parsed.steps, parsed.answer)
    steps, answer = split_solution(text)
    # split_solution cuts a GSM8K-style final line ("#### 18", "A: 18"); give it back as <answer>.
    if answer is not None and FINAL_ANSWER_LINE.search(text):
        return prm_steps(steps, answer)
    return steps


def make_candidate(
    text: str,
    gold: str | None,
    choices: list[str] | None = None,
    flag: bool | None = None,
    label: Label = "file",
    **meta: Any,
) -> Candidate:
    """A candidate from a solution text: steps, extracted answer, and correctness.

    With a source `flag`, both the flag and our verifier's verdict go to `meta`; `label` says which
    is `correct`. Without one, `correct` is the verifier's (None when there is no gold answer).
    """
    answer = extract_answer(text)
    ours = answers_match(answer, gold, choices) if gold is not None else None
    if flag is not None:
        meta.update(flag_correct=flag, verifier_correct=ours)
    correct = flag if flag is not None and label == "file" else ours
    return Candidate(text=text, steps=candidate_steps(text), answer=answer, correct=correct, meta=meta)


def count_label_disagreements(problems: list[ProblemWithCandidates]) -> int:
    """Candidates whose source flag and our verifier disagree."""
    return sum(
        c.meta["flag_correct"] != c.meta["verifier_correct"]
        for p in problems
        for c in p.candidates
        if "flag_correct" in c.meta
    )


# ---------------------------------------------------------------- converters


@register_reader("candidates", "mathv")
def from_mathv(mathv_dir: str | Path, label: Label = "file", limit: int | None = None) -> list[ProblemWithCandidates]:
    """MATH-V testmini with the CoTs of its 3 models (`cot_testmini/*.jsonl`) as N=3 candidates.

    Args:
        mathv_dir: the folder holding testmini.jsonl, images/ and cot_testmini/.
        label: "file" (MATH-V's `correct`) or "verifier" (ours) becomes `correct`.
        limit: keep the first `limit` problems (verifying all 912 candidates takes seconds).
    """
    from mmprm.data.mathv import read_mathv

    root = Path(mathv_dir)
    cot_files = sorted((root / "cot_testmini").glob("*.jsonl"))
    if not cot_files:
        raise FileNotFoundError(f"{root / 'cot_testmini'}: no *.jsonl CoT files (copy MATH-V's outputs there)")
    cots: dict[str, list[tuple[str, dict]]] = {}
    for path in cot_files:
        for lineno, obj, err in iter_jsonl(path):
            if err:
                raise DataError([f"{path}:{lineno}: id=?: line: {err}"])
            cots.setdefault(str(obj["id"]), []).append((path.stem, obj))
    problems = []
    for p in read_mathv(root)[:limit]:
        records = cots.get(p["id"], [])
        if len(records) != len(cot_files):
            raise DataError(
                [
                    f"{root}: id={p['id']}: candidates: {len(records)} CoT records for "
                    f"{len(cot_files)} model files (each file needs one record per problem)"
                ]
            )
        candidates = [
            make_candidate(
                r["response"],
                p["answer"],
                p["choices"],
                flag=bool(r["correct"]),
                label=label,
                model=r.get("model", stem),
                source_answer=r.get("model_answer"),
            )
            for stem, r in records
        ]
        problems.append(
            ProblemWithCandidates(
                id=f"mathv-{p['id']}",
                question=p["question"],
                answer=p["answer"],
                candidates=candidates,
                images=p["images"],
                choices=p["choices"],
                meta=p["meta"],
            )
        )
    return problems


@register_reader("candidates", "gsm8k")
def from_gsm8k_solutions(path: str | Path, label: Label = "file") -> list[ProblemWithCandidates]:
    """GSM8K's `example_model_solutions.jsonl`: 4 GPT-3 solutions per problem (N=4).

    Gold is the `A: N` of `ground_truth`; flags are each solution's `is_correct`.
    """
    path = Path(path)
    problems = []
    for lineno, obj, err in iter_jsonl(path):
        if err:
            raise DataError([f"{path}:{lineno}: id=?: line: {err}"])
        gold = extract_answer(obj.get("ground_truth", ""))
        missing = [m for m in GSM8K_MODELS if not isinstance(obj.get(m), dict)]
        if gold is None or missing:
            raise DataError(
                [
                    f"{path}:{lineno}: id=gsm8k-{lineno - 1}: ground_truth/{','.join(missing) or 'A:'}: "
                    "not GSM8K example_model_solutions format (need ground_truth ending in "
                    f"'A: N' and the fields {', '.join(GSM8K_MODELS)})"
                ]
            )
        where = f"{path}:{lineno}: id=gsm8k-{lineno - 1}"
        bad = [f"{where}: question: missing (the problem text)"] if not isinstance(obj.get("question"), str) else []
        for m in GSM8K_MODELS:
            if not isinstance(obj[m].get("solution"), str):
                bad.append(f"{where}: {m}.solution: missing (the model's solution text)")
            if not isinstance(obj[m].get("is_correct"), bool):
                bad.append(f"{where}: {m}.is_correct: {obj[m].get('is_correct')!r} is not true or false")
        if bad:
            raise DataError(bad)
        candidates = [
            make_candidate(obj[m]["solution"], gold, flag=obj[m]["is_correct"], label=label, model=m)
            for m in GSM8K_MODELS
        ]
        problems.append(
            ProblemWithCandidates(
                id=f"gsm8k-{lineno - 1}",
                question=obj["question"],
                answer=gold,
                candidates=candidates,
                meta={"source": "gsm8k"},
            )
        )
    return problems


@register_reader("candidates", "qwen_math")
def from_qwen_math_bon(path: str | Path, label: Label = "file") -> list[ProblemWithCandidates]:
    """Qwen2.5-Math's `math_cot_100.jsonl`: 8 responses per MATH problem (N=8).

    Gold is `gt`; flags are `score`; the upstream reward-model score goes to `meta.rm_score`.
    """
    path = Path(path)
    problems = []
    for lineno, obj, err in iter_jsonl(path):
        if err:
            raise DataError([f"{path}:{lineno}: id=?: line: {err}"])
        responses, scores = obj.get("response"), obj.get("score")
        if not isinstance(responses, list) or not isinstance(scores, list) or len(responses) != len(scores):
            raise DataError(
                [
                    f"{path}:{lineno}: id={row_id(obj, 'idx')}: response/score: need two lists of equal "
                    "length (is this Qwen2.5-Math's eval_rm_maj_example format?)"
                ]
            )
        where = f"{path}:{lineno}: id={row_id(obj, 'idx')}"
        bad = [f"{where}: {f}: missing" for f in ("idx", "question", "gt") if obj.get(f) is None]
        bad += [
            f"{where}: score[{k}]: {flag!r} is not true or false"
            for k, flag in enumerate(scores)
            if not isinstance(flag, bool) and not (type(flag) is int and flag in (0, 1))
        ]
        bad += [f"{where}: response[{k}]: not text" for k, text in enumerate(responses) if not isinstance(text, str)]
        if bad:
            raise DataError(bad)
        rm = obj.get("pred_score") or [None] * len(responses)
        candidates = [
            make_candidate(
                text,
                str(obj["gt"]),
                flag=bool(flag),
                label=label,
                source_answer=(obj.get("pred") or [None] * len(responses))[k],
                rm_score=rm[k][0] if isinstance(rm[k], list) else rm[k],
            )
            for k, (text, flag) in enumerate(zip(responses, scores))
        ]
        problems.append(
            ProblemWithCandidates(
                id=f"qwen-math-{obj['idx']}",
                question=obj["question"],
                answer=str(obj["gt"]),
                candidates=candidates,
                meta={"source": "qwen_math_bon", "level": obj.get("level")},
            )
        )
    return problems


@register_reader("candidates", "text")
def from_text_solutions(path: str | Path) -> list[ProblemWithCandidates]:
    """A generic JSONL of `{id, question, answer, solutions: [str], images?, choices?}`.

    Correctness is our verifier's; steps are split from each solution text.
    """
    path = Path(path)
    problems, bad = [], []
    for lineno, obj, err in iter_jsonl(path):
        if err:
            bad.append(f"{path}:{lineno}: id=?: line: {err}")
            continue
        rid = row_id(obj)
        sols = obj.get("solutions")
        if not isinstance(sols, list) or not sols or not all(isinstance(s, str) for s in sols):
            bad.append(f"{path}:{lineno}: id={rid}: solutions: must be a non-empty list of solution strings")
            continue
        gold = obj.get("answer")
        choices = obj.get("choices")
        row = {k: obj[k] for k in ("id", "question", "images", "answer", "choices", "meta") if k in obj}
        row["candidates"] = [
            make_candidate(s, str(gold) if gold is not None else None, choices).to_json() for s in sols
        ]
        errs, problem = _check_problem(row, path.parent, check_images=True)
        bad += [f"{path}:{lineno}: id={rid}: {fld}: {msg}" for fld, msg in errs]
        if problem is not None:
            problems.append(problem)
    if bad:
        raise DataError(bad)
    return problems


# ---------------------------------------------------------------- load / write


def _check_candidate(c: Any, where: str) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    errs: list[tuple[str, str]] = []
    if not isinstance(c, dict):
        return [(where, 'must be an object like {"text": ...} or {"steps": [...]}')], {}
    text, steps = c.get("text"), c.get("steps")
    if text is None and steps is None:
        errs.append((where, "has neither 'text' nor 'steps' (give the solution text, its steps, or both)"))
    if text is not None and not isinstance(text, str):
        errs.append((f"{where}.text", "must be a string"))
    if steps is not None:
        if not isinstance(steps, list) or not all(isinstance(s, str) and s.strip() for s in steps):
            errs.append((f"{where}.steps", "must be a list of non-empty strings"))
        elif any(STEP_TOKEN in s for s in steps):
            errs.append((f"{where}.steps", f"contains the reserved step token {STEP_TOKEN!r} (remove it)"))
    ans = c.get("answer")
    if ans is not None and not isinstance(ans, (str, int, float)):
        errs.append((f"{where}.answer", "must be a string or null"))
    if c.get("correct") is not None and not isinstance(c.get("correct"), bool):
        errs.append((f"{where}.correct", f"{c.get('correct')!r} is not true/false/null"))
    if not isinstance(c.get("meta", {}) or {}, dict):
        errs.append((f"{where}.meta", "must be a JSON object"))
    return errs, c


def _check_problem(
    obj: dict[str, Any], base_dir: Path, check_images: bool
) -> tuple[list[tuple[str, str]], ProblemWithCandidates | None]:
    """Validate one problem row; returns ([(field, message)], ProblemWithCandidates-or-None) with answers filled in."""
    errs, resolved = check_problem_fields(obj, base_dir, check_images, need_answer=False)
    rid, question, gold, choices = obj.get("id"), obj.get("question"), obj.get("answer"), obj.get("choices")
    cands = obj.get("candidates")
    if not isinstance(cands, list) or not cands:
        errs.append(("candidates", 'missing or empty (a list of {"text"|"steps", ...} objects)'))
        cands = []
    for j, c in enumerate(cands):
        errs += _check_candidate(c, f"candidates[{j}]")[0]
    if errs:
        return errs, None
    gold_s = str(gold) if gold is not None else None
    candidates = []
    for c in cands:
        text = c.get("text")
        steps = c["steps"] if c.get("steps") is not None else candidate_steps(text)
        answer = c.get("answer")
        if answer is None and "answer" not in c:  # an explicit null means "no answer found"
            answer = extract_answer(text if text is not None else "\n".join(steps))
        correct = c.get("correct")
        if correct is None and gold_s is not None:
            correct = answers_match(str(answer) if answer is not None else None, gold_s, choices)
        candidates.append(
            Candidate(
                text=text,
                steps=list(steps),
                answer=str(answer) if answer is not None else None,
                correct=correct,
                meta=c.get("meta") or {},
                extra={k: v for k, v in c.items() if k not in _CANDIDATE_KEYS},
            )
        )
    return [], ProblemWithCandidates(
        id=str(rid),
        question=question,
        answer=gold_s,
        candidates=candidates,
        images=resolved,
        choices=choices,
        meta=obj.get("meta") or {},
    )


def _scan(
    path: Path, check_images: bool, start: int = 0, stop: int | None = None
) -> Iterator[tuple[list[str], ProblemWithCandidates | None]]:
    """(errors, problem) for rows start..stop-1 (0-based, blank lines not counted), streamed."""
    if not path.exists():
        raise DataError([f"{path}: file not found (write it with `mmprm convert-candidates`)"])
    seen: dict[str, int] = {}
    row = -1
    for lineno, obj, err in iter_jsonl(path):
        row += 1
        if row < start:
            continue
        if stop is not None and row >= stop:
            break
        if err:
            yield [f"{path}:{lineno}: id=?: line: {err}"], None
            continue
        rid = row_id(obj)
        errs, problem = _check_problem(obj, path.parent, check_images)
        bad = [f"{path}:{lineno}: id={rid}: {fld}: {msg}" for fld, msg in errs]
        if problem is not None:
            if problem.id in seen:
                bad.append(
                    f"{path}:{lineno}: id={rid}: id: duplicated (first on line {seen[problem.id]}; make ids unique)"
                )
                problem = None
            else:
                seen[problem.id] = lineno
        yield bad, problem


@register_reader("candidates", "mmprm")
def load_candidates(path: str | Path, check_images: bool = True) -> list[ProblemWithCandidates]:
    """Load and validate a candidates JSONL; raise DataError listing every problem found.

    Missing steps, answers and correctness are filled in (see the module docstring).
    """
    path = Path(path)
    problems, bad = [], []
    for errs, problem in _scan(path, check_images):
        bad += errs
        if problem is not None:
            problems.append(problem)
    raise_if_bad(path, bad, len(problems))
    return problems


def count_rows(path: str | Path) -> int:
    """Non-blank lines of a JSONL file, without parsing them (the size a shard is cut from)."""
    if not Path(path).is_file():
        raise DataError([f"{path}: file not found (a JSONL file is expected)"])
    with open(path, "rb") as f:
        return sum(1 for raw in f if raw.strip())


def check_candidates(
    path: str | Path, start: int = 0, stop: int | None = None, need_correct: bool = False, check_images: bool = True
) -> tuple[int, int]:
    """Validate rows start..stop-1 of a candidates JSONL without keeping them: (problems, candidates).

    Raises DataError listing every problem found, as `load_candidates` does; with `need_correct`,
    also every candidate whose correctness is unknown (no gold `answer` and no `correct`).
    """
    path = Path(path)
    bad: list[str] = []
    problems = candidates = 0
    for errs, problem in _scan(path, check_images, start, stop):
        bad += errs
        if problem is None:
            continue
        problems += 1
        candidates += len(problem.candidates)
        if need_correct:
            bad += [
                f"{path}: id={problem.id}: candidates[{j}].correct: unknown (give the problem's gold `answer` "
                "or each candidate's `correct`)"
                for j, c in enumerate(problem.candidates)
                if c.correct is None
            ]
    raise_if_bad(path, bad, problems)
    return problems, candidates


def iter_candidates(
    path: str | Path, start: int = 0, stop: int | None = None, check_images: bool = False
) -> Iterator[ProblemWithCandidates]:
    """The problems of rows start..stop-1, one at a time (validate them first with `check_candidates`)."""
    path = Path(path)
    for errs, problem in _scan(path, check_images, start, stop):
        if errs:
            raise DataError(errs)
        if problem is not None:
            yield problem


def load_problems_for_generation(
    path: str | Path,
    check_images: bool = True,
    check_rows: Callable[[int], bool] | None = None,
    keep_rows: Callable[[int], bool] | None = None,
) -> list[ProblemWithCandidates]:
    """The problems of `mmprm.data.problems.load_problems` with no candidates yet (the input of generation);
    `check_rows` limits the image checks, and `keep_rows` the problems returned, to a worker's own rows."""
    return [
        ProblemWithCandidates(
            id=p.id,
            question=p.question,
            answer=p.answer,
            candidates=[],
            images=p.images,
            choices=p.choices,
            meta=p.meta,
        )
        for p in load_problem_rows(path, check_images, check_rows, keep_rows)
    ]


def write_candidates(path: str | Path, problems: list[ProblemWithCandidates]) -> int:
    """Write problems as candidates JSONL (atomically); image paths stay absolute."""
    return write_jsonl(path, (p.to_json() for p in problems))


def cli_convert_candidates(argv: list[str]) -> int:
    """`mmprm convert-candidates --from mathv|gsm8k|qwen_math|text --input P --out F [--label L] [--limit N]`."""
    ap = argparse.ArgumentParser(
        prog="mmprm convert-candidates", description="Convert public Best-of-N data to mmprm candidates JSONL."
    )
    ap.add_argument("--from", dest="source", choices=("mathv", "gsm8k", "qwen_math", "text"), required=True)
    ap.add_argument(
        "--input",
        required=True,
        help="mathv: the MATH-V folder; gsm8k: example_model_solutions.jsonl; "
        "qwen_math: math_cot_100.jsonl; text: JSONL of {id, question, answer, solutions}",
    )
    ap.add_argument("--out", required=True, help="output candidates JSONL")
    ap.add_argument(
        "--label",
        choices=("file", "verifier"),
        default="file",
        help="which verdict becomes `correct` where the source ships a flag (default: file)",
    )
    ap.add_argument("--limit", type=int, default=None, help="keep the first N problems (small demo files)")
    args = ap.parse_args(argv)
    try:
        if args.source == "text":
            problems = from_text_solutions(args.input)
        else:
            convert = {"mathv": from_mathv, "gsm8k": from_gsm8k_solutions, "qwen_math": from_qwen_math_bon}[args.source]
            problems = (
                from_mathv(args.input, args.label, args.limit)
                if args.source == "mathv"
                else convert(args.input, label=args.label)
            )
    except (DataError, FileNotFoundError) as e:
        print(f"error: {e}")
        return 2
    problems = problems[: args.limit] if args.limit is not None else problems
    write_candidates(args.out, problems)
    n = sum(len(p.candidates) for p in problems)
    correct = sum(bool(c.correct) for p in problems for c in p.candidates)
    print(
        json.dumps(
            {
                "out": str(args.out),
                "problems": len(problems),
                "candidates": n,
                "correct": correct,
                "label": args.label,
                "label_disagreements": count_label_disagreements(problems),
            }
        )
    )
    return 0
