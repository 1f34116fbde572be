"""Step-labelled examples: the JSONL schema every mmprm stage reads and writes.

One JSON object per line::

    {"id": "p17-s2",
     "images": ["imgs/p17.png"],          # relative to the JSONL file, or absolute
     "question": "<image1> What is the sum of the two bars?",
     "steps": ["The red bar is 7.", "The blue bar is 5.", "7 + 5 = 12."],
     "labels": [1.0, 1.0, 0.75],          # float in [0, 1] per step; omit for unlabelled data
     "answer": "12",                      # optional
     "meta": {"source": "omegaprm"}}      # optional, free-form

Images go before the question unless it holds placeholders (`<image>` or `<image1>`, ...), whose
count must equal the number of images. `load_examples` checks every row before any work starts and
raises `DataError` listing every problem as `FILE:LINE: id=...: field: what is wrong (how to fix)`.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import secrets
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from mmprm.steps import STEP_TOKEN, count_image_placeholders


@dataclass
class StepExample:
    """One problem with its solution steps (and per-step labels when labelled)."""

    id: str
    question: str
    steps: list[str]
    images: list[str] = field(default_factory=list)
    labels: list[float] | None = None
    answer: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        row: dict[str, Any] = {
            "id": self.id,
            "images": list(self.images),
            "question": self.question,
            "steps": list(self.steps),
        }
        if self.labels is not None:
            row["labels"] = [float(x) for x in self.labels]
        if self.answer is not None:
            row["answer"] = self.answer
        if self.meta:
            row["meta"] = self.meta
        return row


class DataError(ValueError):
    """Invalid input data. `problems` holds one actionable line per problem found."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        shown = "\n".join(problems[:50])
        more = f"\n... and {len(problems) - 50} more" if len(problems) > 50 else ""
        super().__init__(f"{len(problems)} problem(s) in input data:\n{shown}{more}")


def raise_if_bad(path: str | Path, bad: list[str], kept: int, what: str = "file") -> None:
    """Raise DataError listing every problem found in `path`; a file that gave no rows and no
    problems is one too (`what` names it in that message)."""
    if not kept and not bad:
        bad = [f"{path}:0: id=?: file: no rows (the {what} is empty)"]
    if bad:
        raise DataError(bad)


def row_id(obj: dict[str, Any], key: str = "id") -> str:
    """A row's id for messages: its value, or "?" when it has none (as for a line that is not JSON)."""
    value = obj.get(key)
    return "?" if value is None or (isinstance(value, str) and not value.strip()) else str(value)


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any] | None, str | None]]:
    """Yield (line number, parsed object or None, error or None) for each non-blank line.

    Bytes are decoded per line so one bad line is reported by number, not as a crash.
    Raises DataError for a directory (a file is expected).
    """
    if Path(path).is_dir():
        raise DataError([f"{path}: is a directory; give a JSONL file"])
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield (
                    lineno,
                    None,
                    f"not UTF-8: byte {e.start} is {raw[e.start : e.start + 1]!r} (re-save the file as UTF-8)",
                )
                continue
            if not line.strip():
                continue
            try:
                # without its newline: an error at the end of a cut-off line would read "line 2 column 1"
                obj = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                at = "" if e.msg.endswith(" at") else " at"  # "Unterminated string starting at"
                yield (
                    lineno,
                    None,
                    f"invalid JSON: {e.msg}{at} column {e.colno} (fix the line so it holds one JSON object)",
                )
                continue
            if not isinstance(obj, dict):
                yield lineno, None, 'not a JSON object (each line must be one object like {"id": ..., "question": ...})'
                continue
            yield lineno, obj, None


class ImageReadError(OSError):
    """An image file could not be read (an I/O error, a network filesystem's stale handle or
    timeout) even after retries. A later run may read it: callers treat this as an outage to
    rerun, never as a bad input to skip for good. A file that reads but does not decode is an
    `ImageDecodeError`, and is the input's fault."""


class ImageDecodeError(OSError):
    """An image file was read but is not an image PIL can decode: the input's fault, named by path."""


def load_image(image: Any, attempts: int = 3, wait: float = 0.5) -> Any:
    """A path opened as an RGB image (the processors expect 3 channels); an image object passes
    through as it is.

    Reading the bytes is retried `attempts` times, `wait` seconds doubling between tries, then
    raises `ImageReadError`; decoding is not retried (its errors are the file's content).
    """
    if not isinstance(image, (str, Path)):
        return image
    from PIL import Image

    for attempt in range(attempts):
        try:
            data = Path(image).read_bytes()
            break
        except OSError as e:
            if attempt == attempts - 1:
                raise ImageReadError(
                    f"{image}: could not read the file ({type(e).__name__}: {e}) in {attempts} tries; "
                    "check the filesystem, then rerun"
                ) from e
            time.sleep(wait * 2**attempt)
    try:
        with Image.open(io.BytesIO(data)) as im:
            return im.convert("RGB")
    except Exception as e:  # PIL raises many types for a broken file; its own message has no path
        raise ImageDecodeError(
            f"{image}: not a readable image ({type(e).__name__}: {e}); replace or re-export the file"
        ) from e


