"""Policy SFT data: worked solutions split into steps, in the policy's step format.

One JSON object per line (the step-example schema of `mmprm.data.schema`, without labels)::

    {"id": "gsm8k-0",
     "images": [],                          # relative to the JSONL file, or absolute
     "question": "Janet's ducks lay 16 eggs per day. ...",
     "steps": ["Janet sells 16 - 3 - 4 = 9 duck eggs a day.", "She makes 9 * 2 = $18 every day."],
     "answer": "18",                        # required: the SFT target ends in <answer>18</answer>
     "meta": {"source": "gsm8k"}}

The SFT target of a row is `mmprm.steps.render_solution(steps, answer)`.

`split_solution` is the rule-based splitter: our `<step>` tags when present; otherwise, after
removing GSM8K `<<calc>>` annotations, markdown image links and `[asy]` figure code, and pulling
the final answer from `#### N` / `A: N`, blank-line paragraphs, else lines, else sentences.
A display-math block always stays with the text that introduces it. `rewrite_with_llm` is an
optional second pass over an OpenAI-compatible chat endpoint (`mmprm.chat.ChatClient`).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from mmprm.answers import extract_answer
from mmprm.chat import ChatClient, ChatConfig, ChatRequestError, messages_for
from mmprm.data.registry import lookup, register_reader
from mmprm.data.schema import DataError, StepExample, check_row, iter_jsonl, raise_if_bad, row_id, write_jsonl
from mmprm.steps import STEP_CLOSE, STEP_OPEN, parse_solution, render_solution

_CALC = re.compile(r"<<[^<>]*>>")
# A calculator annotation cut off by the generation ("<<3/440=0.00681818..."): keep the result.
_CALC_OPEN = re.compile(r"<<[^\n=]*=?")
_MD_IMAGE = re.compile(r"!\[[^\]]*\]\([^)]*\)")
_ASY = re.compile(r"\[asy\].*?(?:\[/asy\]|$)", re.S)
# GSM8K's final line: "#### 18" in the data set, "A: 18" in its example model solutions.
FINAL_ANSWER_LINE = re.compile(r"^\s*(?:####|A:)\s*(.+?)\s*$", re.M)
_BLANK = re.compile(r"\n\s*\n")
# Math spans protected from sentence splitting: $$..$$, $..$, \[..\], \(..\), \begin{x}..\end{x}.
_MATH = re.compile(r"\$\$.*?\$\$|\$[^$]*\$|\\\[.*?\\\]|\\\(.*?\\\)|\\begin\{([a-z*]+)\}.*?\\end\{\1\}", re.S)
_DISPLAY_START = re.compile(r"^\s*(?:\\\[|\$\$|\\begin\{)")


def clean_solution(text: str) -> str:
    """Remove GSM8K `<<calc>>` annotations, markdown image links and `[asy]` figure code."""
    text = _CALC_OPEN.sub("", _CALC.sub("", text))
    text = _MD_IMAGE.sub("", text)
    return _ASY.sub("", text).strip()


def _open_display(chunk: str) -> bool:
    """Whether a chunk leaves a display-math block open (`\\[` without `\\]`, odd `$$`, ...)."""
    return (
        chunk.count("\\[") > chunk.count("\\]")
        or chunk.count("$$") % 2 == 1
        or len(re.findall(r"\\begin\{", chunk)) > len(re.findall(r"\\end\{", chunk))
    )


def _merge_math(chunks: list[str]) -> list[str]:
    """Attach display-math chunks to the text before them, and rejoin chunks split inside one."""
    out: list[str] = []
    for c in chunks:
        if out and (_DISPLAY_START.match(c) or _open_display(out[-1])):
            out[-1] = f"{out[-1]}\n{c}"
        else:
            out.append(c)
    return out


def split_sentences(text: str) -> list[str]:
    """Sentences of one paragraph; never splits inside math (`$x=3.$ Then` splits after the `$`)."""
    spans: list[str] = []

    def _hide(m: re.Match) -> str:
        spans.append(m.group(0))
        # \x01 marks math that ends in a period ("$x=3.$"): that also ends the sentence.
        return f"\x00{len(spans) - 1}\x00" + ("\x01" if re.search(r"\.\s*(?:\$|\\\]|\\\))*$", m.group(0)) else "")

    hidden = _MATH.sub(_hide, text)
    parts = re.split(r"(?<=[.!?\x01])\s+(?=[A-Z\x00(\[])", hidden)

    def _show(part: str) -> str:
        part = re.sub(r"\x00(\d+)\x00", lambda m: spans[int(m.group(1))], part)
        return part.replace("\x01", "").strip()

    return _merge_math([s for s in (_show(p) for p in parts) if s])


def split_solution(text: str, by_lines: bool = False) -> tuple[list[str], str | None]:
    """Steps and final answer of a worked solution (see the module docstring for the rules).

    Args:
        text: the solution.
        by_lines: every non-empty line is a step, blank lines or `$$` or not (GSM8K's own format).

    >>> split_solution("3 + 4 = <<3+4=7>>7 apples.\\nHe eats 2, so 7 - 2 = <<7-2=5>>5.\\n#### 5")
    (['3 + 4 = 7 apples.', 'He eats 2, so 7 - 2 = 5.'], '5')
    """
    parsed = parse_solution(text, mode="tags")
    if parsed.steps:
        return [clean_solution(s) for s in parsed.steps], parsed.answer
    finals = FINAL_ANSWER_LINE.findall(text)
    answer = finals[-1].strip() if finals else None
    body = clean_solution(FINAL_ANSWER_LINE.sub("", text))
    if answer is None:
        answer = extract_answer(body)
    paragraphs = [p.strip() for p in _BLANK.split(body) if p.strip()]
    if len(paragraphs) > 1 and not by_lines:
        return _merge_math(paragraphs), answer
    lines = [ln.strip() for ln in body.splitlines() if ln.strip()]
    if len(lines) > 1:
        # GSM8K has no LaTeX but does write "$$43.00" for money: no display-math merging there.
        return (lines if by_lines else _merge_math(lines)), answer
    return split_sentences(body), answer


@register_reader("sft", "gsm8k")
def sft_from_gsm8k(path: str | Path) -> list[StepExample]:
    """GSM8K rows (`test.jsonl`/`train.jsonl`: question + answer with `#### N`; or the example
    solutions file's `ground_truth` with `A: N`) as SFT examples with ids `gsm8k-<line index>`."""
    path = Path(path)
    out = []
    for lineno, obj, err in iter_jsonl(path):
        if err:
            raise DataError([f"{path}:{lineno}: id=?: line: {err}"])
        worked = obj.get("answer", obj.get("ground_truth"))
        if not isinstance(worked, str) or not isinstance(obj.get("question"), str):
            raise DataError(
                [
                    f"{path}:{lineno}: id=?: answer: need 'question' and a worked 'answer' "
                    "(or 'ground_truth') string: is this a GSM8K file?"
                ]
            )
        steps, answer = split_solution(worked, by_lines=True)
        if not steps or answer is None:
            raise DataError(
                [
                    f"{path}:{lineno}: id=gsm8k-{lineno - 1}: answer: no steps or no final "
                    "'#### N' line (fix or drop the row)"
                ]
            )
        out.append(
            StepExample(
                id=f"gsm8k-{lineno - 1}",
                question=obj["question"],
                steps=steps,
                answer=answer.replace(",", ""),
                meta={"source": "gsm8k"},
            )
        )
    return out


@register_reader("sft", "mathv")
def sft_from_mathv(mathv_dir: str | Path) -> list[StepExample]:
    """The MATH-V problems that ship a worked `solution` (25 in testmini) as SFT examples.

    The answer is MATH-V's gold answer (an option letter for multiple choice), since most
    solutions do not restate it in a parseable form.
    """
    from mmprm.data.mathv import read_mathv

    out = []
    for p in read_mathv(mathv_dir):
        if not p["solution"]:
            continue
        steps, _ = split_solution(p["solution"])
        if not steps:
            continue
        out.append(
            StepExample(
                id=f"mathv-{p['id']}",
                question=p["question"],
                steps=steps,
                images=p["images"],
                answer=p["answer"],
                meta=p["meta"],
            )
        )
    return out


def sft_row_problems(obj: dict[str, Any]) -> list[tuple[str, str]]:
    """What an SFT row needs beyond the step-example schema: an answer, and plain step texts."""
    errs = []
    answer = obj.get("answer")
    if not isinstance(answer, (str, int, float)) or isinstance(answer, bool) or not str(answer).strip():
        errs.append(("answer", "missing or empty (SFT targets end in <answer>...</answer>; add the final answer)"))
    for s in obj.get("steps") or []:
        if isinstance(s, str) and (STEP_OPEN in s or STEP_CLOSE in s):
            errs.append(("steps", f"a step contains {STEP_OPEN!r}/{STEP_CLOSE!r} (give plain step texts)"))
            break
    return errs


@register_reader("sft", "steps")
def load_sft(path: str | Path, check_images: bool = True) -> list[StepExample]:
    """Load and validate an SFT JSONL file; raise DataError listing every problem.

    Rows follow the step-example schema; `answer` is required, `labels` are ignored.
    """
    path = Path(path)
    if not path.exists():
        raise DataError([f"{path}: file not found (check the SFT data path in your config)"])
    problems: list[str] = []
    examples: list[StepExample] = []
    seen: dict[str, int] = {}
    cache: dict[Path, str | None] = {}
    for lineno, obj, err in iter_jsonl(path):
        if err:
            problems.append(f"{path}:{lineno}: id=?: line: {err}")
            continue
        rid = row_id(obj)
        errs, ex = check_row(obj, path.parent, check_images=check_images, image_cache=cache)
        errs += sft_row_problems(obj)
        problems += [f"{path}:{lineno}: id={rid}: {fld}: {msg}" for fld, msg in errs]
        if ex is not None and not errs:
            if ex.id in seen:
                problems.append(
                    f"{path}:{lineno}: id={rid}: id: duplicated (first on line {seen[ex.id]}; make ids unique)"
                )
                continue
            seen[ex.id] = lineno
            ex.labels = None
            examples.append(ex)
    raise_if_bad(path, problems, len(examples))
    return examples


def sft_target(example: StepExample) -> str:
    """The assistant text an SFT'd policy learns to write for this example."""
    return render_solution(example.steps, example.answer)


# ---------------------------------------------------------------- optional LLM rewriter

REWRITE_SYSTEM = (
    "Rewrite the worked solution into short, self-contained reasoning steps. Output only "
    f"{STEP_OPEN}...{STEP_CLOSE} blocks, one per step, then <answer>FINAL</answer>. Keep every "
    "number and fact of the original; do not add new reasoning; keep LaTeX as LaTeX."
)


def rewrite_messages(question: str, solution: str) -> list[dict[str, Any]]:
    """Chat messages that ask a model to rewrite one solution into our step format."""
    return messages_for(f"Problem:\n{question}\n\nWorked solution:\n{solution}", system=REWRITE_SYSTEM)


def parse_rewrite_reply(text: str) -> tuple[list[str], str | None]:
    """Steps and answer of the model's rewrite; ValueError when it holds no step blocks."""
    parsed = parse_solution(text or "", mode="tags")
    if not parsed.steps:
        raise ValueError(f"the model's reply has no {STEP_OPEN} blocks: {str(text)[:200]!r}")
    return parsed.steps, parsed.answer


def rewrite_with_llm(example: StepExample, client: ChatClient) -> StepExample:
    """The example with its steps rewritten by the chat model behind `client` (`mmprm.chat`).

    The rewritten answer replaces the old one only when the old one is missing; a reply without
    step blocks or whose answer disagrees with the original raises ValueError (the model changed
    the solution). Endpoint failures raise `mmprm.chat.ChatError` subclasses.
    """
    solution = "\n".join(example.steps) + (f"\nFinal answer: {example.answer}" if example.answer else "")
    reply = client.chat(rewrite_messages(example.question, solution))
    try:
        steps, answer = parse_rewrite_reply(reply.text)
    except ValueError as e:
        raise ValueError(f"id={example.id}: {e}") from None
    if example.answer is not None and answer is not None:
        from mmprm.answers import answers_match

        if not answers_match(answer, example.answer):
            raise ValueError(f"id={example.id}: rewrite changed the answer {example.answer!r} -> {answer!r}")
    return StepExample(
        id=example.id,
        question=example.question,
        steps=steps,
        images=list(example.images),
        answer=example.answer or answer,
        meta={**example.meta, "rewritten_by": client.config.model},
    )


# ---------------------------------------------------------------- CLI


def cli_convert_sft(argv: list[str]) -> int:
    """`mmprm convert-sft --from gsm8k|mathv --input P --out F [--rewrite-url U --rewrite-model M]`."""
    ap = argparse.ArgumentParser(prog="mmprm convert-sft", description="Convert worked solutions to SFT JSONL.")
    ap.add_argument("--from", dest="source", choices=("gsm8k", "mathv"), required=True)
    ap.add_argument("--input", required=True, help="GSM8K jsonl file, or the MATH-V folder")
    ap.add_argument("--out", required=True, help="output JSONL")
    ap.add_argument("--rewrite-url", help="OpenAI-compatible base URL (e.g. http://localhost:8000/v1)")
    ap.add_argument("--rewrite-model", help="model name served at --rewrite-url")
    ap.add_argument("--api-key-env", default="OPENAI_API_KEY")
    ap.add_argument("--concurrency", type=int, default=8, help="rewrite requests in flight")
    args = ap.parse_args(argv)
    if bool(args.rewrite_url) != bool(args.rewrite_model):
        ap.error("--rewrite-url and --rewrite-model go together")
    examples = lookup("sft", args.source)(args.input)
    if args.rewrite_url:
        # Replies are cached next to the output, so rerunning after a crash pays only for the rest.
        client = ChatClient(
            ChatConfig(
                url=args.rewrite_url,
                model=args.rewrite_model,
                api_key_env=args.api_key_env,
                timeout_s=120.0,
                concurrency=args.concurrency,
            ),
            config_key="--rewrite",
            cache_path=f"{args.out}.rewrite_cache.jsonl",
        )

        def rewrite(e: StepExample) -> tuple[StepExample, str | None]:
            try:
                return rewrite_with_llm(e, client), None
            except (ValueError, ChatRequestError) as err:  # one bad reply must not end a long job
                return e, str(err)

        results = client.map(rewrite, examples, desc="rewrite")
        for e, err in results:
            if err:
                print(f"id={e.id}: kept the rule-based steps: {err}")
        failed = sum(err is not None for _, err in results)
        print(
            f"rewrote {len(examples) - failed}/{len(examples)} examples with {args.rewrite_model} "
            f"({client.stats.cache_hits} replies from the cache)"
        )
        examples = [e for e, _ in results]
    n = write_jsonl(args.out, (e.to_json() for e in examples))
    print(f"wrote {n} SFT examples to {args.out}")
    return 0
