"""Training data at any size: text tokenized once and cached on disk, images opened per batch.

    data, stats = load_tokenized(path, "prm", processor, settings, accelerator=accelerator)
    collate = PRMCollator(data, processor, pad_id, **settings)   # per micro-batch
    batch, items = collate([3, 17, 42, 8])

Memory does not grow with the dataset: the cache is Arrow, memory-mapped, and holds only text
and token ids; pixels exist only for the batch being trained on and in the collator's bounded
cache of recent prompts (`PRMCollator`: an MCTS export repeats each problem's prompt and image).

**Tokenize once.** Each row is tokenized with the very functions training uses
(`mmprm.steps.tokenize_steps` for a PRM, `mmprm.data.sft.tokenize_sft` for a policy) inside
`datasets.map(num_proc=...)` (progress bar with ETA), and the result is written under
`cache_dir/<key>/`. The key hashes the input file (absolute path, size, mtime), the processor
(class, tokenizer with its added tokens, chat template, image-processor settings) and every
setting that changes the result (max_length, step token, system prompt, label mode, ...). A rerun,
or a rank that waited on the cache's file lock, opens the cache instead of tokenizing again. A build
goes to a temporary folder renamed into place, so concurrent builders never see half a cache.

**How the cache knows the image-token count without pixels.** The number of image tokens a
processor writes depends on the image size only (Qwen2-VL's grid, InternVL's tiles, LLaVA's
fixed count; the same fact vLLM's `_get_num_multimodal_tokens(image_sizes)` builds on). So the
cache is built from blank images of each file's header size, never decoding a pixel, and the
image processor's output is memoised per size (`_SizeMemo`: rows that share an image size pay
for one preprocessing). The collator then opens the real images, runs the same tokenization per
batch and checks that ids and step positions equal the cached ones; an image changed on disk
after the cache was built fails there with the row named, rather than training on shifted labels.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import fcntl
import functools
import hashlib
import itertools
import json
import os
import shutil
import socket
import sys
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from mmprm.data.schema import DataError, check_row, iter_jsonl, load_image
from mmprm.data.sft import sft_row_problems
from mmprm.models.spec import train_step_format
from mmprm.steps import (
    STEP_TOKEN,
    StepTokenError,
    TokenizedSteps,
    assistant_start,
    check_special_tokens,
    extend_steps,
    render_solution,
    tokenize_steps,
)
from mmprm.training.collate import PER_TOKEN_KEYS, collate_model_inputs, collate_steps

CACHE_FORMAT = 3  # bump when a cached column changes meaning or a build refuses more rows
# (2: prompt_length; 3: SFT rows with the model's special tokens refused)
# A step labelled below this is an error step (the threshold balancing and step metrics use too).
NEGATIVE_BELOW = 0.5
IGNORE = -100  # label of tokens that carry no loss (cross_entropy's ignore_index)
Kind = Literal["prm", "sft"]
# How a row's MC values become training targets (`prm_labels`); prm_train's data.label_mode.
LabelMode = Literal["soft", "hard", "hard_any_correct"]


def default_cache_dir() -> Path:
    """`$MMPRM_CACHE`, else `~/.cache/mmprm/tokenized` (put it on storage every node sees)."""
    env = os.environ.get("MMPRM_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "mmprm" / "tokenized"


def default_num_proc() -> int:
    """Tokenization workers when the config says none: the CPUs this process may use, at most 16."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(16, cpus))