def check_image(path: Path, cache: dict[Path, str | None]) -> str | None:
    """Why `path` is not a usable image (missing, or not decodable), or None; each path is opened
    once per `cache`."""
    if path not in cache:
        if not path.exists():
            cache[path] = f"image not found: {path} (paths are relative to the JSONL file's folder)"
        else:
            try:
                from PIL import Image

                with Image.open(path) as im:
                    _ = im.size  # reads the header: enough to know it is an image
                cache[path] = None
            except Exception as e:  # PIL raises many types for broken files
                cache[path] = f"image unreadable: {path}: {type(e).__name__} (replace or re-export the file)"
    return cache[path]


def check_base_fields(
    obj: dict[str, Any], base_dir: Path, check_images: bool = True, image_cache: dict[Path, str | None] | None = None
) -> tuple[list[tuple[str, str]], list[str]]:
    """Validate the fields every row type shares (id, question, images): ([(field, message)], absolute images).

    With `check_images`, every image must exist and open as an image (its header is read).
    """
    errs: list[tuple[str, str]] = []
    cache = image_cache if image_cache is not None else {}
    rid = obj.get("id")
    if rid is None or (isinstance(rid, str) and not rid.strip()):
        errs.append(("id", "missing (add a unique string id to every row)"))
    elif not isinstance(rid, (str, int)) or isinstance(rid, bool):
        errs.append(("id", f"must be a string, got {type(rid).__name__}"))
    question = obj.get("question")
    if not isinstance(question, str) or not question.strip():
        errs.append(("question", "missing or empty (add the problem text)"))
        question = None
    elif STEP_TOKEN in question:
        errs.append(("question", f"contains the reserved step token {STEP_TOKEN!r} (remove it from the text)"))

    images = obj.get("images", [])
    resolved: list[str] = []
    if images is None:
        images = []
    if not isinstance(images, list) or not all(isinstance(p, str) for p in images):
        errs.append(("images", "must be a list of image paths (use [] for text-only)"))
        images = []
    for i, p in enumerate(images):
        full = Path(p) if os.path.isabs(p) else (base_dir / p)
        resolved.append(str(full.resolve()))
        if check_images:
            msg = check_image(full, cache)
            if msg:
                errs.append((f"images[{i}]", msg))
    if question is not None:
        n_ph = count_image_placeholders(question)
        if n_ph and n_ph != len(images):
            errs.append(
                (
                    "images",
                    f"question has {n_ph} image placeholder(s) but {len(images)} image(s) are listed "
                    "(list one image per placeholder, or remove the placeholders)",
                )
            )
    return errs, resolved


def check_row(
    obj: dict[str, Any],
    base_dir: Path,
    require_labels: bool = False,
    check_images: bool = True,
    image_cache: dict[Path, str | None] | None = None,
    steps_field: str = "steps",
) -> tuple[list[tuple[str, str]], StepExample | None]:
    """Validate one row. Returns ([(field, message)], example-or-None)."""
    errs, resolved = check_base_fields(obj, base_dir, check_images, image_cache)

    steps = obj.get(steps_field)
    if steps is None:
        errs.append((steps_field, "missing (a list of step strings)"))
        steps = None
    elif not isinstance(steps, list) or not all(isinstance(s, str) for s in steps):
        errs.append((steps_field, "must be a list of strings"))
        steps = None
    elif not steps:
        errs.append((steps_field, "empty list (a solution needs at least one step; drop the row)"))
    else:
        for i, s in enumerate(steps):
            if not s.strip():
                errs.append((f"{steps_field}[{i}]", "empty step text (remove the step and its label)"))
            elif STEP_TOKEN in s:
                errs.append((f"{steps_field}[{i}]", f"contains the reserved step token {STEP_TOKEN!r} (remove it)"))

    labels = obj.get("labels")
    if labels is None:
        if require_labels:
            errs.append(("labels", "missing (training needs one float in [0,1] per step)"))
    elif not isinstance(labels, list):
        errs.append(("labels", "must be a list of floats in [0,1]"))
        labels = None
    else:
        for i, x in enumerate(labels):
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                errs.append((f"labels[{i}]", f"{x!r} is not a number (use a float in [0,1])"))
            elif math.isnan(x) or math.isinf(x):
                errs.append((f"labels[{i}]", f"{x} is not a finite number (use a float in [0,1])"))
            elif not 0.0 <= x <= 1.0:
                errs.append((f"labels[{i}]", f"{x} is outside [0,1] (rescale, e.g. +1/-1 ratings -> 1/0)"))
        if steps is not None and len(labels) != len(steps):
            errs.append(("labels", f"{len(labels)} labels for {len(steps)} steps (give exactly one label per step)"))

    answer = obj.get("answer")
    if answer is not None and not isinstance(answer, (str, int, float)):
        errs.append(("answer", "must be a string"))
    meta = obj.get("meta", {}) or {}
    if not isinstance(meta, dict):
        errs.append(("meta", "must be a JSON object"))
    if errs:
        return errs, None
    return [], StepExample(
        id=str(obj["id"]),
        question=obj["question"],
        steps=list(steps),
        images=resolved,
        labels=[float(x) for x in labels] if labels is not None else None,
        answer=str(answer) if answer is not None else None,
        meta=meta,
    )


