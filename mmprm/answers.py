"""Final-answer extraction and answer verification.

`extract_answer` reads the answer a solution commits to; `answers_match` decides whether it
equals the gold answer; `verify_solution` does both. They label Best-of-N candidates, grade
rollouts during OmegaPRM annotation and split SFT solutions, so they must be fast, never hang
and never raise on model output.

Extraction precedence (first rule that finds something wins; within a rule the *last*
occurrence wins, because models restate the question before they answer):

1. our step format's `<answer>X</answer>` (the first one, as `mmprm.steps.parse_solution`);
2. the last `\\boxed{...}` / `\\fbox{...}` with balanced (nested) braces, or `\\boxed 5`;
3. GSM8K `#### N`, then a line `A: N` (the format of GSM8K's example solutions);
4. phrases: "the (final) answer is X", "Answer: X", "the correct option is d", "answer should
   be X" - the text up to the end of that line or sentence;
5. a multiple-choice letter in the last line: "(C)" or `\\text{C}`; a line ending in a hedge
   over two letters, "(A) or (B).", gives the hedge, which matches no option;
6. a letter alone on the first line followed by an explanation ("B\\nBecause ...", "**(C)**");
7. the whole text when it is one short line that looks like a value or a letter ("5", "(B)",
   "C", "$x^2$"), not a short sentence ("I don't know").

With `last_number=True` the last number in the text is an eighth, weakest rule (what many
graders do); it is off by default so that a cut-off generation does not count as answered.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["extract_answer", "answers_match", "verify_solution", "normalize_answer", "choice_letter"]

# Longer strings are not handed to math-verify: real final answers are short, and sympy's time
# grows fast with length.
MAX_VERIFY_CHARS = 400
VERIFY_TIMEOUT_S = 3.0
# Relative tolerance of the plain numeric comparison (math-verify does its own rounding).
NUMERIC_REL_TOL = 1e-6

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)
_BOXED = re.compile(r"\\(?:boxed|fbox)\b")
_GSM8K_HASH = re.compile(r"####\s*(.+?)\s*$", re.M)
_GSM8K_A = re.compile(r"^\s*A:\s*(.+?)\s*$", re.M)
_PHRASE = re.compile(
    r"(?:\b(?:final\s+)?answer\s*(?:is|should\s+be|would\s+be|will\s+be|=)\s*:?"
    r"|\b(?:final\s+)?answer\s*:"
    r"|\bcorrect\s+(?:option|choice|answer)\s*(?:is|:)\s*:?)",
    re.I,
)
_SHORT_ANSWER = re.compile(r".*\d.*|[^a-zA-Z]+|\(?[A-Za-z]\)?\.?|\$.*\$|.*\\.*")
_PAREN_LETTER = re.compile(r"\(([A-Z])\)|\\(?:text|textbf|mathrm|mathbf)\s*\{\s*\(?([A-Z])\)?\s*\}")
# Two option letters offered together: "(A) and (B)", "(A), (C)"; bare letters only when that is
# the whole answer ("A or B"), since an option's own text may join point names ("(A) P and R").
_JOIN = r"\s*(?:,|/|&|\band/or\b|\band\b|\bor\b)\s*"
_PAREN_HEDGE = re.compile(rf"\(([A-Z])\){_JOIN}\(([A-Z])\)")
_BARE_HEDGE = re.compile(rf"\(?[A-Z]\)?(?:{_JOIN}\(?[A-Z]\)?)+")
# Options run A..H in practice; "I" alone on a line is more likely the start of a sentence.
_FIRST_LINE_LETTER = re.compile(r"[*_]*\(?([A-H])\)?[*_]*[.:)]?[*_]*")
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?|-?\.\d+")


def _balanced(text: str, start: int) -> str | None:
    """Content of the `{...}` group opening at `text[start]`, or None if it never closes."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
    return None


def _last_boxed(text: str) -> str | None:
    for m in reversed(list(_BOXED.finditer(text))):
        rest = text[m.end() :]
        stripped = rest.lstrip()
        if stripped.startswith("{"):
            content = _balanced(text, len(text) - len(stripped))
            if content is not None and content.strip():
                return content.strip()
        else:  # `\boxed 5`: one token
            tok = re.match(r"[^\s$]+", stripped)
            if tok:
                return tok.group(0)
    return None


