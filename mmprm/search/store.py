"""Append-only per-problem results that survive `kill -9`: one JSON line per finished problem.

A row is written and fsync'ed as soon as its problem is done; a killed run leaves at most one
torn last line, which `read_rows` drops (with a note) so the rerun redoes that problem. A shard
that finished writes `{name}.done` beside its file, so a report is only built from complete runs.

    done = resume(path)            # ids already written; a torn last line is cut off
    with open_append(path) as f:
        append_row(f, {"id": "p7", ...})

Resuming streams the file (memory: the ids) and truncates a torn tail in place, so a restart costs
one read of the file however large it has grown, never a rewrite.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any


def shard_file(folder: str | Path, stem: str, index: int, count: int) -> Path:
    """`folder/{stem}.shard{index}-of-{count}.jsonl`."""
    return Path(folder) / f"{stem}.shard{index}-of-{count}.jsonl"


def iter_rows(path: str | Path, fields: Iterable[str] | None = None) -> Iterator[dict[str, Any]]:
    """Rows of an append-only file, one at a time; a torn (unparsable) LAST line is skipped with a
    note, any other bad line raises. With `fields`, each row keeps only those keys."""
    path = Path(path)
    if not path.exists():
        return
    keep = None if fields is None else tuple(fields)
    bad: int | None = None
    with open(path, "rb") as f:
        for i, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            if bad is not None:
                raise ValueError(f"{path}:{bad}: not a JSON row (the file is damaged; delete it to redo the shard)")
            try:
                row = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                bad = i
                continue
            yield row if keep is None else {k: row[k] for k in keep if k in row}
    if bad is not None:
        print(
            f"note: {path}:{bad}: dropping a torn last row (the run was killed); redoing that problem", file=sys.stderr
        )


def read_rows(path: str | Path, fields: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """All rows of an append-only file (see `iter_rows`)."""
    return list(iter_rows(path, fields))


def resume(path: str | Path) -> set[str]:
    """Ids of the rows a killed or finished run wrote, after cutting off a torn last line in place.

    Reads the file once, line by line (memory: the ids), and truncates after the last complete
    row, so appends start clean. A bad line before the last raises (see `iter_rows`).
    """
    path = Path(path)
    if not path.exists():
        return set()
    ids: set[str] = set()
    end = 0  # byte offset just past the last complete row
    with open(path, "rb") as f:
        for i, raw in enumerate(f, start=1):
            if raw.strip():
                try:
                    row = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    rest = f.read()
                    if rest.strip():
                        raise ValueError(
                            f"{path}:{i}: not a JSON row (the file is damaged; delete it to redo the shard)"
                        ) from None
                    print(
                        f"note: {path}:{i}: dropping a torn last row (the run was killed); redoing that problem",
                        file=sys.stderr,
                    )
                    break
                if not raw.endswith(b"\n"):  # complete JSON but no newline: the next append would join it
                    break
                ids.add(str(row["id"]))
            end = f.tell()
    if end < path.stat().st_size:
        os.truncate(path, end)
    return ids


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


def mark_done(path: str | Path) -> None:
    Path(path).with_suffix(".done").write_text("")


def ids_of(rows: Iterable[dict[str, Any]]) -> set[str]:
    return {str(r["id"]) for r in rows}
