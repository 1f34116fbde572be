"""docs/extending.md as it is written: each section's `python` blocks run here, in order, through
the public registries (a toy reader of every kind the page shows, a toy aggregator, loss and search
method, a tiny backbone), and Best-of-N runs `recipes/bon_rerank.py` with the toy reader and
aggregator."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
from recipe_runs import REPO

PAGE = REPO / "docs" / "extending.md"


def sections() -> dict[str, list[str]]:
    """Section title ("" before the first) -> its python blocks, in page order."""
    out: dict[str, list[str]] = {"": []}
    title = ""
    for part in re.split(r"(?m)^(#{2,3} .*)$", PAGE.read_text(encoding="utf-8")):
        if re.match(r"#{2,3} ", part):
            title = part.lstrip("#").strip()
            out.setdefault(title, [])
        else:
            out[title] += re.findall(r"```python\n(.*?)```", part, re.S)
    return out


@pytest.fixture
def page(tmp_path, monkeypatch):
    """run(*titles): the page's preamble and those sections' blocks, run in one namespace (OUT: a
    scratch folder) from the repository root; what they register is unregistered afterwards."""
    from mmprm.data import registry
    from mmprm.data.eval_sets import RULES
    from mmprm.scoring.aggregators import AGGREGATORS, MM_PRM_AGGREGATORS
    from mmprm.search.core import SEARCH_METHODS

    tables = [AGGREGATORS, MM_PRM_AGGREGATORS, SEARCH_METHODS, RULES, *registry._READERS.values()]
    before = [dict(t) for t in tables]
    monkeypatch.chdir(REPO)
    namespace: dict = {"OUT": str(tmp_path)}
    blocks = sections()

    def run(*titles: str, **names) -> dict:
        namespace.update(names)
        for title in ("", *titles):
            for i, code in enumerate(blocks[title]):
                exec(compile(code, f"{PAGE.name}: {title or 'preamble'} block {i}", "exec"), namespace)
        return namespace

    yield run
    for table, saved in zip(tables, before):
        table.clear()
        table.update(saved)


def test_every_example_of_the_page_is_run_by_a_test():
    ran = {"", "An answer benchmark", "A step benchmark", "An aggregator", "A loss", "A search method", "A backbone"}
    ran |= {"Best-of-N with your own reader and aggregator"}
    with_code = {title for title, blocks in sections().items() if blocks}
    assert with_code == ran, f"sections with examples that no test runs: {sorted(with_code - ran)}"


def test_benchmark_readers_aggregator_loss_and_search_method(page):
    from mmprm.data.readers import get_reader, reader_names
    from mmprm.scoring import AGGREGATORS
    from mmprm.search import SEARCH_METHODS

    ns = page("An answer benchmark", "A step benchmark", "An aggregator", "A loss", "A search method")
    assert get_reader("answer_benchmark", "toy_quiz") is ns["read_toy_quiz"]
    assert "toy_steps" in reader_names("step_benchmark") and AGGREGATORS["geo_mean"] is ns["geo_mean"]
    assert SEARCH_METHODS["greedy"] is ns["Greedy"] and ns["tree"].nodes[ns["tree"].chosen].depth == 3
    with pytest.raises(ValueError, match="aggregator 'geo_mean': already registered"):
        ns["register_aggregator"]("geo_mean", max)
    with pytest.raises(ValueError, match="search method 'beam': already registered"):
        ns["register_search"]("beam", ns["Greedy"])


def test_a_tiny_backbone_builds_a_prm(page):
    ns = page("A backbone")
    assert ns["prm"] is not None and (Path(ns["OUT"]) / "tiny_qwen2" / "config.json").is_file()


@pytest.fixture(scope="module")
def prm_dir(tiny_models, tmp_path_factory) -> Path:
    """A random-init multimodal PRM (tiny Qwen2-VL, token_pair head) saved as prm_train saves one."""
    from mmprm.models.loading import load_backbone
    from mmprm.models.prm import PRMSpec, build_prm, save_prm

    backbone, processor = load_backbone(tiny_models("qwen2_vl"))
    return save_prm(build_prm(backbone, processor, PRMSpec()), processor, tmp_path_factory.mktemp("prm") / "prm")


@pytest.mark.slow
def test_bon_rerank_with_the_toy_reader_and_aggregator(page, prm_dir):
    """The toy reader's candidates are what bon_rerank scores, and the toy aggregator's accuracy at
    N = n_max (one subset: all candidates) is its pick, recomputed here from the scored file."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ns = page("An answer benchmark", "An aggregator", "Best-of-N with your own reader and aggregator", PRM=prm_dir)
    finally:
        torch.set_num_threads(threads)
    out = Path(ns["OUT"]) / "bon"
    written = [json.loads(line) for line in (out / "candidates.toy_bon.jsonl").read_text().splitlines()]
    assert [p["id"] for p in written] == ["q0", "q1", "q2"]
    assert [[c["correct"] for c in p["candidates"]] for p in written] == [[True, False]] * 3
    scored = [json.loads(line) for line in (out / "scored.jsonl").read_text().splitlines()]
    picks = []
    for p in scored:
        scores = [ns["geo_mean"](c["step_probs"]) for c in p["candidates"]]
        picks.append(p["candidates"][scores.index(max(scores))]["correct"])
    report = ns["report"]
    n_max = str(report["n_max"])
    assert math.isclose(report["methods"]["geo_mean"][n_max]["mean"], sum(picks) / len(picks))
    assert os.path.samefile(Path.cwd(), REPO)