def _clean_phrase(ans: str) -> str:
    """Trim what follows an answer phrase to the answer itself."""
    ans = ans.strip()
    if ans.startswith("\\boxed") or ans.startswith("\\fbox"):
        boxed = _last_boxed(ans)
        if boxed:
            return boxed
    if ans.startswith("$"):  # "$x = 5$, so ..." -> the math between the dollars
        end = ans.find("$", 1) if not ans.startswith("$$") else ans.find("$$", 2)
        if end > 0:
            return ans[: end + (2 if ans.startswith("$$") else 1)].strip()
    # A sentence end: ". " followed by more text, or ", because/since/as/which ...".
    ans = re.split(r"\.\s+(?=[A-Z(])|,\s+(?:because|since|as|which|so)\b", ans, maxsplit=1)[0]
    ans = ans.strip().strip("*").strip()
    return ans.rstrip(".").strip()


def extract_answer(text: str, last_number: bool = False) -> str | None:
    """The final answer a solution commits to, as written (not normalised); None if none.

    See the module docstring for the precedence of the rules.

    Args:
        text: a model's solution (policy format, CoT with \\boxed, GSM8K style, ...).
        last_number: fall back to the last number in the text.

    >>> extract_answer("<step>2+3=5</step>\\n<answer>5</answer>")
    '5'
    >>> extract_answer("so $x=\\\\boxed{\\\\frac{1}{2}}$. The answer is 3")
    '\\\\frac{1}{2}'
    """
    if not text:
        return None
    m = _ANSWER_TAG.search(text)
    if m and m.group(1).strip():
        return m.group(1).strip()
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    for pattern in (_GSM8K_HASH, _GSM8K_A):
        found = pattern.findall(text)
        if found and found[-1].strip():
            return found[-1].strip()
    # Markers only (no capture) so that two on one line are both found; the answer runs to the
    # end of the line.
    for m in reversed(list(_PHRASE.finditer(text))):
        end = text.find("\n", m.end())
        ans = _clean_phrase(text[m.end() : end if end >= 0 else len(text)])
        if ans:
            return ans
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    last = _TEXT_CMD.sub(r"\1", lines[-1]) if lines else ""
    hedge = _hedge_at_end(last)
    if hedge:
        return hedge  # "could be (A) or (B)." names no single option
    letters = [a or b for a, b in _PAREN_LETTER.findall(lines[-1])] if lines else []
    if letters:
        return f"({letters[-1]})"
    # The letter first, then the reasoning: "B\nBecause the triangle ...".
    if len(lines) > 1:
        m = _FIRST_LINE_LETTER.fullmatch(_TEXT_CMD.sub(r"\1", lines[0]).strip("$ "))
        if m:
            return f"({m.group(1)})"
    # A one-line reply that looks like a value or a letter ("5", "(B)", "x=3"), not a short sentence.
    if len(lines) == 1 and len(lines[0]) <= 20 and _SHORT_ANSWER.fullmatch(lines[0]):
        return lines[0].rstrip(".")
    if last_number:
        nums = _NUMBER.findall(text)
        if nums:
            return nums[-1]
    return None


# ---------------------------------------------------------------- normalisation

_TEXT_CMD = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_UNIT_WORDS = re.compile(r"^([-+]?(?:\d+(?:\.\d*)?|\.\d+))\s*(?:[a-zA-Z]+\.?(?:\s+|\^\d|$))+$")
_ASSIGN = re.compile(r"^[a-zA-Z](?:_\{?\w+\}?)?\s*=\s*(?=[^=]+$)")
_THOUSANDS = re.compile(r"(?<![\d.])(\d{1,3})((?:,\d{3})+)(?![\d])")