def scan_examples(
    path: str | Path, require_labels: bool = False, check_images: bool = True
) -> Iterator[tuple[StepExample | None, list[str]]]:
    """Check the rows of a step-labelled JSONL file one at a time: (the row's example or None, its
    problem lines). A file that cannot be read at all, or has no rows, gives one (None, [why]).
    Memory is the ids seen (duplicates are problems), not the examples."""
    path = Path(path)
    if not path.exists():
        yield None, [f"{path}: file not found (check data.* paths in your config)"]
        return
    if path.is_dir():
        yield None, [f"{path}: is a directory; give a JSONL file (`mmprm validate DIR` checks each *.jsonl in DIR)"]
        return
    base = path.parent
    seen: dict[str, int] = {}
    cache: dict[Path, str | None] = {}
    n_rows = 0
    for lineno, obj, err in iter_jsonl(path):
        n_rows += 1
        if err:
            yield None, [f"{path}:{lineno}: id=?: line: {err}"]
            continue
        rid = row_id(obj)
        errs, ex = check_row(obj, base, require_labels, check_images, cache)
        problems = [f"{path}:{lineno}: id={rid}: {fld}: {msg}" for fld, msg in errs]
        if not errs:
            if rid in seen:
                problems.append(
                    f"{path}:{lineno}: id={rid}: id: duplicated (first on line {seen[rid]}; make ids unique)"
                )
                ex = None
            else:
                seen[rid] = lineno
        yield ex, problems
    if n_rows == 0:
        yield None, [f"{path}:0: id=?: file: no rows (the file is empty)"]


def validate_file(
    path: str | Path, require_labels: bool = False, check_images: bool = True
) -> tuple[list[StepExample], list[str]]:
    """Check every row of a step-labelled JSONL file; return (examples, problem lines)."""
    examples: list[StepExample] = []
    problems: list[str] = []
    for ex, lines in scan_examples(path, require_labels, check_images):
        problems += lines
        if ex is not None:
            examples.append(ex)
    return examples, problems


def load_examples(path: str | Path, require_labels: bool = False, check_images: bool = True) -> list[StepExample]:
    """Load and validate a step-labelled JSONL file; raise DataError listing every problem."""
    examples, problems = validate_file(path, require_labels, check_images)
    if problems:
        raise DataError(problems)
    return examples


@contextlib.contextmanager
def atomic_write(path: str | Path, binary: bool = False) -> Iterator[IO]:
    """Open PATH for writing text (bytes with `binary`) through a temp file beside it, renamed over
    PATH on success, so a crash never leaves half a file. Each call's temp name is its own, so
    processes writing the same PATH at once never write into one another's.

    The temp file is created like `open()` creates files (mode 0o666 less the umask): mkstemp's
    0o600 would keep the outputs from teammates on a shared cluster.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_jsonl(path: str | Path, rows: Iterable[dict[str, Any] | StepExample]) -> int:
    """Write rows atomically (`atomic_write`), so a crash never leaves half a file."""
    n = 0
    with atomic_write(path) as f:
        for row in rows:
            if isinstance(row, StepExample):
                row = row.to_json()
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Plain JSONL reader for our own outputs; raises DataError naming the bad line."""
    rows, problems = [], []
    for lineno, obj, err in iter_jsonl(path):
        if err:
            problems.append(f"{path}:{lineno}: id=?: line: {err}")
        else:
            rows.append(obj)
    if problems:
        raise DataError(problems)
    return rows


def to_hf_dataset(examples: list[StepExample]):
    """The examples as a `datasets.Dataset` (labels as float lists, null when unlabelled)."""
    import datasets

    return datasets.Dataset.from_list(
        [
            {
                "id": e.id,
                "images": e.images,
                "question": e.question,
                "steps": e.steps,
                "labels": e.labels,
                "answer": e.answer,
                "meta": json.dumps(e.meta),
            }
            for e in examples
        ]
    )
