"""ProcessBench and VisualProcessBench in prm_eval: readers, and the same numbers as each benchmark's
own evaluation procedure on the same predictions.

The references below re-express, independently of mmprm, what the benchmarks' evaluation code
computes from the released rows:

* ProcessBench (github:QwenLM/ProcessBench@e8024636bcabdf8bd514440551b531d3f90dd18b:
  code/run_eval.py and code/run_eval_prm_rlhflow.py): per subset, a PRM's prediction is the first
  step whose score is below the threshold, else -1 (None when it got none: a miss);
  `match = prediction == label`; accuracy on erroneous samples (label != -1) and on correct ones
  (label == -1), `np.mean(...) * 100`, and F1 = 2 * acc1 * acc2 / (acc1 + acc2) in numpy (NaN when
  both are 0). The number the paper reports is the mean of the four subsets' F1.
* VisualProcessBench (VisualPRM, arXiv:2503.10291, Sec. 3.3 "Metrics"; the dataset card's
  `process_correctness` 1 / 0 / -1): per `data_source`, neutral (0) steps are left out, a step is
  predicted correct (1) when its score >= threshold, else incorrect (-1); F1 of the correct class
  and of the incorrect class, each 2TP / (2TP + FP + FN), and the reported macro F1 is their mean.

The ProcessBench fixtures are real rows (6 per subset, from the authors' own commit of the data);
the VisualProcessBench ones are built in its released schema (no copy is reachable offline);
tests/fixtures/step_benchmarks/README.md says which is which. When the full sets sit in
../shared/data (processbench/, visualprocessbench/), the same checks run on them.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from real_data import SHARED_DATA

from mmprm.data.benchmarks import read_processbench, read_visualprocessbench
from mmprm.data.schema import DataError
from mmprm.scoring import metrics as M

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "prm_eval.py"
CONFIG = REPO / "recipes" / "configs" / "tiny" / "prm_eval.yaml"
FIXTURES = REPO / "tests" / "fixtures" / "step_benchmarks"
PB_DIR = SHARED_DATA / "processbench" if (SHARED_DATA / "processbench").is_dir() else FIXTURES / "processbench"
VPB_FILE = (
    SHARED_DATA / "visualprocessbench" / "test.jsonl"
    if (SHARED_DATA / "visualprocessbench" / "test.jsonl").is_file()
    else FIXTURES / "visualprocessbench" / "test.jsonl"
)
SUBSETS = ("gsm8k", "math", "olympiadbench", "omnimath")


def recipe():
    spec = importlib.util.spec_from_file_location("prm_eval_recipe_steps", RECIPE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


# ---- the benchmarks' own procedures, on released rows (no mmprm code below this line until the tests)


def processbench_prediction(scores: list[float], threshold: float) -> int | None:
    """The first step scored below the threshold, else -1; None (no prediction) when the steps cut
    by truncation (NaN) come before any step below it."""
    for i, s in enumerate(scores):
        if math.isnan(s):
            return None
        if s < threshold:
            return i
    return -1


def processbench_reference(rows: list[dict], scores: dict[str, list[float]], threshold: float) -> dict[str, tuple]:
    """subset -> (error acc, correct acc, F1), in percent, as ProcessBench's run_eval prints them: an
    example without a prediction (`pred = None`) is a miss in its class, and F1 is numpy's
    2 * acc1 * acc2 / (acc1 + acc2), NaN when both are 0."""
    out = {}
    for subset in SUBSETS:
        res = []
        for d in (r for r in rows if r["id"].rsplit("-", 1)[0] == subset and r["id"] in scores):
            pred = processbench_prediction(scores[d["id"]], threshold)
            res.append({"label": d["label"], "match": pred == d["label"]})
        err = [e["match"] for e in res if e["label"] != -1]
        cor = [e["match"] for e in res if e["label"] == -1]
        if err and cor:
            acc1, acc2 = np.mean(err) * 100, np.mean(cor) * 100
            with np.errstate(invalid="ignore"):
                out[subset] = (float(acc1), float(acc2), float(2 * acc1 * acc2 / (acc1 + acc2)))
    return out


def vpb_reference(rows: list[tuple[str, dict]], scores: dict[str, list[float]], threshold: float) -> dict:
    """source (and "overall", all steps pooled) -> (F1 correct, F1 incorrect, macro F1)."""
    pairs: dict[str, list[tuple[int, int]]] = {}
    for rid, r in rows:
        if rid not in scores:
            continue
        for y, s in zip(r["response"]["process_correctness"], scores[rid]):
            if y != 0:
                p = 1 if s >= threshold else -1
                pairs.setdefault(r["data_source"], []).append((y, p))
                pairs.setdefault("overall", []).append((y, p))

    def f1(ps: list[tuple[int, int]], c: int) -> float:
        tp = sum(y == c and p == c for y, p in ps)
        fp = sum(y != c and p == c for y, p in ps)
        fn = sum(y == c and p != c for y, p in ps)
        return 2 * tp / (2 * tp + fp + fn)

    return {k: (f1(ps, 1), f1(ps, -1), (f1(ps, 1) + f1(ps, -1)) / 2) for k, ps in pairs.items()}


def released_processbench() -> list[dict]:
    return [
        r for s in SUBSETS if (PB_DIR / f"{s}.json").is_file() for r in json.loads((PB_DIR / f"{s}.json").read_text())
    ]


def released_vpb() -> list[tuple[str, dict]]:
    lines = VPB_FILE.read_text(encoding="utf-8").splitlines()
    return [(f"vpb-{n}", json.loads(line)) for n, line in enumerate(lines, 1) if line.strip()]


# ---- readers


def test_processbench_reader_folder_file_and_jsonl(tmp_path):
    rows = read_processbench(PB_DIR)
    released = released_processbench()
    assert [r["id"] for r in rows] == [r["id"] for r in released]
    assert {r["meta"]["category"] for r in rows} == set(SUBSETS)
    for r, d in zip(rows, released):
        first = None if d["label"] == -1 else d["label"]
        assert r["meta"]["first_error"] == first == M.first_error(r["labels"])
        # once a step is wrong the solution stays wrong
        assert r["labels"] == [1.0 if first is None or i < first else 0.0 for i in range(len(d["steps"]))]
        assert r["question"] == d["problem"] and r["steps"] == d["steps"] and r["images"] == []
    one = read_processbench(PB_DIR / "gsm8k.json")
    assert [r["id"] for r in one] == [r["id"] for r in rows if r["meta"]["category"] == "gsm8k"]
    # JSON Lines, as datasets' to_json writes a split, reads the same
    jsonl = tmp_path / "gsm8k.jsonl"
    jsonl.write_text("".join(json.dumps(d) + "\n" for d in released if d["id"].startswith("gsm8k-")))
    assert read_processbench(jsonl) == one
    # a byte order mark in front (as some editors save) reads as the released array
    bom = tmp_path / "bom" / "gsm8k.json"
    bom.parent.mkdir()
    bom.write_bytes(b"\xef\xbb\xbf" + (PB_DIR / "gsm8k.json").read_bytes())
    assert [r["id"] for r in read_processbench(bom)] == [r["id"] for r in one]


def test_processbench_fixtures_are_released_rows():
    """The shipped rows are ProcessBench's: gsm8k-0 as its README prints it, every first-error case."""
    rows = [r for s in SUBSETS for r in json.loads((FIXTURES / "processbench" / f"{s}.json").read_text("utf-8"))]
    first = rows[0]
    assert (first["id"], first["generator"], first["final_answer_correct"], first["label"]) == (
        "gsm8k-0",
        "Qwen2-7B-Instruct",
        False,
        1,
    )
    assert first["problem"].startswith("Sue lives in a fun neighborhood.")
    assert first["steps"][0].startswith("To find out how many more pink plastic flamingos were out than")
    for subset in SUBSETS:
        labels = [r["label"] for r in rows if r["id"].startswith(f"{subset}-")]
        assert labels.count(-1) == 3 and {0, 1} <= set(labels) and max(labels) >= 2, subset
    # a correct process always reaches a correct answer; a wrong one sometimes does too
    assert all(r["final_answer_correct"] for r in rows if r["label"] == -1)
    assert any(r["final_answer_correct"] for r in rows if r["label"] != -1)
    assert {r["id"] for r in rows} == {r["id"] for r in read_processbench(FIXTURES / "processbench")}