def normalize_answer(ans: str) -> str:
    """Canonical text of an answer for comparison.

    Strips math delimiters, `\\text{}`-like wrappers, `\\left`/`\\right`, spacing commands, degree
    signs, percent and dollar signs, thousands commas, a leading `x =`, trailing unit words after
    a number, and a final period; `\\dfrac`/`\\tfrac` become `\\frac`. Whitespace is removed.

    >>> normalize_answer("$1,000$ dollars.")
    '1000'
    >>> normalize_answer("x = \\\\dfrac{1}{2}")
    '\\\\frac{1}{2}'
    """
    s = ans.strip()
    s = re.sub(r"^\\\(|\\\)$|^\\\[|\\\]$", "", s).strip()
    s = s.replace("\\$", "").replace("$", "").strip()
    for _ in range(3):  # nested wrappers, e.g. \text{\textbf{5}}
        s = _TEXT_CMD.sub(r"\1", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\left|\\right|\\[!,;: ]|\\displaystyle", "", s).replace("~", " ")
    s = re.sub(r"\^\s*\{?\\circ\}?|°|\\degree|\\%|%", "", s)
    s = s.rstrip(".").strip()
    s = _ASSIGN.sub("", s)
    s = s.replace("{,}", ",")
    s = _THOUSANDS.sub(lambda m: m.group(1) + m.group(2).replace(",", ""), s)
    m = _UNIT_WORDS.match(s)
    if m:
        s = m.group(1)
    return re.sub(r"\s+", "", s).rstrip(".")


def _hedge_at_end(line: str) -> str | None:
    """The "(A) or (B)" a line ends with (then only punctuation), naming two different letters."""
    for m in _PAREN_HEDGE.finditer(line):
        if m.group(1) != m.group(2) and not line[m.end() :].strip(" .!*$)"):
            return m.group(0)
    return None


def choice_letter(ans: str) -> str | None:
    """The option letter an answer names ("(B)", "b.", "Option C", "(C) 12", `\\text{B}`), upper-case,
    or None - also for a hedge over two letters ("(A) and (B)", "A or B"), which names no option."""
    s = re.sub(r"^\\[(\[]|\\[)\]]$", "", ans.strip().rstrip(".").strip()).strip().strip("$").strip()
    s = re.sub(r"\\[ ,;:!]", " ", s)
    for _ in range(3):  # nested wrappers, e.g. \text{\textbf{A}}
        s = _TEXT_CMD.sub(r"\1", s)
    s = s.strip()
    if len(set(re.findall(r"\(([A-Z])\)", s))) > 1 or (
        _BARE_HEDGE.fullmatch(s) and len(set(re.findall(r"[A-Z]", s))) > 1
    ):
        return None
    m = re.fullmatch(r"(?:(?:option|choice)\s*)?\(?([A-Za-z])\)?[.:)]*", s, re.I)
    if m:
        return m.group(1).upper()
    m = re.match(r"\(([A-Za-z])\)\s+\S", s)
    return m.group(1).upper() if m else None


_FRAC = re.compile(r"(-?)\\frac\{(-?\d+(?:\.\d+)?)\}\{(-?\d+(?:\.\d+)?)\}")
_FRAC_DIGITS = re.compile(r"(-?)\\frac(\d)(\d)")  # `\frac12`
# 3/4 and ratios 3:4; the empty group 1 keeps the (sign, numerator, denominator) layout of _FRAC.
_SLASH = re.compile(r"()(-?\d+(?:\.\d+)?)[/:](-?\d+(?:\.\d+)?)")
_PLAIN = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[-+]?\d+)?")


def _to_number(s: str) -> float | None:
    """Value of a normalised plain number, fraction, `\\frac{a}{b}` or ratio `a:b`; else None."""
    try:
        if _PLAIN.fullmatch(s):
            return float(s)
        for pattern in (_FRAC, _FRAC_DIGITS, _SLASH):
            m = pattern.fullmatch(s)
            if m:
                den = float(m.group(3))
                return (-1.0 if m.group(1) else 1.0) * float(m.group(2)) / den if den else None
    except (ValueError, OverflowError):
        return None
    return None


# ---------------------------------------------------------------- math-verify, guarded


class _VerifyTimeout(BaseException):
    """BaseException, so that math-verify's and sympy's `except Exception` cannot swallow it."""


@contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    """Raise _VerifyTimeout after `seconds` (main thread only), keeping any outer timer alive.

    math-verify's own timeouts call `signal.alarm`, which would cancel an enclosing timer
    (pytest-timeout, a job's watchdog); this re-arms the outer one with its remaining time.
    """

    def _raise(signum, frame):  # noqa: ARG001 - signal handler signature
        raise _VerifyTimeout

    seconds = max(seconds, 0.01)  # a zero timer would mean "no timeout"
    old_handler = signal.signal(signal.SIGALRM, _raise)
    outer_delay, outer_interval = signal.setitimer(signal.ITIMER_REAL, 0)
    start = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, min(seconds, outer_delay) if outer_delay > 0 else seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if outer_delay > 0:
            left = max(outer_delay - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, outer_interval)


