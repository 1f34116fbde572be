"""ProcessBench and VisualProcessBench in prm_eval: readers, and the same numbers as each benchmark's
own evaluation procedure on the same predictions.

The references below re-express, independently of mmprm, what the benchmarks' evaluation code
computes from the released rows:

* ProcessBench (github:QwenLM/ProcessBench code/run_eval*.py): per subset, a PRM's prediction is
  the first step whose score is below the threshold, else -1; `match = prediction == label`;
  accuracy on erroneous samples (label != -1) and on correct ones (label == -1), in percent, and
  F1 = 2 * acc1 * acc2 / (acc1 + acc2).
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
import sys
from pathlib import Path

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


def processbench_reference(rows: list[dict], scores: dict[str, list[float]], threshold: float) -> dict[str, tuple]:
    """subset -> (error acc, correct acc, F1), in percent, as ProcessBench's run_eval prints them."""
    out = {}
    for subset in SUBSETS:
        res = []
        for d in (r for r in rows if r["id"].rsplit("-", 1)[0] == subset and r["id"] in scores):
            pred = next((i for i, s in enumerate(scores[d["id"]]) if s < threshold), -1)
            res.append({"label": d["label"], "match": pred == d["label"]})
        err = [e["match"] for e in res if e["label"] != -1]
        cor = [e["match"] for e in res if e["label"] == -1]
        if err and cor:
            acc1, acc2 = sum(err) / len(err) * 100, sum(cor) / len(cor) * 100
            out[subset] = (acc1, acc2, 2 * acc1 * acc2 / (acc1 + acc2) if acc1 + acc2 else 0.0)
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
        assert 100 * m["first_error_f1"] == pytest.approx(f1, abs=1e-9), subset


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
    overrides = ["data.per_category=null", f"scorer.prm_path={prm}", f"output.dir={out}", *args]
    assert recipe().main(["--config", str(CONFIG), *overrides]) == 0
    report = json.loads((out / "report.json").read_text())
    rows = [json.loads(line) for line in (out / "scores.jsonl").read_text().splitlines()]
    dev, test = [r for r in rows if r["split"] == "dev"], [r for r in rows if r["split"] == "test"]
    assert dev and test and not {r["id"] for r in dev} & {r["id"] for r in test}
    assert "data.dev_fraction=0.3" in report["threshold_split"]
    assert "data.dev_fraction=0.3" in (out / "report.md").read_text()
    return report, dev, test


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
        got = [100 * m[f"first_error_{k}"] for k in ("error_acc", "correct_acc", "f1")]
        assert got == pytest.approx([acc1, acc2, f1], abs=1e-9), subset


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
