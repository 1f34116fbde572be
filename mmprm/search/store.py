"""Append-only per-problem results that survive `kill -9`: one JSON line per finished problem.

A row is written and fsync'ed as soon as its problem is done; a killed run leaves at most one
torn last line, which `read_rows` drops (with a note) so the rerun redoes that problem. A shard
that finished writes `{name}.done` beside its file, so a report is only built from complete runs.

    done = {r["id"] for r in read_rows(path)}
    with open_append(path) as f:
        append_row(f, {"id": "p7", ...})
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any


def shard_file(folder: str | Path, stem: str, index: int, count: int) -> Path:
    """`folder/{stem}.shard{index}-of-{count}.jsonl`."""
    return Path(folder) / f"{stem}.shard{index}-of-{count}.jsonl"


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of an append-only file; a torn (unparsable) LAST line is dropped, any other bad line raises."""
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_bytes().split(b"\n")
    rows = []
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            rows.append(json.loads(raw))
        except (json.JSONDecodeError, UnicodeDecodeError):
            if any(x.strip() for x in lines[i + 1 :]):
                raise ValueError(
                    f"{path}:{i + 1}: not a JSON row (the file is damaged; delete it to redo the shard)"
                ) from None
            print(
                f"note: {path}:{i + 1}: dropping a torn last row (the run was killed); redoing that problem",
                file=sys.stderr,
            )
    return rows


def repair(path: str | Path) -> list[dict[str, Any]]:
    """`read_rows`, then rewrite the file without a torn last line so appends start clean."""
    rows = read_rows(path)
    path = Path(path)
    if path.exists():
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        os.replace(tmp, path)
    return rows


def open_append(path: str | Path) -> IO[str]:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "a", encoding="utf-8")


def append_row(f: IO[str], row: dict[str, Any]) -> None:
    """Write one row and push it to disk before returning."""
    f.write(json.dumps(row, ensure_ascii=False) + "\n")
    f.flush()
    os.fsync(f.fileno())


def merge_shards(folder: str | Path, stem: str, count: int) -> list[dict[str, Any]] | None:
    """All rows of a `count`-shard run in shard order, or None while a shard is unfinished."""
    files = [shard_file(folder, stem, i, count) for i in range(count)]
    if not all(f.with_suffix(".done").exists() for f in files):
        return None
    rows: list[dict[str, Any]] = []
    for f in files:
        rows += read_rows(f)
    return rows


def mark_done(path: str | Path) -> None:
    Path(path).with_suffix(".done").write_text("")


def ids_of(rows: Iterable[dict[str, Any]]) -> set[str]:
    return {str(r["id"]) for r in rows}