def test_processbench_reader_names_bad_rows(tmp_path):
    bad = tmp_path / "math.json"
    good = {"id": "math-0", "generator": "g", "problem": "p", "steps": ["a", "b"], "final_answer_correct": True}
    bad.write_text(json.dumps([{**good, "label": 2}, {**good, "id": "math-1", "steps": [], "label": -1}, 3]))
    with pytest.raises(DataError) as e:
        read_processbench(bad)
    msg = str(e.value)
    assert f"{bad}:1: id=math-0: label: missing or malformed (must be the 0-based first wrong step in 0..1" in msg
    assert f"{bad}:2: id=math-1: steps" in msg and f"{bad}:3: id=?: row: not a JSON object" in msg
    with pytest.raises(DataError, match="no ProcessBench subset file"):
        read_processbench(tmp_path / "..")


def test_visualprocessbench_reader(tmp_path):
    rows = read_visualprocessbench(VPB_FILE)
    released = released_vpb()
    assert [r["id"] for r in rows] == [rid for rid, _ in released]
    for r, (_, d) in zip(rows, released):
        marks = d["response"]["process_correctness"]
        assert r["labels"] == [0.0 if m == -1 else 1.0 for m in marks]
        assert r["meta"]["neutral_steps"] == [i for i, m in enumerate(marks) if m == 0]
        assert r["meta"]["error_steps"] == [i for i, m in enumerate(marks) if m == -1]
        assert r["meta"]["category"] == d["data_source"] and r["meta"]["gold_answer"] == d["answer"]
        assert [Path(p) for p in r["images"]] == [VPB_FILE.parent / p for p in d["image"]]
        assert all(Path(p).is_file() for p in r["images"])
    # one question answered by several policy models is one source problem (for the dev split)
    by_q: dict[str, set] = {}
    for r in rows:
        by_q.setdefault(r["question"] + r["images"][0], set()).add(r["meta"]["source_id"])
    assert all(len(v) == 1 for v in by_q.values()) and len(by_q) < len(rows)
    # images are checked unless the PRM does not see them
    row = dict(released[0][1], question="<image1> <image2> Which bar is taller?")
    f = tmp_path / "test.jsonl"
    f.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=r"test.jsonl:1: id=vpb-1: image: not found: .* \(unzip images.zip"):
        read_visualprocessbench(f)
    (r1,) = read_visualprocessbench(f, check_images=False)
    assert r1["question"] == "Which bar is taller?"  # 2 placeholders for 1 image: dropped
    (tmp_path / row["image"][0]).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / row["image"][0]).write_text("not an image")  # named at reading, not as a PIL traceback
    with pytest.raises(DataError, match=r"test.jsonl:1: id=vpb-1: image: image unreadable: .*UnidentifiedImageError"):
        read_visualprocessbench(f)
    f.write_text(json.dumps({**row, "response": {"steps": ["a", "b"], "process_correctness": [1, 2]}}) + "\n")
    with pytest.raises(DataError, match="response.process_correctness: missing or malformed"):
        read_visualprocessbench(f, check_images=False)


