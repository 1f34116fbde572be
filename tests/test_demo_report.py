"""The demo's report (`recipes/demo/report.py`) written from a real run's results, with the
hard-label PRM (`hard_prm=true`) and without it (the default)."""

import copy
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURE = Path(__file__).parent / "fixtures" / "demo_results_three_models.json"


@pytest.fixture
def demo_report(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "recipes"))
    for name in [m for m in sys.modules if m == "demo" or m.startswith("demo.")]:
        monkeypatch.delitem(sys.modules, name)
    from demo import report

    return report


def _write(report, tmp_path: Path, results: dict) -> str:
    saved = json.loads(FIXTURE.read_text())
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "task.json").write_text(json.dumps(saved["task"]))
    timings = [("policy", 200.0, 400.0, "ran"), ("prm", 290.0, 285.0, "ran")]
    report.write_report(tmp_path, saved["config"], results, timings, run_wall=850.0)
    return (tmp_path / "report.md").read_text()


def test_report_names_the_hard_label_prm_when_it_was_trained(demo_report, tmp_path):
    results = json.loads(FIXTURE.read_text())["results"]
    text = _write(demo_report, tmp_path, results)
    assert "scored by three reward models" in text
    assert "hard labels 0.814" in text  # its step AUROC on the summary's step line
    assert "Aggregator chosen on dev for the hard PRM: `max`" in text
    assert json.loads((tmp_path / "report.json").read_text())["models"] == results["models"]


def test_report_without_the_hard_label_prm(demo_report, tmp_path):
    results = copy.deepcopy(json.loads(FIXTURE.read_text())["results"])
    for key in ("models", "step", "step_by_kind", "bon"):
        del results[key]["hard"]
    text = _write(demo_report, tmp_path, results)
    assert "scored by two reward models" in text
    assert "hard" not in text.lower()
    # the headline and the step line read as with three models, less the hard PRM's parts
    assert "the soft-label PRM's step AUROC within the same problem and step is 0.841" in text
    assert "Against the outcome model 0.350: +0.353 [+0.287, +0.423]." in text
    assert "Wall time of the whole run 14.2 min" in text