class _DropNoTimeoutWarning(logging.Filter):
    # We pass timeout=None to math-verify on purpose (we time it out ourselves): hide its warning.
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


_mv_ready = False


def _quiet_math_verify() -> None:
    global _mv_ready
    if not _mv_ready:
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).addFilter(_DropNoTimeoutWarning())
        _mv_ready = True


def _math_verify_raw(pred: str, gold: str) -> bool:
    """math-verify on two answer strings, no timeout of its own (the caller provides one)."""
    from math_verify import parse, verify

    _quiet_math_verify()
    gold_p = parse(f"${gold}$", parsing_timeout=None)
    pred_p = parse(f"${pred}$", parsing_timeout=None)
    if not gold_p or not pred_p:
        return False
    return bool(verify(gold_p, pred_p, timeout_seconds=None))


def _math_verify_main_thread(pred: str, gold: str, timeout_s: float) -> bool:
    try:
        with _alarm(timeout_s):
            return _math_verify_raw(pred, gold)
    except _VerifyTimeout:
        logger.debug("math-verify timed out on %r vs %r", pred[:80], gold[:80])
        return False
    except Exception:  # noqa: BLE001 - sympy raises anything on odd input (RecursionError too)
        return False


class _VerifyWorker:
    """A child `python -m mmprm.answers --serve` that runs math-verify for other threads.

    Off the main thread no signal can interrupt sympy, so the work goes to a process that can be
    killed. A subprocess (not multiprocessing) so that callers need no `__main__` guard.
    Protocol: one JSON request per line in, one "1"/"0" line out.
    """

    STARTUP_S = 60.0  # python + sympy import on a loaded machine
    GRACE_S = 5.0  # beyond the request's own timeout, which the worker enforces itself

    def __init__(self) -> None:
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[1])  # the same mmprm, installed or not
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mmprm.answers", "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        self.started = False

    def _readline(self, timeout_s: float) -> bytes | None:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        return self.proc.stdout.readline() if ready else None

    def ask(self, pred: str, gold: str, timeout_s: float) -> bool | None:
        """The worker's verdict, or None if it died or ran past its time (then it is killed)."""
        assert self.proc.stdin is not None
        try:
            if not self.started:
                if self._readline(self.STARTUP_S) != b"ready\n":
                    raise OSError("math-verify worker did not start")
                self.started = True
            req = json.dumps({"pred": pred, "gold": gold, "timeout": timeout_s})
            self.proc.stdin.write(req.encode() + b"\n")
            self.proc.stdin.flush()
            line = self._readline(timeout_s + self.GRACE_S)
            if line in (b"1\n", b"0\n"):
                return line == b"1\n"
        except OSError:
            pass
        self.close()
        return None

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


_worker_lock = threading.Lock()
_worker: _VerifyWorker | None = None


def _math_verify_off_main_thread(pred: str, gold: str, timeout_s: float) -> bool:
    global _worker
    with _worker_lock:  # one request at a time: the worker is a single pipe
        if _worker is None or _worker.proc.poll() is not None:
            _worker = _VerifyWorker()
        verdict = _worker.ask(pred, gold, timeout_s)
        if verdict is None:
            _worker = None
            return False
        return verdict


def _serve() -> None:
    """Worker loop of `_VerifyWorker`: read requests from stdin until EOF."""
    import math_verify  # noqa: F401 - pay the import before saying ready

    out = sys.stdout.buffer
    out.write(b"ready\n")
    out.flush()
    for line in sys.stdin.buffer:
        req = json.loads(line)
        ok = _math_verify_main_thread(req["pred"], req["gold"], float(req["timeout"]))
        out.write(b"1\n" if ok else b"0\n")
        out.flush()


def math_verify_equal(pred: str, gold: str, timeout_s: float = VERIFY_TIMEOUT_S) -> bool:
    """math-verify's equivalence of two answers, safe from any thread; False on error or timeout.

    Args:
        pred: predicted answer (LaTeX or plain, without `$`).
        gold: gold answer.
        timeout_s: wall-clock limit for parsing and comparing.
    """
    if len(pred) > MAX_VERIFY_CHARS or len(gold) > MAX_VERIFY_CHARS:
        return False
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        return _math_verify_off_main_thread(pred, gold, timeout_s)
    return _math_verify_main_thread(pred, gold, timeout_s)