def processor_fingerprint(processor: Any) -> str:
    """Hash of everything in a processor that changes token ids: class, vocabulary with added
    tokens (the step token included), chat template and image-processor settings."""
    tok = getattr(processor, "tokenizer", processor)
    backend = getattr(tok, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(sorted(tok.get_vocab().items()))
    parts = [
        type(processor).__qualname__,
        type(tok).__qualname__,
        vocab,
        str(getattr(processor, "chat_template", None) or getattr(tok, "chat_template", None)),
        processor.to_json_string() if hasattr(processor, "image_processor") else "",
    ]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


def cache_key(path: str | Path, processor_hash: str, settings: dict[str, Any]) -> str:
    """Cache folder name for one input file, processor and settings."""
    st = Path(path).stat()
    ident = {
        "file": str(Path(path).resolve()),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "processor": processor_hash,
        "settings": settings,
        "format": CACHE_FORMAT,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:24]


def truncation_keeps_row(labels: Sequence[float], kept: int, negative_below: float = NEGATIVE_BELOW) -> bool:
    """Whether a row cut to its first `kept` steps still trains honestly.

    Cutting trailing steps keeps every kept label true (a step's label is about its prefix), but
    cutting the first error step turns a negative path into a positive-looking one: such a row
    is dropped instead. Cutting the prompt side instead is no option: the question and its images
    are what every step is judged against, and image tokens cannot be cut part-way.

    >>> truncation_keeps_row([1.0, 1.0, 0.0], kept=2)   # the error step would be cut
    False
    >>> truncation_keeps_row([1.0, 0.0, 0.0], kept=2)   # the first error is kept
    True
    """
    first_error = next((i for i, x in enumerate(labels) if x < negative_below), None)
    return first_error is None or first_error < kept


# ---------------------------------------------------------------- reading and checking rows


def _scan(path: Path, kind: Kind) -> Iterator[tuple[str | None, dict[str, Any] | None]]:
    """(problem, None) or (None, row) for every line; rows are plain dicts, text only."""
    seen: dict[str, int] = {}
    for lineno, obj, err in iter_jsonl(path):
        if err:
            yield f"{path}:{lineno}: id=?: line: {err}", None
            continue
        # images are opened (header only) when tokenized, in parallel; here only their paths resolve
        errs, ex = check_row(obj, path.parent, require_labels=kind == "prm", check_images=False)
        if kind == "sft":
            errs += sft_row_problems(obj)
        for fld, msg in errs:
            yield f"{path}:{lineno}: id={obj.get('id')}: {fld}: {msg}", None
        if ex is None or errs:
            continue
        if ex.id in seen:
            yield f"{path}:{lineno}: id={ex.id}: id: duplicated (first on line {seen[ex.id]}; make ids unique)", None
            continue
        seen[ex.id] = lineno
        yield (
            None,
            {
                "id": ex.id,
                "line": lineno,
                "question": ex.question,
                "steps": ex.steps,
                "images": ex.images,
                "labels": ex.labels,
                "answer": ex.answer,
            },
        )


def check_file(path: str | Path, kind: Kind, allow_images: bool = True) -> int:
    """Check every row of a JSONL file; raise one `DataError` listing every problem, else return the row count.

    Memory holds the ids seen (for the duplicates check), never the rows.
    """
    path = Path(path)
    if not path.exists():
        raise DataError([f"{path}: file not found (check data.train_file / data.eval_file in your config)"])
    problems: list[str] = []
    n_rows = with_images = 0
    first_with_images = None
    for problem, row in _scan(path, kind):
        if problem:
            problems.append(problem)
            continue
        n_rows += 1
        if row["images"]:
            with_images += 1
            first_with_images = first_with_images or row["id"]
    if n_rows == 0 and not problems:
        problems.append(f"{path}:0: id=?: file: no rows (the file is empty)")
    if with_images and not allow_images:
        problems.append(
            f"{path}: id={first_with_images}: images: this model is text-only but {with_images} rows "
            "have images (use a VLM, or drop the images)"
        )
    if problems:
        raise DataError(problems)
    return n_rows


def iter_checked_rows(path: str | Path, kind: Kind) -> Iterator[dict[str, Any]]:
    """The valid rows of a file `check_file` passed, as plain dicts."""
    for _problem, row in _scan(Path(path), kind):
        if row is not None:
            yield row


# ---------------------------------------------------------------- tokenizing one row (inside map)


class _BytesLRU:
    """Values by key, least recently used out first once their sizes pass `max_bytes`; a value
    larger than the whole bound is not kept. `entries` maps key -> (value, size)."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.bytes = max_bytes, 0
        self.entries: OrderedDict[Any, tuple[Any, int]] = OrderedDict()

    def get(self, key: Any) -> Any:
        if key not in self.entries:
            return None
        self.entries.move_to_end(key)
        return self.entries[key][0]

    def put(self, key: Any, value: Any, size: int) -> None:
        if size > self.max_bytes or key in self.entries:
            return
        self.entries[key] = (value, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, dropped) = self.entries.popitem(last=False)
            self.bytes -= dropped


def _prompt_key(row: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
    """Rows with the same question and image paths share their tokenized prompt."""
    return row["question"], tuple(row["images"])


def _remember_prompt(prompts: _BytesLRU, key: Any, tok: TokenizedSteps | None) -> None:
    """Keep a row's tokenization for `extend_steps` on the problem's later rows, when its prompt can
    be reused; its size counts the ids and the processor's tensors (the image's pixel values)."""
    if tok is not None and tok.prompt_length is not None:
        prompts.put(key, tok, 8 * len(tok.input_ids) + _tensor_bytes(tok.model_inputs.values()))


def _tensor_bytes(values: Any) -> int:
    """Bytes held by the tensors among `values`."""
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


class _SizeMemo:
    """An image processor that remembers its output per tuple of image sizes.

    Only used on blank images, whose processed output depends on their size alone; bounded by
    bytes so a real 7B processor (about 11 MB of pixel_values per 800x600 image) stays small.
    """

    def __init__(self, image_processor: Any, max_bytes: int = 256 << 20):
        self.image_processor = image_processor
        self.memo = _BytesLRU(max_bytes)

    def __call__(self, images: Any = None, *args: Any, **kwargs: Any) -> Any:
        key = (tuple(im.size for im in images), args, repr(sorted(kwargs.items())))
        out = self.memo.get(key)
        if out is None:
            out = self.image_processor(images, *args, **kwargs)
            self.memo.put(key, out, _tensor_bytes(out.values()))
        return copy.copy(out)  # processors may pop keys from what they get

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("image_processor", "memo"):
            raise AttributeError(name)  # not yet set while unpickling in a worker: no recursion
        return getattr(self.image_processor, name)


def _blank_image_processor(processor: Any) -> Any:
    """A shallow copy of `processor` whose image processor is memoised per image size."""
    if not hasattr(processor, "image_processor"):
        return processor
    blank = copy.copy(processor)
    blank.image_processor = _SizeMemo(processor.image_processor)
    return blank


@functools.lru_cache(maxsize=8192)
def _image_size(path: str, mtime_ns: int) -> tuple[int, int]:
    """(width, height) from the file header; cached (the rows of one question share its image)
    per modification time, so a file rewritten in a long-lived process is read again."""
    from PIL import Image

    with Image.open(path) as im:
        return im.size


def _blank_images(paths: Sequence[str]) -> list[Any]:
    """Black RGB images of each file's size; only the header is read."""
    from PIL import Image

    return [Image.new("RGB", _image_size(p, os.stat(p).st_mtime_ns)) for p in paths]