# ---- prm_eval's numbers against the benchmarks' procedures, on the same scores


def scored_rows(mod, examples, seed: int) -> list[dict]:
    """Rows as prm_eval's scorer loop builds them, with seeded scores in place of a PRM's."""
    rng = random.Random(seed)
    return [
        {
            "id": ex.id,
            "category": ex.meta.get("category"),
            "scores": [rng.random() for _ in ex.steps],
            "labels": [float(y) for y in ex.labels],
            "first_error": mod.true_first_error(ex),
            "neutral_steps": ex.meta.get("neutral_steps", []),
        }
        for ex in examples
    ]


def test_prm_eval_matches_processbench_eval():
    mod = recipe()
    dev, test = mod.split_dev(mod.read_examples(str(PB_DIR), "processbench"), 0.25, seed=0)
    dev_rows, test_rows = scored_rows(mod, dev, 1), scored_rows(mod, test, 2)
    t = mod.choose_threshold(dev_rows, "first_error_f1")  # on dev, never on the reported rows
    assert t == M.best_threshold([r["scores"] for r in dev_rows], [r["first_error"] for r in dev_rows])
    got = mod.report_metrics(test_rows, t, soft=False)
    want = processbench_reference(released_processbench(), {r["id"]: r["scores"] for r in test_rows}, t)
    assert set(want) == set(got["by_category"]) == set(SUBSETS)
    for subset, (acc1, acc2, f1) in want.items():
        m = got["by_category"][subset]
        assert 100 * m["first_error_error_acc"] == pytest.approx(acc1, abs=1e-9), subset
        assert 100 * m["first_error_correct_acc"] == pytest.approx(acc2, abs=1e-9), subset
        assert 100 * m["first_error_f1"] == pytest.approx(f1, abs=1e-9, nan_ok=True), subset


