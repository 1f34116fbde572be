"""The README and docs/ link to files that exist, and the README stays a short door into docs/.

Every relative markdown link `[text](path)` or `[text](path#anchor)` in README.md, CONTRIBUTING.md
and docs/**/*.md must name a file or folder of the repository; an anchor, where given, must be a
heading of the linked markdown file (GitHub's slugs). Links inside code blocks and to URLs are not
checked.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def pages() -> list[Path]:
    return [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").rglob("*.md"))]


def prose(path: Path) -> str:
    """The file without its fenced code blocks and inline code (links there are examples)."""
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[|\]\([^)]*\)", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M)}


def relative_links(path: Path) -> list[str]:
    targets = [m.group(1) for m in LINK.finditer(prose(path))]
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t, re.I)]  # http:, mailto:, ...


def test_the_pages_exist():
    for page in (REPO / "README.md", REPO / "CONTRIBUTING.md"):
        assert page.is_file(), f"{page.name} is missing"
    assert len(pages()) > 5, "docs/ holds no markdown pages"


def test_slug_follows_github():
    assert slug("Tested here, and not") == "tested-here-and-not"
    assert slug("Tree packing (`data.pack_trees=true`)") == "tree-packing-datapack_treestrue"
    assert slug("Memory for 7B / 8B models (per GPU)") == "memory-for-7b--8b-models-per-gpu"


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    broken = []
    for target in relative_links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif REPO not in dest.parents and dest != REPO:
            broken.append(f"{target}: outside the repository (a user's clone does not have it)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: {dest.relative_to(REPO)} has no heading #{anchor}")
    assert not broken, f"{page.relative_to(REPO)}: broken links\n" + "\n".join(broken)


def test_readme_is_short():
    lines = (REPO / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to a page under docs/ and link it"
    )


def _readme_demo_rows() -> dict[str, list[float]]:
    """The README's demo results table: row label -> its N=2, 4, 8 cells."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    table = text[text.index("| selection | N=2 | N=4 | N=8 |") :].split("\n\n")[0].splitlines()[2:]
    rows = {}
    for line in table:
        label, *cells = [c.strip() for c in line.strip("|").split("|")]
        rows[label] = [float(c.strip("*")) for c in cells]
    return rows


def test_readme_demo_table_is_the_published_report():
    """Every number of the README's demo table is the published report's (docs/demo/report.json),
    so a republished demo cannot leave the README behind."""
    import json

    report = json.loads((REPO / "docs" / "demo" / "report.json").read_text())
    base, bon = report["baselines"], report["bon"]
    ns = ["2", "4", "8"]
    rows = _readme_demo_rows()
    expected = {
        "single sample": base["random"],
        "majority vote": base["majority"],
        "PRM-weighted vote": base["weighted_vote"],
        "outcome model": bon["outcome"]["test"]["last"],
        "oracle": base["oracle"],
    }
    seen = set()
    for label, cells in rows.items():
        if m := re.match(r"PRM, (soft|hard) .*?`(\w+)`", label):
            model, aggregator = m.groups()
            source = bon[model]["test"][aggregator]
            assert ("chosen on dev" in label) == (aggregator == bon[model]["best_on_dev"]), label
        else:
            key = next(k for k in expected if label.startswith(k))
            source = expected[key]
            seen.add(key)
        assert cells == [round(source[n]["mean"], 3) for n in ns], label
    assert seen == set(expected)
    # the reward models the table shows are the ones the report has
    assert set(report["models"]) == {"soft", "outcome"} | ({"hard"} if any("hard" in r for r in rows) else set())
