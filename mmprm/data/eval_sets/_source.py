"""Where an answer benchmark's rows come from: a released file, a local dataset, or the Hub.

`load_rows` gives plain dicts whichever way the benchmark is given; `image_file` turns one image
value of a row (a path relative to the images' root, a decoded PIL image, or the `{bytes, path}`
dict a parquet file holds) into a file on disk. The Hub and `save_to_disk` folders go through
`datasets`, imported only then.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _read_json_file(path: Path) -> list[dict[str, Any]]:
    """Rows of a `.json` (a list, or a dict keyed by id as MathVista's) or `.jsonl` file."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        rows = []
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
        return rows
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from e
    if isinstance(data, dict):
        return list(data.values())
    if isinstance(data, list):
        return data
    raise ValueError(f"{path}: expected a JSON list of rows or an object of rows keyed by id")


def load_rows(
    source: str | Path, split: str, file_names: tuple[str, ...] = (), config: str | None = None
) -> tuple[list[dict[str, Any]], Path | None]:
    """The benchmark's rows and the folder their relative image paths start from (None: the Hub).

    Args:
        source: a released file (`.json`, `.jsonl`, `.parquet`); a folder holding one of
            `file_names`; a folder written by `Dataset.save_to_disk`; a local copy of a Hub dataset
            repository; or a Hub dataset id such as `AI4Math/MathVista`.
        split: the split to read from a dataset (`testmini`, `test`, `train`).
        file_names: the released file names to look for in a folder, first found wins.
        config: the Hub configuration (OlympiadBench's subsets), if any.
    """
    path = Path(source)
    if path.is_file():
        if path.suffix in (".json", ".jsonl"):
            return _read_json_file(path), path.parent
        if path.suffix == ".parquet":
            import datasets

            return list(datasets.load_dataset("parquet", data_files=str(path), split="train")), path.parent
        raise ValueError(f"{path}: unknown file type (give the benchmark's .json, .jsonl or .parquet file)")
    if path.is_dir():
        for name in file_names:
            if (path / name).is_file():
                return _read_json_file(path / name), path
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            import datasets

            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise ValueError(f"{path}: no split {split!r} (it has {sorted(ds)})")
                ds = ds[split]
            return list(ds), path
        # A local copy of a Hub dataset repository reads exactly as the Hub id would.
        return _hub_rows(str(path), split, config), path
    if "/" in str(source) and not str(source).startswith((".", "/", "~")):
        return _hub_rows(str(source), split, config), None
    wanted = " or ".join(file_names) or "the released file"
    raise FileNotFoundError(f"{source}: not found (give {wanted}, its folder, or a Hub dataset id)")


def _hub_rows(name: str, split: str, config: str | None) -> list[dict[str, Any]]:
    import datasets

    return list(datasets.load_dataset(name, config, split=split))


def image_file(value: Any, root: Path | None, image_dir: Path | None, stem: str) -> Path:
    """One image of a row as a file: a relative path under `root`, or written to `image_dir`.

    Args:
        value: a path string, a PIL image, or a `{"bytes": ..., "path": ...}` dict.
        root: the folder relative paths start from (None when the rows came from the Hub).
        image_dir: where in-memory images are written (as `<stem>.png`, or the original bytes).
        stem: the file name to write, without extension (unique per image).
    """
    if isinstance(value, (str, Path)):
        if root is None:
            raise ValueError(f"image {value!r} is a path but the rows came from the Hub; pass the images' folder")
        return (root / value).resolve()
    if image_dir is None:
        raise ValueError("the rows hold the images themselves; pass image_dir= (where to write them)")
    image_dir.mkdir(parents=True, exist_ok=True)
    if isinstance(value, dict) and value.get("bytes"):
        suffix = Path(value.get("path") or "x.png").suffix or ".png"
        out = image_dir / f"{stem}{suffix}"
        out.write_bytes(value["bytes"])
        return out.resolve()
    if hasattr(value, "save"):  # a PIL image: datasets' Image feature, decoded
        out = image_dir / f"{stem}.png"
        value.save(out)
        return out.resolve()
    raise ValueError(f"image of {stem}: unsupported value {type(value).__name__} (a path, a PIL image or bytes)")


def check_exists(image: Path, where: str, hint: str) -> Path:
    """`image`, or FileNotFoundError naming the row and what to copy where."""
    if not image.is_file():
        raise FileNotFoundError(f"{where}: image: {image} not found ({hint})")
    return image


def require_fields(row: dict[str, Any], fields: tuple[str, ...], source: Any, n: int, id_field: str) -> None:
    """A ValueError naming the source, the row and each of `fields` it lacks (or holds null in),
    instead of a KeyError from deep in a reader: the benchmark's released rows all carry them."""
    missing = [f for f in fields if row.get(f) is None]
    if missing:
        rid = row.get(id_field)
        raise ValueError(
            f"{source}: row {n} ({id_field}={rid}): {', '.join(missing)}: missing (the benchmark's released "
            "rows carry it; use the file as released)"
        )