def test_processbench_overall_is_the_mean_of_the_four_f1():
    """The overall number is the paper's: each subset's F1, then their mean; the F1 of every row
    pooled stays beside it as `first_error_f1_pooled`."""
    mod = recipe()
    rows = scored_rows(mod, mod.read_examples(str(PB_DIR), "processbench"), 5)
    scores = {r["id"]: r["scores"] for r in rows}
    got = mod.report_metrics(rows, 0.5, soft=False, mean_f1=True)
    want = processbench_reference(released_processbench(), scores, 0.5)
    assert set(want) == set(SUBSETS)
    assert 100 * got["metrics"]["first_error_f1"] == pytest.approx(
        sum(f1 for *_, f1 in want.values()) / 4, abs=1e-9, nan_ok=True
    )
    pooled = [processbench_prediction(scores[d["id"]], 0.5) == d["label"] for d in released_processbench()]
    labels = [d["label"] for d in released_processbench()]
    acc1 = np.mean([m for m, y in zip(pooled, labels) if y != -1])
    acc2 = np.mean([m for m, y in zip(pooled, labels) if y == -1])
    assert got["metrics"]["first_error_f1_pooled"] == pytest.approx(2 * acc1 * acc2 / (acc1 + acc2), abs=1e-12)


def test_processbench_f1_is_nan_when_both_accuracies_are_0():
    """No hit in either class: ProcessBench's numpy F1 is 0/0 = NaN, and so is ours (not 0)."""
    assert math.isnan(M.first_error_f1([[0.9, 0.9], [0.1]], [1, None])["f1"])
    mod = recipe()
    rows = scored_rows(mod, mod.read_examples(str(PB_DIR), "processbench"), 0)
    for r in rows:  # every error missed (no step flagged), every correct solution flagged at step 0
        r["scores"] = [1.0 if r["first_error"] is not None else 0.0 for _ in r["scores"]]
    want = processbench_reference(released_processbench(), {r["id"]: r["scores"] for r in rows}, 0.5)
    got = mod.report_metrics(rows, 0.5, soft=False, mean_f1=True)
    for subset, (acc1, acc2, f1) in want.items():
        m = got["by_category"][subset]
        assert acc1 == acc2 == m["first_error_error_acc"] == m["first_error_correct_acc"] == 0.0
        assert math.isnan(f1) and math.isnan(m["first_error_f1"]), subset
    assert math.isnan(got["metrics"]["first_error_f1"])


def test_processbench_counts_truncated_examples_as_its_code_would():
    """An example cut by truncation stays in its class's denominator: its prediction is the first
    flagged step when that comes before the cut, else it has none and is a miss."""
    mod = recipe()
    rows = scored_rows(mod, mod.read_examples(str(PB_DIR), "processbench"), 6)
    for r in rows[::2]:  # the later half of every other example's steps unscored
        keep = len(r["scores"]) // 2
        r["scores"] = r["scores"][:keep] + [math.nan] * (len(r["scores"]) - keep)
    cut = sum(any(math.isnan(s) for s in r["scores"]) for r in rows)
    assert cut > 0
    for threshold in (0.3, 0.5, 0.7):
        got = mod.report_metrics(rows, threshold, soft=False)
        want = processbench_reference(released_processbench(), {r["id"]: r["scores"] for r in rows}, threshold)
        assert got["metrics"]["examples"] == len(rows) and got["metrics"]["truncated"] == cut
        for subset, values in want.items():
            m = got["by_category"][subset]
            assert m["examples"] == sum(r["category"] == subset for r in rows)
            mine = [100 * m[f"first_error_{k}"] for k in ("error_acc", "correct_acc", "f1")]
            assert mine == pytest.approx(list(values), abs=1e-9, nan_ok=True), (subset, threshold)


def test_dev_fraction_default_is_the_documented_one():
    """docs/formats.md states prm_eval's `data.dev_fraction` default; the config has that default."""
    text = (REPO / "docs" / "formats.md").read_text(encoding="utf-8")
    stated = re.search(r"`data\.dev_fraction` defaults to `([0-9.]+)`", text)
    assert stated, "docs/formats.md no longer states the data.dev_fraction default"
    assert float(stated.group(1)) == recipe().StepDataConfig().dev_fraction