def call_with_timeout(fn: Callable[[], T], default: T, timeout_s: float = VERIFY_TIMEOUT_S) -> T:
    """`fn()` under a wall-clock limit; `default` on timeout or on any error.

    For sympy work on answers (benchmark judges that evaluate or simplify expressions): sympy can
    run for minutes on odd input and only a signal can stop it, which works on the main thread.
    Off it, `fn()` runs without the limit: a slow verdict beats a correct answer graded wrong.
    """
    guarded = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
    try:
        if not guarded:
            return fn()
        with _alarm(timeout_s):
            return fn()
    except _VerifyTimeout:
        return default
    except Exception:  # noqa: BLE001 - sympy raises anything on odd input
        return default


def sympy_answer(ans: str) -> Any | None:
    """The sympy object math-verify parses from an answer (`x^2=1` -> Eq(x**2, 1)), or None.

    Unit words stay symbols (`3570 km` -> 3570*k*m), as a plain LaTeX parser reads them: a judge
    that compares parsed answers must not find `3570 km` equal to `3570`. Call it inside
    `call_with_timeout`: parsing has no limit of its own here.
    """
    from math_verify import LatexExtractionConfig, parse

    _quiet_math_verify()
    latex = LatexExtractionConfig()
    units_kept = dataclasses.replace(latex.normalization_config, units=False)
    latex = dataclasses.replace(latex, normalization_config=units_kept)
    parsed = parse(f"${ans}$", extraction_config=[latex], parsing_timeout=None)
    return parsed[0] if parsed and not isinstance(parsed[0], str) else None


# ---------------------------------------------------------------- matching


def _values_match(pred: str, gold: str) -> bool:
    """Equality of two non-letter answers: normalised text, then number, then math-verify."""
    p, g = normalize_answer(pred), normalize_answer(gold)
    if not p or not g:
        return False
    if p == g or (p.casefold() == g.casefold() and "\\" not in p + g):
        return True
    pn, gn = _to_number(p), _to_number(g)
    if pn is not None and gn is not None:
        return math.isclose(pn, gn, rel_tol=NUMERIC_REL_TOL, abs_tol=1e-9)
    return math_verify_equal(_mv_text(pred), _mv_text(gold))


def _mv_text(ans: str) -> str:
    """Answer text for math-verify: delimiters and `\\text{}` units removed, LaTeX kept."""
    s = ans.strip().strip("$").strip()
    s = re.sub(r"\\text\s*\{\s*[a-zA-Z ]*\}\s*$", "", s) if re.search(r"\d", s) else s
    return s.replace("\\$", "").strip()


def answers_match(pred: str | None, gold: str, choices: list[str] | None = None) -> bool:
    """Whether a predicted final answer equals the gold answer.

    Order: option letters (case-insensitive; with `choices`, a letter is also compared through
    its option text and an option text through its letter), then normalised text, then numeric
    value (fractions, ratios `a:b`, relative tolerance 1e-6), then math-verify (symbolic; guarded
    by a timeout and a length limit, never raises).

    Args:
        pred: the extracted answer, or None (never matches).
        gold: the gold answer: a value, or an option letter.
        choices: option texts in letter order (A, B, ...), when the problem is multiple choice.
    """
    if pred is None or not pred.strip() or not gold.strip():
        return False
    options = [c for c in choices or [] if c is not None]
    # MATH-V lists bare letters as options when the texts live in the image.
    texts = None if all(choice_letter(c) == chr(65 + i) for i, c in enumerate(options)) else options
    gold_letter = choice_letter(gold) if (options or re.fullmatch(r"\(?[A-Z]\)?", gold.strip())) else None
    pred_letter = choice_letter(pred) if (options or gold_letter) else None
    if gold_letter is not None:
        if pred_letter is not None:
            return pred_letter == gold_letter
        idx = ord(gold_letter) - 65
        if texts and idx < len(texts):
            return _values_match(pred, texts[idx])
        return False
    if pred_letter is not None and texts:
        idx = ord(pred_letter) - 65
        return idx < len(texts) and _values_match(texts[idx], gold)
    return _values_match(pred, gold)


def verify_solution(text: str, gold: str, choices: list[str] | None = None) -> bool:
    """Whether a full solution's final answer (by `extract_answer`) equals `gold`."""
    return answers_match(extract_answer(text), gold, choices)


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    _serve()