def _where(source: str, row: dict[str, Any]) -> str:
    return f"{source}:{row['line']}: id={row['id']}"


def prm_labels(labels: Sequence[float], label_mode: LabelMode, hard_threshold: float) -> list[float]:
    """Training targets from a row's MC values.

    soft: the MC values as they are. hard: 1 where MC >= hard_threshold, else 0.
    hard_any_correct: MM-PRM's hard labels, 1 where MC > 0 (some rollout from the step reached the
    gold answer), else 0; hard_threshold plays no part.

    >>> prm_labels([0.0, 0.0625, 0.5, 1.0], "hard_any_correct", 0.5)
    [0.0, 1.0, 1.0, 1.0]
    >>> prm_labels([0.0, 0.0625, 0.5, 1.0], "hard", 0.5)
    [0.0, 0.0, 1.0, 1.0]
    """
    if label_mode == "hard":
        return [1.0 if x >= hard_threshold else 0.0 for x in labels]
    if label_mode == "hard_any_correct":
        return [1.0 if x > 0 else 0.0 for x in labels]
    return [float(x) for x in labels]


def _tokenize_prm_row(
    row: dict[str, Any],
    processor: Any,
    source: str,
    max_length: int,
    step_token: str,
    system: str | None,
    label_mode: LabelMode,
    hard_threshold: float,
    prompts: _BytesLRU | None = None,
    layout: str = "mmprm",
) -> dict[str, Any]:
    """`prompts`: the tokenized prompts of recent problems (question, images), so that the other
    rows of a problem tokenize only their steps (`extend_steps`: the same ids, without running the
    processor on the prompt and images again). `layout`: the PRM's input layout
    (`mmprm.models.spec.train_step_format`)."""
    fmt = train_step_format(layout, step_token)
    out = {
        "labels": prm_labels(row["labels"], label_mode, hard_threshold),
        "input_ids": [],
        "step_positions": [],
        "length": 0,
        "n_steps": 0,
        "n_pos": 0,
        "dropped_steps": 0,
        "prompt_length": -1,
        "drop": None,
        "error": None,
    }
    key = _prompt_key(row)
    base = prompts.get(key) if prompts is not None else None
    try:
        tok = extend_steps(processor, base, row["steps"], out["labels"], max_length, step_token, fmt) if base else None
    except (StepTokenError, ValueError) as e:
        out["error"] = f"{_where(source, row)}: steps: {e}"
        return out
    if tok is None:
        try:
            images = _blank_images(row["images"])
        except (OSError, ValueError) as e:  # PIL raises several types for missing or broken files
            out["error"] = f"{_where(source, row)}: images: {type(e).__name__}: {e} (fix or replace the file)"
            return out
        try:
            tok = tokenize_steps(
                processor, row["question"], row["steps"], images, out["labels"], max_length, step_token, system, fmt
            )
        except (StepTokenError, ValueError) as e:
            out["error"] = f"{_where(source, row)}: steps: {e}"
            return out
        if prompts is not None:
            _remember_prompt(prompts, key, tok)
    if tok is None:
        out["drop"] = "prompt_too_long"
    elif not truncation_keeps_row(out["labels"], len(tok.step_positions)):
        out["drop"] = "error_step_truncated"
    else:
        out.update(
            input_ids=tok.input_ids,
            step_positions=tok.step_positions,
            length=len(tok.input_ids),
            n_steps=len(tok.step_positions),
            n_pos=sum(x >= NEGATIVE_BELOW for x in tok.labels),
            dropped_steps=tok.dropped_steps,
            prompt_length=-1 if tok.prompt_length is None else tok.prompt_length,
        )
    return out