def test_prm_eval_matches_visualprocessbench_eval():
    mod = recipe()
    dev, test = mod.split_dev(mod.read_examples(str(VPB_FILE), "visualprocessbench"), 0.34, seed=0)
    assert not {ex.meta["source_id"] for ex in dev} & {ex.meta["source_id"] for ex in test}
    dev_rows, test_rows = scored_rows(mod, dev, 3), scored_rows(mod, test, 4)
    t = mod.choose_threshold(dev_rows, "macro_f1")
    got = mod.report_metrics(test_rows, t, soft=False)
    want = vpb_reference(released_vpb(), {r["id"]: r["scores"] for r in test_rows}, t)
    assert set(want) == set(got["by_category"]) | {"overall"}
    for key, (f1_pos, f1_neg, macro) in want.items():
        m = got["metrics"] if key == "overall" else got["by_category"][key]
        assert m["f1_correct"] == pytest.approx(f1_pos, abs=1e-12), key
        assert m["f1_error"] == pytest.approx(f1_neg, abs=1e-12), key
        assert m["macro_f1"] == pytest.approx(macro, abs=1e-12), key
    # neutral steps are scored by the PRM but counted in no step metric
    neutral = sum(len(r["neutral_steps"]) for r in test_rows)
    assert got["metrics"]["steps"] == sum(len(r["scores"]) for r in test_rows)
    assert neutral > 0 and got["metrics"]["neutral_steps"] == neutral


# ---- the recipe end to end on tiny PRMs: report.json against the references on scores.jsonl


@pytest.fixture(scope="module")
def prm_dir(tiny_models, tmp_path_factory):
    from mmprm.models.loading import load_backbone
    from mmprm.models.prm import PRMSpec, build_prm, save_prm

    root = tmp_path_factory.mktemp("prms")

    def get(arch: str) -> Path:
        backbone, processor = load_backbone(tiny_models(arch))
        return save_prm(build_prm(backbone, processor, PRMSpec(head="token_pair")), processor, root / arch)

    return get


def run_recipe(prm: Path, out: Path, *args: str) -> tuple[dict, list[dict], list[dict]]:
    """Run prm_eval; (report, dev rows, test rows) of what it wrote."""
    overrides = ["data.per_category=null", f"prm.path={prm}", f"output.dir={out}", *args]
    assert recipe().main(["--config", str(CONFIG), *overrides]) == 0
    report = json.loads((out / "report.json").read_text())
    rows = [json.loads(line) for line in (out / "scores.jsonl").read_text().splitlines()]
    dev, test = [r for r in rows if r["split"] == "dev"], [r for r in rows if r["split"] == "test"]
    assert dev and test and not {r["id"] for r in dev} & {r["id"] for r in test}
    assert "data.dev_fraction=0.3" in report["threshold_split"]
    assert "data.dev_fraction=0.3" in (out / "report.md").read_text()
    return report, dev, test


ACC_F1_KEYS = ("error_acc", "correct_acc", "f1")


@pytest.mark.slow
def test_recipe_on_processbench_reports_processbench_numbers(prm_dir, tmp_path):
    report, dev, test = run_recipe(
        prm_dir("qwen2"), tmp_path, "data.format=processbench", f"data.path={PB_DIR}", "data.dev_fraction=0.3"
    )
    t = report["threshold"]
    assert report["threshold_source"] == "best first-error F1 on dev"
    assert t == M.best_threshold([r["scores"] for r in dev], [r["first_error"] for r in dev])
    want = processbench_reference(released_processbench(), {r["id"]: r["scores"] for r in test}, t)
    assert set(want) == set(report["by_category"])
    for subset, (acc1, acc2, f1) in want.items():
        m = report["by_category"][subset]
        # the report writes an undefined F1 (NaN: no correct prediction of either kind) as null
        got = [math.nan if m[f"first_error_{k}"] is None else 100 * m[f"first_error_{k}"] for k in ACC_F1_KEYS]
        assert got == pytest.approx([acc1, acc2, f1], abs=1e-9, nan_ok=True), subset


@pytest.mark.slow
def test_recipe_on_visualprocessbench_reports_its_f1(prm_dir, tmp_path):
    report, dev, test = run_recipe(
        prm_dir("qwen2_vl"),
        tmp_path,
        "data.format=visualprocessbench",
        f"data.path={VPB_FILE}",
        "data.dev_fraction=0.3",
    )
    t = report["threshold"]
    assert report["threshold_source"] == "best step macro F1 on dev"
    kept = [
        [(s, y) for i, (s, y) in enumerate(zip(r["scores"], r["labels"])) if i not in r["neutral_steps"]] for r in dev
    ]
    assert t == M.best_step_threshold([[s for s, _ in k] for k in kept], [[y for _, y in k] for k in kept])
    want = vpb_reference(released_vpb(), {r["id"]: r["scores"] for r in test}, t)
    for key, values in want.items():
        m = report["metrics"] if key == "overall" else report["by_category"][key]
        got = [m["f1_correct"], m["f1_error"], m["macro_f1"]]
        assert not any(v is None or math.isnan(v) for v in got)
        assert got == pytest.approx(list(values), abs=1e-12), key


