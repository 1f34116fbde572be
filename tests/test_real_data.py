"""The repo's data/ subset: small, every file named with its source and license, and (when the
full sets are present) every line a byte-for-byte line of the full file, in order."""

from __future__ import annotations

import json
from pathlib import Path

from real_data import FULL, REPO_DATA, SHARED_DATA

NOT_DATA = {"README.md", "build_subset.py"}


def data_files() -> list[Path]:
    return sorted(
        p
        for p in REPO_DATA.rglob("*")
        # __pycache__: Python's own bytecode of build_subset.py, not data
        if p.is_file() and p.name not in NOT_DATA and "LICENSES" not in p.parts and "__pycache__" not in p.parts
    )


def test_subset_is_small_and_every_file_is_documented():
    files = data_files()
    assert len(files) > 20 and sum(p.stat().st_size for p in files) < 4_000_000  # a few MB at most
    readme = (REPO_DATA / "README.md").read_text(encoding="utf-8")
    for p in files:
        rel = p.relative_to(REPO_DATA).as_posix()
        named = rel if p.suffix != ".jpg" else "mathv/images/<id>.jpg"
        assert named in readme or p.name in readme, f"data/README.md does not name data/{rel}"
    for folder in {p.relative_to(REPO_DATA).parts[0] for p in files}:
        rows = [line for line in readme.splitlines() if line.startswith(f"| `{folder}/")]
        assert rows and all(line.rstrip(" |").rsplit("|", 1)[-1].strip() for line in rows), folder
        assert all("github:" in line and "@" in line for line in rows), f"{folder}: source as github:owner/repo@commit"
    # ReasonEval states no license: never carried
    assert not (REPO_DATA / "reasoneval").exists()
    assert {p.name for p in (REPO_DATA / "LICENSES").iterdir()} >= {"Apache-2.0.txt", "MIT-mathv.txt"}


def test_subset_lines_are_lines_of_the_full_sets():
    """Checked where the full sets are (a fresh clone has nothing to compare with)."""
    for p in data_files() if FULL else []:
        full = SHARED_DATA / p.relative_to(REPO_DATA)
        assert full.is_file(), f"data/{p.relative_to(REPO_DATA)} has no counterpart in {SHARED_DATA}"
        if p.suffix in (".jsonl",):
            ours, theirs = p.read_bytes().splitlines(keepends=True), iter(full.read_bytes().splitlines(keepends=True))
            assert ours and all(line in theirs for line in ours), f"data/{p.relative_to(REPO_DATA)}: not a line subset"
        elif p.parent.name == "olympiadbench":  # JSON lists: rows kept unchanged, in order
            ours, theirs = json.loads(p.read_text(encoding="utf-8")), iter(json.loads(full.read_text(encoding="utf-8")))
            assert ours and all(row in theirs for row in ours), f"data/{p.relative_to(REPO_DATA)}: not a row subset"
        else:
            assert p.read_bytes() == full.read_bytes(), f"data/{p.relative_to(REPO_DATA)} differs from {full}"
