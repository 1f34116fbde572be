"""Append-only per-problem results that survive `kill -9`: one JSON line per finished problem.

Annotation tree files, Best-of-N scoring chunks and search results are all written this way. A row
is written and fsync'ed as soon as its problem is done; a killed run leaves at most one torn last
line, which readers drop (with a note) so the rerun redoes that problem. A shard that finished
writes `{name}.done` beside its file, so a report is only built from complete runs.

    done = resume(path)            # ids already written; a torn last line is cut off
    with open_append(path) as f:
        append_row(f, {"id": "p7", ...})

Resuming streams the file (memory: the ids) and truncates a torn tail in place, so a restart costs
one read of the file however large it has grown, never a rewrite. `scan` is the one reader under
all of it: what counts as torn, and what as damage, is decided there.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from mmprm.data.schema import DataError


def scan(path: str | Path, repair: bool = False) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """(byte offset, byte length, row) of each complete row of an append-only file, streamed.

    The last line is torn when it has no newline (the write never finished) or is not JSON: it is
    skipped with a note and, with `repair` (only a file's own writer repairs it), cut off in place
    so the next append starts clean. A bad line before the last is damage: DataError naming it.
    """
    path = Path(path)
    if not path.exists():
        return
    end = 0  # byte offset just past the last complete row
    torn = None
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            start = end
            if not raw.endswith(b"\n"):  # a kill mid-write: even whole JSON here may be half a row
                torn = lineno
                break
            if raw.strip():
                try:
                    row = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    if f.read().strip():
                        raise DataError(
                            [
                                f"{path}:{lineno}: id=?: line: not a JSON row: the file was edited or damaged "
                                "(delete that line to redo its problem, or the file to redo the shard)"
                            ]
                        ) from None
                    torn = lineno
                    break
                yield start, len(raw), row
            end = start + len(raw)
    if torn is not None and raw.strip():
        print(
            f"note: {path}:{torn}: dropping a torn last row (the run was killed); redoing that problem", file=sys.stderr
        )
    if repair and end < path.stat().st_size:
        os.truncate(path, end)


def shard_file(folder: str | Path, stem: str, index: int, count: int) -> Path:
    """`folder/{stem}.shard{index}-of-{count}.jsonl`."""
    return Path(folder) / f"{stem}.shard{index}-of-{count}.jsonl"


def iter_rows(path: str | Path, fields: Iterable[str] | None = None) -> Iterator[dict[str, Any]]:
    """Rows of an append-only file, one at a time (see `scan`); with `fields`, each row keeps only
    those keys."""
    keep = None if fields is None else tuple(fields)
    for _, _, row in scan(path):
        yield row if keep is None else {k: row[k] for k in keep if k in row}


def read_rows(path: str | Path, fields: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """All rows of an append-only file (see `iter_rows`)."""
    return list(iter_rows(path, fields))


def resume(path: str | Path) -> set[str]:
    """Ids of the rows a killed or finished run wrote, after cutting off a torn last line in place
    (see `scan`). Reads the file once, line by line: memory is the ids."""
    return {str(row["id"]) for _, _, row in scan(path, repair=True)}


def open_append(path: str | Path) -> IO[str]:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "a", encoding="utf-8")


def append_row(f: IO[str], row: dict[str, Any]) -> None:
    """Write one row and push it to disk before returning."""
    f.write(json.dumps(row, ensure_ascii=False) + "\n")
    f.flush()
    os.fsync(f.fileno())


def all_done(folder: str | Path, stem: str, count: int) -> bool:
    """Whether every shard of a `count`-shard run has finished (its `.done` marker is there)."""
    return all(shard_file(folder, stem, i, count).with_suffix(".done").exists() for i in range(count))


def merge_shards(
    folder: str | Path, stem: str, count: int, fields: Iterable[str] | None = None
) -> list[dict[str, Any]] | None:
    """All rows of a `count`-shard run in shard order (only `fields` of each, when given), or None
    while a shard is unfinished."""
    if not all_done(folder, stem, count):
        return None
    return list(iter_merged(folder, stem, count, fields))


def iter_merged(
    folder: str | Path, stem: str, count: int, fields: Iterable[str] | None = None
) -> Iterator[dict[str, Any]]:
    """The rows of every shard in shard order, one at a time (see `iter_rows`)."""
    for i in range(count):
        yield from iter_rows(shard_file(folder, stem, i, count), fields)


def check_same_run(run_file: str | Path, run: dict[str, Any], *outputs: str | Path, record: bool = True) -> None:
    """Refuse to resume or reuse `outputs` made with other settings (ConfigError naming what
    changed); record this run's settings in `run_file` (record=False: only compare, e.g. with the
    files of another shard of the run)."""
    from mmprm.config import ConfigError

    run_file = Path(run_file)
    if run_file.exists() and any(Path(o).exists() for o in outputs):
        before = json.loads(run_file.read_text())
        diff = {k: (before.get(k), v) for k, v in run.items() if before.get(k) != v}
        if diff:
            raise ConfigError(
                f"output_dir: {Path(outputs[0]).name} was made with other settings {diff} (was, now): "
                "use a new output_dir, or delete its files to redo it"
            )
    if record:
        run_file.parent.mkdir(parents=True, exist_ok=True)
        run_file.write_text(json.dumps(run, indent=2) + "\n")


def mark_done(path: str | Path) -> None:
    Path(path).with_suffix(".done").write_text("")


def ids_of(rows: Iterable[dict[str, Any]]) -> set[str]:
    return {str(r["id"]) for r in rows}