@pytest.fixture(scope="module")
def qwen_math_prm_dir(tmp_path_factory) -> Path:
    from released_checkpoints import build_qwen_math_prm

    return build_qwen_math_prm(tmp_path_factory.mktemp("qwen_math_prm"))[0]


def released_prm_run(prm: Path, data: Path, out: Path, *args: str) -> tuple[dict, list[dict]]:
    """prm_eval on ProcessBench with the Qwen2.5-Math-PRM convention; (report, scores.jsonl rows)."""
    overrides = ["data.format=processbench", f"data.path={data}", "data.per_category=null", "data.dev_fraction=0"]
    overrides += [f"prm.path={prm}", "prm.convention=qwen2_5_math_prm", f"output.dir={out}", *args]
    assert recipe().main(["--config", str(CONFIG), *overrides]) == 0
    rows = [json.loads(line) for line in (out / "scores.jsonl").read_text().splitlines()]
    return json.loads((out / "report.json").read_text()), rows


def assert_processbench_numbers(report: dict, rows: list[dict], released: list[dict]) -> None:
    """report.json per subset and overall against ProcessBench's procedure on scores.jsonl."""
    want = processbench_reference(released, {r["id"]: r["scores"] for r in rows}, report["threshold"])
    assert set(want) == set(report["by_category"]) == set(SUBSETS)
    for subset, values in want.items():
        m = report["by_category"][subset]
        got = [100 * m[f"first_error_{k}"] for k in ("error_acc", "correct_acc", "f1")]
        assert got == pytest.approx(list(values), abs=1e-9), subset
    assert 100 * report["metrics"]["first_error_f1"] == pytest.approx(sum(v[2] for v in want.values()) / 4, abs=1e-9)


@pytest.mark.slow
def test_recipe_on_all_of_processbench_with_a_released_prm(qwen_math_prm_dir, tmp_path):
    """prm_eval on the four splits (all 3,400 rows from ../shared/data when there, the shipped 24
    otherwise) with a Qwen2.5-Math-PRM-shaped checkpoint and its convention: every row reported,
    ProcessBench's numbers per subset and their mean overall; at the default threshold, then again
    at one inside the scores (from the score cache, nothing rescored)."""
    released = released_processbench()
    report, rows = released_prm_run(qwen_math_prm_dir, PB_DIR, tmp_path)
    assert report["threshold"] == 0.5 and report["threshold_split"] == "none (given)"
    assert report["metrics"]["examples"] == len(rows) == len(released) and report["truncated"] == 0
    assert_processbench_numbers(report, rows, released)
    middle = float(np.median([s for r in rows for s in r["scores"]]))
    report, rows = released_prm_run(qwen_math_prm_dir, PB_DIR, tmp_path, f"metrics.threshold={middle}")
    assert_processbench_numbers(report, rows, released)
    assert 0 < report["metrics"]["first_error_error_acc"] and 0 < report["metrics"]["first_error_correct_acc"] < 1


@pytest.mark.slow
def test_recipe_counts_truncated_processbench_examples(qwen_math_prm_dir, tmp_path):
    """With prm.max_length cutting some examples, they stay in ProcessBench's denominators."""
    released = [r for s in SUBSETS for r in json.loads((FIXTURES / "processbench" / f"{s}.json").read_text("utf-8"))]
    report, rows = released_prm_run(qwen_math_prm_dir, FIXTURES / "processbench", tmp_path, "prm.max_length=500")
    cut = [r for r in rows if r["truncated"]]
    assert 0 < len(cut) < len(rows) and report["truncated"] == len(cut)
    assert report["metrics"]["examples"] == len(rows) == len(released)
    assert report["metrics"]["steps"] == sum(len(r["scores"]) for r in rows if not r["truncated"])
    middle = float(np.median([s for r in rows for s in r["scores"] if not math.isnan(s)]))
    report, rows = released_prm_run(
        qwen_math_prm_dir, FIXTURES / "processbench", tmp_path, "prm.max_length=500", f"metrics.threshold={middle}"
    )
    assert_processbench_numbers(report, rows, released)
