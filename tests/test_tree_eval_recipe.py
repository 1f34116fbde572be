"""recipes/tree_eval.py end to end: RPTS-Eval gold reasoning, Think360 blocks, steps, MC trees."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from real_data import DATA

from mmprm.data.schema import DataError

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "tree_eval.py"
CONFIG = REPO / "recipes" / "configs" / "tiny" / "tree_eval.yaml"
RPTS_EN = DATA / "rpts_eval" / "texts_en.json"
OPENR_TREES = DATA / "openr_samples" / "samples_math-aps-tree.jsonl"


def recipe():
    spec = importlib.util.spec_from_file_location("tree_eval_recipe", RECIPE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def run(out: Path, *overrides: str) -> dict:
    rc = recipe().main(["--config", str(CONFIG), f"output.dir={out}", f"data.path={RPTS_EN}", *overrides])
    assert rc == 0
    return json.loads((out / "report.json").read_text())


def test_shipped_config_parses():
    mod = recipe()
    from mmprm.config import load_config

    cfg = load_config(mod.TreeEvalConfig, CONFIG)
    assert cfg.data.format == "rpts" and cfg.scorer.kind == "constant"


def test_cli_on_rpts_eval_gold_with_constant_scores(tmp_path):
    # the real entry point, as a user launches it
    proc = subprocess.run(
        [sys.executable, str(RECIPE), "--config", str(CONFIG), f"output.dir={tmp_path}", f"data.path={RPTS_EN}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "416 items" in proc.stdout and "6 tolerated data quirks" in proc.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    s = report["summary"]
    assert s["items"] == 416 and s["data_warnings"] == 6
    assert s["rpts"] == 1.0 and s["width"] == 1.0 and s["depth"] == 1.0
    assert s["accuracy"] == 1.0 and s["filtered_accuracy"] == 1.0  # gold reasoning reaches the gold answer
    item = next(r for r in report["items"] if r["id"] == "155")
    assert "not an earlier step" in item["warnings"][0]
    png = tmp_path / "tree_0.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    trees = [json.loads(line) for line in (tmp_path / "trees.jsonl").read_text().splitlines()]
    assert len(trees) == 416 and all(n["score"] == 1.0 for n in trees[0]["nodes"] if n["kind"] == "conclusion")


def test_shipped_config_runs_on_data_in_the_repository(tmp_path):
    """A fresh clone (no ../shared) runs the tiny config as written: its input is under data/."""
    cfg_path = recipe().TreeEvalConfig().data.path
    assert (REPO / cfg_path).is_file(), f"{cfg_path} is not in the repository (see data/README.md)"
    proc = subprocess.run(
        [sys.executable, str(RECIPE), "--config", str(CONFIG), f"output.dir={tmp_path}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "416 items from data/rpts_eval/texts_en.json" in proc.stdout
    assert json.loads((tmp_path / "report.json").read_text())["summary"]["items"] == 416
    assert (tmp_path / "tree_0.png").exists()  # no plot_item set: the first item is drawn


def test_shipped_config_takes_steps_without_naming_a_plot_item(tmp_path):
    """The tiny YAML names no RPTS-only item, so any input format runs with it as shipped."""
    steps = tmp_path / "steps.jsonl"
    steps.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "question": "Q", "steps": ["a.", "b."], "meta": {"correct": i == 0}}) + "\n"
            for i in range(2)
        )
    )
    report = run(tmp_path / "out", f"data.path={steps}", "data.format=steps")
    assert [r["id"] for r in report["items"]] == ["p0", "p1"] and report["summary"]["accuracy"] == 0.5
    assert (tmp_path / "out" / "tree_p0.png").exists()
    with pytest.raises(SystemExit, match="output.plot_item: no item with id '7' .*first ids: p0, p1.*plot_item=null"):
        run(tmp_path / "out2", f"data.path={steps}", "data.format=steps", "output.plot_item=7")


def test_low_constant_fails_nodes_and_filter(tmp_path):
    s = run(tmp_path, "scorer.constant=0.4", "data.limit=20", "output.plot_item=null")["summary"]
    assert s["items"] == 20
    assert s["rpts"] == pytest.approx(0.4) and s["width"] == 0.0 and s["depth"] == 0.0
    assert s["width_soft"] == pytest.approx(0.4) and s["depth_soft"] == pytest.approx(0.4)
    assert s["accuracy"] == 1.0 and s["filtered_accuracy"] == 0.0  # right answers, RPTS below 0.5
    assert (tmp_path / "tree_0.png").exists()


def test_think360_and_steps_inputs(tmp_path):
    rows = [
        {
            "id": "a",
            "question": "Q1",
            "correct": True,
            "response": "[NODE:1.1] [PARENT:None] [ORIGINAL:x] [TYPE:observation]\n"
            "[NODE:2.1] [PARENT:1.1] [ORIGINAL:y]\n[NODE:2.2] [PARENT:1.1] [ORIGINAL:z]",
        },
        {"id": "b", "question": "Q2", "correct": False, "response": "[NODE:1.1]\n[PARENT:None]\n[ORIGINAL:w]"},
    ]
    path = tmp_path / "t360.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = run(
        tmp_path / "out", f"data.path={path}", "data.format=think360", "scorer.constant=0.8", "output.plot_item=a"
    )
    items = {r["id"]: r for r in report["items"]}
    assert items["a"]["width"] == 1.0 and items["b"]["width"] is None and items["b"]["depth"] == 1.0
    assert report["summary"]["accuracy"] == 0.5 and report["summary"]["filtered_accuracy"] == 0.5
    assert (tmp_path / "out" / "tree_a.png").exists()

    steps = tmp_path / "steps.jsonl"
    steps.write_text(
        json.dumps({"id": "s1", "question": "1+1?", "steps": ["1+1=2.", "So 2."], "meta": {"correct": True}}) + "\n"
    )
    report = run(tmp_path / "out2", f"data.path={steps}", "data.format=steps", "output.plot_item=s1")
    assert report["items"][0]["nodes"] == 2 and report["summary"]["rpts"] == 1.0
    with pytest.raises(SystemExit, match="no item with id 'zz'"):
        run(tmp_path / "out3", f"data.path={steps}", "data.format=steps", "output.plot_item=zz")


def test_mc_trees_with_mc_scorer(tmp_path):
    report = run(tmp_path, f"data.path={OPENR_TREES}", "data.format=mc_tree", "scorer.kind=mc", "output.plot_item=null")
    assert [r["nodes"] for r in report["items"]] == [142, 89, 23]
    assert all(0.0 < r["rpts"] < 1.0 for r in report["items"])
    assert report["summary"]["items_with_answer_check"] == 0 and report["summary"]["filtered_accuracy"] is None


def test_bad_rows_are_named_and_reading_stops_at_the_limit(tmp_path):
    """A text verdict ("false") is refused, not read as true; a malformed tree names its file, line
    and id; the real line number is given past blank lines; rows past data.limit are never read."""
    block = "[NODE:1.1] [PARENT:None] [ORIGINAL:x]"
    t360 = tmp_path / "t360.jsonl"
    rows = [{"id": "a", "response": block, "correct": False}, {"id": "b", "response": block, "correct": "false"}]
    t360.write_text(json.dumps(rows[0]) + "\n\n\n" + json.dumps(rows[1]) + "\n")
    args = [f"data.path={t360}", "data.format=think360", "output.plot_item=null"]
    with pytest.raises(DataError, match=rf"{t360}:4: id=b: correct: 'false' is not true or false"):
        run(tmp_path / "o1", *args)
    report = run(tmp_path / "o2", *args, "data.limit=1")  # row b is past the limit: never read
    assert report["summary"]["items"] == 1 and report["summary"]["accuracy"] == 0.0

    trees = tmp_path / "trees.jsonl"
    first = OPENR_TREES.read_text().splitlines()[0]
    broken = json.loads(first)
    broken["id"] = "broken"
    del broken["reasoning_steps"]["children"][0]["mc_value"]
    trees.write_text(first + "\n" + json.dumps(broken) + "\n")
    args = [f"data.path={trees}", "data.format=mc_tree", "scorer.kind=mc", "output.plot_item=null"]
    with pytest.raises(DataError, match=rf"{trees}:2: id=broken: "):
        run(tmp_path / "o3", *args)
    assert run(tmp_path / "o4", *args, "data.limit=1")["summary"]["items"] == 1

    array = tmp_path / "rpts.json"
    array.write_text(json.dumps([json.loads(RPTS_EN.read_text())[0], "oops"]))
    with pytest.raises(DataError, match=rf"{array}: item 1: a JSON str, where an object is expected"):
        run(tmp_path / "o5", f"data.path={array}")
    array.write_text(RPTS_EN.read_text()[:-100])
    proc = subprocess.run(
        [sys.executable, str(RECIPE), "--config", str(CONFIG), f"output.dir={tmp_path / 'o6'}", f"data.path={array}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"{array}: not a JSON array of items" in proc.stderr


def test_bad_config_is_reported(tmp_path, capsys):
    assert recipe().main(["--config", str(CONFIG), "scorer.kind=prm", f"output.dir={tmp_path}"]) == 2
    assert "prm.path" in capsys.readouterr().err
    assert recipe().main(["--config", str(CONFIG), "scorer.kind=mc", f"output.dir={tmp_path}"]) == 2


@pytest.mark.slow
def test_recipe_with_tiny_prm(tmp_path):
    pytest.importorskip("mmprm.models.prm")
    from mmprm.models.loading import load_backbone
    from mmprm.models.prm import PRMSpec, build_prm, save_prm
    from mmprm.models.tiny import build_tiny_model

    backbone, processor = load_backbone(build_tiny_model("qwen2", tmp_path / "backbone"))
    save_prm(build_prm(backbone, processor, PRMSpec()), processor, tmp_path / "prm")
    report = run(tmp_path / "out", "scorer.kind=prm", f"prm.path={tmp_path / 'prm'}", "data.limit=6")
    s = report["summary"]
    assert s["items"] == 6 and 0.0 < s["rpts"] < 1.0 and 0.0 <= s["width_soft"] <= 1.0
    assert (tmp_path / "out" / "tree_0.png").exists()
    # the scores were saved per tree: a rerun over more trees scores only the new ones
    cache = tmp_path / "out" / "score_cache.jsonl"
    saved = len(cache.read_text().splitlines())
    more = run(tmp_path / "out", "scorer.kind=prm", f"prm.path={tmp_path / 'prm'}", "data.limit=8")
    assert more["items"][:6] == report["items"] and len(more["items"]) == 8
    assert len(cache.read_text().splitlines()) > saved