def _tokenize_sft_row(
    row: dict[str, Any], processor: Any, source: str, max_length: int, system: str | None
) -> dict[str, Any]:
    out = {"input_ids": [], "n_prompt": 0, "length": 0, "n_targets": 0, "drop": None, "error": None}
    try:
        images = _blank_images(row["images"])
    except (OSError, ValueError) as e:
        out["error"] = f"{_where(source, row)}: images: {type(e).__name__}: {e} (fix or replace the file)"
        return out
    try:
        tok = tokenize_sft(processor, row["question"], row["steps"], row["answer"], images, max_length, system)
    except StepTokenError as e:
        out["error"] = f"{_where(source, row)}: {e}"
        return out
    if tok is None:
        out["drop"] = "prompt_too_long"
    else:
        out.update(
            input_ids=tok["input_ids"],
            n_prompt=tok["n_prompt"],
            length=len(tok["input_ids"]),
            n_targets=tok["n_targets"],
        )
    return out


# ---------------------------------------------------------------- SFT tokenization


def tokenize_sft(
    processor: Any,
    question: str,
    steps: Sequence[str],
    answer: str | None,
    images: Sequence[Any] = (),
    max_length: int = 2048,
    system: str | None = None,
    n_prompt: int | None = None,
) -> dict[str, Any] | None:
    """Ids and loss labels of one SFT example: prompt tokens masked with IGNORE, the solution learned.

    The target is `render_solution(steps, answer)` plus EOS after the chat-templated prompt.
    `n_prompt` (prompt tokens, as an earlier call returned) skips a second pass of the processor
    over the images. Returns None when truncation leaves no assistant token.

    Returns:
        {"input_ids", "labels" (IGNORE on the prompt), "extra" (processor outputs, batch dim 1),
        "n_prompt", "n_targets" (tokens that carry loss after the one-token shift)}.
    """
    tokenizer = getattr(processor, "tokenizer", processor)
    # A chat token inside the text would teach the policy to end its turn (or open an image) mid-step.
    check_special_tokens(processor, question, steps, STEP_TOKEN, answer)
    prompt, lead = assistant_start(processor, question, len(images), system)
    # The lead (" " after LLaVA-1.5's "ASSISTANT:") is learned with the answer, as the model generates it.
    target = lead + render_solution(steps, answer) + (tokenizer.eos_token or "")
    if images:
        enc = processor(text=[prompt + target], images=list(images), return_tensors="pt")
        if n_prompt is None:
            n_prompt = len(processor(text=[prompt], images=list(images), return_tensors="pt")["input_ids"][0])
    else:
        enc = tokenizer([prompt + target], return_tensors="pt", add_special_tokens=False)
        if n_prompt is None:
            n_prompt = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    ids = enc["input_ids"][0].tolist()
    if n_prompt >= min(len(ids), max_length):
        return None
    ids = ids[:max_length]
    labels = [IGNORE] * n_prompt + ids[n_prompt:]
    extra = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
    for key in PER_TOKEN_KEYS:
        if key in extra:
            extra[key] = extra[key][:, :max_length]
    return {
        "input_ids": ids,
        "labels": labels,
        "extra": extra,
        "n_prompt": n_prompt,
        "n_targets": sum(x != IGNORE for x in labels[1:]),
    }


def collate_sft(items: Sequence[dict[str, Any]], pad_id: int) -> dict[str, Any]:
    """Right-pad `tokenize_sft` outputs: input_ids / attention_mask / labels (B, S) + image tensors."""
    width = max(len(t["input_ids"]) for t in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    labels = torch.full((len(items), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for i, t in enumerate(items):
        n = len(t["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(t["input_ids"]), torch.tensor(t["labels"]), 1
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": labels,
        **collate_model_inputs([t["extra"] for t in items], width),
    }


# ---------------------------------------------------------------- the cache


def load_tokenized(
    path: str | Path,
    kind: Kind,
    processor: Any,
    settings: dict[str, Any],
    cache_dir: str | Path | None = None,
    num_proc: int | None = None,
    accelerator: Any = None,
) -> tuple[Any, dict[str, Any]]:
    """The tokenized rows of a JSONL file, memory-mapped (`CachedRows`), plus counts.

    Args:
        path: step-labelled JSONL (kind="prm") or SFT JSONL (kind="sft").
        kind: which tokenization: `tokenize_steps` (prm) or `tokenize_sft` (sft).
        processor: the processor training uses (with the step token already added, for a PRM).
        settings: keyword arguments of the row tokenizer; prm: max_length, step_token, system,
            label_mode, hard_threshold (and layout, when not mmprm's own); sft: max_length, system.
            All of them key the cache.
        cache_dir: where caches live (default `default_cache_dir()`).
        num_proc: tokenization workers (default `default_num_proc()`).
        accelerator: with several processes, the first to take the cache's file lock builds and the
            others wait on the lock, never in a collective (whose timeout a long build outlasts), then open.

    Returns:
        (rows, stats): the kept rows (`CachedRows`), with columns id, line, question, steps, images,
        labels, answer, input_ids, length (+ step_positions, n_steps, n_pos, dropped_steps for
        prm; n_prompt, n_targets for sft); stats counts examples, kept, the rows dropped by reason,
        trailing steps cut, whether the cache was reused, the cache folder, and the seconds this
        call took (tokenizing, or opening the cache).
    """
    started = time.perf_counter()
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    settings = {"kind": kind, **settings}
    folder = root / cache_key(path, processor_fingerprint(processor), settings)
    reused = (folder / "stats.json").is_file()
    if accelerator is not None and accelerator.num_processes > 1:
        # The first rank to take the folder's file lock builds; the others wait for the lock, not
        # in a collective, whose timeout (NCCL's 600 s) a large build outlasts. A rank that gets
        # the lock and finds no cache builds it itself: the builder failed (it raises on every
        # rank then) or sees other storage (each node builds its own).
        with _build_lock(root / f"{folder.name}.lock", accelerator):
            if not (folder / "stats.json").is_file():
                _build(path, kind, processor, settings, folder, num_proc or default_num_proc())
    elif not reused:
        _build(path, kind, processor, settings, folder, num_proc or default_num_proc())
    stats = json.loads((folder / "stats.json").read_text())
    data = CachedRows(folder / "data")
    stats.update(reused=reused, cache=str(folder), seconds=round(time.perf_counter() - started, 3))
    return data, stats


@contextlib.contextmanager
def _build_lock(lock: Path, accelerator: Any) -> Iterator[None]:
    """Hold an exclusive `flock` on LOCK, waiting as long as the holder takes. The kernel releases
    it when the holder exits, killed or not. Where the filesystem has no locks, go on without:
    every rank then builds, and the rename in `_build` keeps one cache."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except BlockingIOError:
            accelerator.print(f"waiting for another process to finish the tokenization cache ({lock})")
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            locked = True
        except OSError as e:  # no locks on this filesystem (some NFS and Lustre mounts)
            print(f"{lock}: no file lock here ({e}); every process builds the cache", file=sys.stderr)
            locked = False
        try:
            yield
        finally:
            if locked:  # the tokenization workers inherited the descriptor: release the lock itself
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)


class CachedRows:
    """The rows of a built cache, memory-mapped through pyarrow: what training reads.

    The cache is written by `datasets` (`save_to_disk`: Arrow stream files listed in state.json);
    reading it needs only pyarrow, so a cached rerun and every rank but the builder skip importing
    `datasets`, an import every start would pay for. Pages are read from disk as rows are fetched.

        rows = CachedRows(folder)
        len(rows); rows.column("length"); rows[[3, 17]]  # -> {"id": [...], "input_ids": [...], ...}
    """

    def __init__(self, folder: str | Path):
        import pyarrow as pa

        folder = Path(folder)
        files = [folder / f["filename"] for f in json.loads((folder / "state.json").read_text())["_data_files"]]
        self.batches = [b for f in files for b in pa.ipc.open_stream(pa.memory_map(str(f)))]
        self.table = pa.Table.from_batches(self.batches)
        # first row of each record batch: a row is found by bisection and sliced out of its batch
        # (Table.take would concatenate every chunk of every column first: a copy of the dataset)
        self.starts = [0, *itertools.accumulate(b.num_rows for b in self.batches[:-1])]

    def __len__(self) -> int:
        return self.table.num_rows

    def column(self, name: str) -> list[Any]:
        """One column as a Python list, converted by Arrow in one call (not row by row)."""
        return self.table.column(name).to_pylist()

    def __getitem__(self, key: str | int | Sequence[int]) -> Any:
        """A column by name, one row as a dict, or several rows as a dict of columns."""
        if isinstance(key, str):
            return self.column(key)
        if isinstance(key, int):
            return self.row(key)
        rows = [self.row(i) for i in key]
        return {name: [r[name] for r in rows] for name in self.table.column_names}

    def row(self, i: int) -> dict[str, Any]:
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        b = bisect.bisect_right(self.starts, i) - 1
        return self.batches[b].slice(i - self.starts[b], 1).to_pylist()[0]


def _build(path: str | Path, kind: Kind, processor: Any, settings: dict[str, Any], folder: Path, num_proc: int) -> None:
    """Tokenize every row of `path` into the cache `folder`: the kept rows (`data/`) and their
    counts (`stats.json`). The build goes to a temporary folder renamed into place, so a reader
    or a concurrent builder never sees half a cache."""
    tmp = folder.with_name(f"{folder.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        allow_images = hasattr(processor, "image_processor")
        check_file(path, kind, allow_images)  # every problem of the file, before any work
        mapped, n_rows = _tokenize_file(path, kind, processor, settings, folder, tmp, num_proc)
        errors = [e for e in mapped["error"] if e]
        if errors:
            raise DataError(errors)
        drops = [d for d in mapped["drop"] if d]
        kept = mapped.filter(lambda d: d is None, input_columns="drop", desc="keeping rows that fit")
        kept = kept.remove_columns(["drop", "error"])
        stats = {
            "examples": n_rows,
            "kept": len(kept),
            "dropped_examples": len(drops),
            "dropped_prompt_too_long": drops.count("prompt_too_long"),
            "dropped_error_step_truncated": drops.count("error_step_truncated"),
            "dropped_steps": int(sum(kept["dropped_steps"])) if kind == "prm" else 0,
            "settings": settings,
        }
        # One process: save_to_disk's worker processes cost far more than they save (docs/scaling.md).
        # Reading the mapped rows pages them into this process; the kernel can reclaim those pages.
        kept.save_to_disk(str(tmp / "data"))
        shutil.rmtree(tmp / "raw", ignore_errors=True)
        shutil.rmtree(tmp / "map", ignore_errors=True)
        (tmp / "stats.json").write_text(json.dumps(stats, indent=2))
        try:
            os.rename(tmp, folder)
        except OSError:  # another builder finished first: theirs is the same
            if not (folder / "stats.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _tokenize_file(
    path: str | Path, kind: Kind, processor: Any, settings: dict[str, Any], folder: Path, tmp: Path, num_proc: int
) -> tuple[Any, int]:
    """(every row of `path` tokenized by `datasets.map`, number of rows): the rows keep their
    fields and gain input_ids, length, drop and error plus the kind's own columns. Arrow files go
    under `tmp`; the map is fingerprinted by the cache folder's name."""
    import datasets

    row_features = {
        "id": datasets.Value("string"),
        "line": datasets.Value("int64"),
        "question": datasets.Value("string"),
        "steps": datasets.List(datasets.Value("string")),
        "images": datasets.List(datasets.Value("string")),
        "labels": datasets.List(datasets.Value("float64")),
        "answer": datasets.Value("string"),
    }
    raw = datasets.Dataset.from_generator(
        iter_checked_rows,
        gen_kwargs={"path": str(path), "kind": kind},
        features=datasets.Features(row_features),
        cache_dir=str(tmp / "raw"),
    )
    n_rows = len(raw)
    num_proc = max(1, min(num_proc, n_rows // 64 or 1))  # a worker per few rows only costs start-up
    ids = datasets.List(datasets.Value("int32"))
    common = {
        "input_ids": ids,
        "length": datasets.Value("int32"),
        "drop": datasets.Value("string"),
        "error": datasets.Value("string"),
    }
    args = {k: v for k, v in settings.items() if k != "kind"}
    if kind == "prm":
        # Each worker gets its own copy: the prompts of the problems it has just seen.
        args["prompts"] = _BytesLRU(64 * 2**20)
        fn, extra = (
            _tokenize_prm_row,
            {
                "step_positions": ids,
                "n_steps": datasets.Value("int32"),
                "n_pos": datasets.Value("int32"),
                "dropped_steps": datasets.Value("int32"),
                "prompt_length": datasets.Value("int32"),
            },
        )
    else:
        fn, extra = _tokenize_sft_row, {"n_prompt": datasets.Value("int32"), "n_targets": datasets.Value("int32")}
    mapped = raw.map(
        fn,
        fn_kwargs={"processor": _blank_image_processor(processor), "source": str(path), **args},
        num_proc=num_proc if num_proc > 1 else None,
        features=datasets.Features({**row_features, **common, **extra}),
        cache_file_name=str(tmp / "map" / "rows.arrow"),
        new_fingerprint=folder.name,
        desc=f"tokenizing {Path(path).name}",
    )
    return mapped, n_rows


# ---------------------------------------------------------------- per-batch collators


class _Collator:
    """Shared part of the collators: fetch rows, open their images, check ids against the cache."""

    def __init__(self, data: Any, processor: Any, pad_id: int, source: str = ""):
        self.data, self.processor, self.pad_id, self.source = data, processor, pad_id, source

    def rows(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        if not indices:
            raise ValueError("empty batch: every process needs at least one row (see mmprm.training.run.epoch_batches)")
        cols = self.data[list(indices)]
        return [{k: cols[k][i] for k in cols} for i in range(len(indices))]

    def mismatch(self, row: dict[str, Any], what: str) -> DataError:
        return DataError(
            [
                f"{self.source}:{row['line']}: id={row['id']}: {what} differ from the tokenization cache: an "
                "image or the processor changed after the cache was built; delete the cache folder "
                "(data.cache_dir) and rerun"
            ]
        )


class PRMCollator(_Collator):
    """Cached PRM rows -> a training batch, tokenized by `tokenize_steps` with the real images.

    Returns (batch, items): `collate_steps` of the items, and the `TokenizedSteps` (with `.id`)
    for losses and error messages.

    Rows of one problem share their prompt and images (an MCTS tree exports many paths of one
    question), so the collator keeps the tokenized prompt with its image tensors in a
    least-recently-used cache of at most `prompt_cache_mb` megabytes and tokenizes only the steps
    of a row whose prompt it has seen (`extend_steps`, equal to `tokenize_steps` by test). The
    bound keeps memory flat at any dataset size; 0 turns the cache off.
    """

    def __init__(
        self,
        data: Any,
        processor: Any,
        pad_id: int,
        max_length: int,
        step_token: str = STEP_TOKEN,
        system: str | None = None,
        source: str = "",
        prompt_cache_mb: float = 256,
        layout: str = "mmprm",
        **_: Any,
    ):
        super().__init__(data, processor, pad_id, source)
        self.max_length, self.step_token, self.system = max_length, step_token, system
        self.fmt = train_step_format(layout, step_token)
        self.prompts = _BytesLRU(int(prompt_cache_mb * 2**20))  # (question, image paths) -> prompt

    def tokenize(self, row: dict[str, Any]) -> TokenizedSteps | None:
        key = _prompt_key(row)
        base = self.prompts.get(key)
        if base is not None:
            tok = extend_steps(
                self.processor, base, row["steps"], row["labels"], self.max_length, self.step_token, self.fmt
            )
            if tok is not None:
                return tok
        images = [load_image(p) for p in row["images"]]
        tok = tokenize_steps(
            self.processor,
            row["question"],
            row["steps"],
            images,
            row["labels"],
            self.max_length,
            self.step_token,
            self.system,
            self.fmt,
        )
        _remember_prompt(self.prompts, key, tok)
        return tok

    def items(self, indices: Sequence[int]) -> list[TokenizedSteps]:
        out = []
        for row in self.rows(indices):
            tok = self.tokenize(row)
            if tok is None or tok.input_ids != row["input_ids"]:
                raise self.mismatch(row, "token ids")
            if tok.step_positions != row["step_positions"]:
                raise self.mismatch(row, "step positions")
            tok.id = row["id"]
            out.append(tok)
        return out

    def __call__(self, indices: Sequence[int]) -> tuple[dict[str, torch.Tensor], list[TokenizedSteps]]:
        items = self.items(indices)
        return collate_steps(items, self.pad_id), items


def plan_tree_packs(data: Any, max_tokens: int, chunk: int = 1024) -> Any:
    """`mmprm.training.packing.plan_packs` over cached PRM rows: each problem's rows (same question and
    images) in packs of at most `max_tokens`, read a chunk of rows at a time."""
    from mmprm.training.packing import plan_packs

    columns = ["question", "images", "input_ids", "step_positions", "prompt_length"]

    def rows() -> Iterator[dict[str, Any]]:
        table = data.table.select(columns)
        for start in range(0, len(data), chunk):
            cols = table.slice(start, chunk).to_pydict()
            for i in range(len(cols["input_ids"])):
                yield {
                    "index": start + i,
                    "key": (cols["question"][i], tuple(cols["images"][i])),
                    "input_ids": cols["input_ids"][i],
                    "step_positions": cols["step_positions"][i],
                    "prompt_length": cols["prompt_length"][i],
                }

    return plan_packs(rows(), max_tokens)


class PackedPRMCollator:
    """Packs of cached PRM rows -> one tree-packed batch (`mmprm.training.packing`).

    `packs[i]` lists the row indices of pack i (`plan_tree_packs`); a batch is a list of pack
    indices. Rows are tokenized and checked by the `PRMCollator` `rows`, so the prompt cache and
    the cache checks are the same as for unpacked training. Returns (batch, the rows' items).
    """

    def __init__(self, rows: PRMCollator, packs: Sequence[Sequence[int]]):
        self.rows, self.packs = rows, packs

    def __call__(self, indices: Sequence[int]) -> tuple[dict[str, torch.Tensor], list[TokenizedSteps]]:
        from mmprm.training.packing import collate_packed, pack_rows

        trees, flat = [], []
        for i in indices:
            items = self.rows.items(self.packs[i])
            trees.append(pack_rows(items, [t.id for t in items]))
            flat.extend(items)
        return collate_packed(trees, self.rows.pad_id), flat


class SFTCollator(_Collator):
    """Cached SFT rows -> a batch (input_ids, attention_mask, labels, image tensors) via `tokenize_sft`."""

    def __init__(
        self,
        data: Any,
        processor: Any,
        pad_id: int,
        max_length: int,
        system: str | None = None,
        source: str = "",
        **_: Any,
    ):
        super().__init__(data, processor, pad_id, source)
        self.max_length, self.system = max_length, system

    def items(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        out = []
        for row in self.rows(indices):
            images = [load_image(p) for p in row["images"]]
            tok = tokenize_sft(
                self.processor,
                row["question"],
                row["steps"],
                row["answer"],
                images,
                self.max_length,
                self.system,
                n_prompt=row["n_prompt"],
            )
            if tok is None or tok["input_ids"] != row["input_ids"]:
                raise self.mismatch(row, "token ids")
            tok["id"] = row["id"]
            out.append(tok)
        return out

    def __call__(self, indices: Sequence[int]) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
        items = self.items(indices)
        return collate_sft(items, self.pad_id), items
