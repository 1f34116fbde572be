"""benchmarks/gpu_probe.py on CPU: its flags and exit codes, its verdict helpers by hand-computed
values, and a real --allow-cpu run whose stdout is one JSON line per probe and the summary. On a
GPU it is run as it is (the liger, flex backward, compile-in-bf16 and mfu verdicts need one)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_probe.py"


def load_probe():
    """benchmarks/gpu_probe.py as a module (by path: benchmarks/ is no package)."""
    spec = importlib.util.spec_from_file_location("gpu_probe", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def probe_run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=REPO, timeout=timeout
    )


def json_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines()]  # every stdout line is JSON


def test_help_lists_every_probe_with_its_line():
    probe = load_probe()
    res = probe_run("--help")
    assert res.returncode == 0, res.stderr
    for name, fn in probe.PROBES.items():
        assert f"  {name} " in res.stdout and fn.__doc__.splitlines()[0] in res.stdout, name
    assert list(probe.PROBES) == ["liger", "flex_tree", "compile", "mfu", "sdpa_kernel"]


def test_without_a_gpu_it_exits_2_saying_so():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the probe runs here")
    res = probe_run()
    assert res.returncode == 2 and res.stdout == ""
    assert "gpu-probe: no CUDA GPU is visible" in res.stderr and f"torch {torch.__version__}" in res.stderr
    assert "Nothing was probed" in res.stderr


def test_only_an_unknown_probe_exits_2_naming_it():
    res = probe_run("--allow-cpu", "--only", "mfu,flash")
    assert res.returncode == 2 and res.stdout == ""
    assert "--only flash: no such probe (the probes: liger, flex_tree, compile, mfu, sdpa_kernel)" in res.stderr


def test_parse_only_keeps_the_run_order():
    probe = load_probe()
    assert probe.parse_only([]) == list(probe.PROBES)
    assert probe.parse_only(["sdpa_kernel,liger", " mfu "]) == ["liger", "mfu", "sdpa_kernel"]


def test_a_probe_that_cannot_run_fails_on_gpu_and_is_not_applicable_on_cpu():
    probe = load_probe()
    assert probe.unavailable("liger-kernel is not installed", on_gpu=True) == {
        "ok": False,
        "cannot_run": "liger-kernel is not installed",
    }
    assert probe.unavailable("CUDA only", on_gpu=False) == {"ok": True, "not_applicable": "CUDA only"}


def test_compare_by_hand():
    probe = load_probe()
    # diff (0, 0, -0.5): max |diff| 0.5, over max |want| 4 -> 0.125; ||diff|| / ||want|| = 0.5 / sqrt(21)
    res = probe.compare(torch.tensor([1.0, 2.0, 3.5]), torch.tensor([1.0, 2.0, 4.0]), tol=0.2)
    assert res == {"max_abs": 0.5, "max_rel": 0.125, "rel_l2": pytest.approx(0.5 / math.sqrt(21), rel=1e-3), "ok": True}
    assert probe.compare(torch.tensor([1.0, 2.0, 3.5]), torch.tensor([1.0, 2.0, 4.0]), tol=0.1)["ok"] is False
    # a scalar (a loss): 10.1 against 10 is 1% off
    assert probe.compare(torch.tensor(10.1), torch.tensor(10.0), tol=1e-2)["rel_l2"] == pytest.approx(1e-2, rel=1e-3)
    # a zero reference is met only exactly
    assert probe.compare(torch.zeros(3), torch.zeros(3), tol=1e-5)["ok"] is True
    assert probe.compare(torch.full((3,), 1e-9), torch.zeros(3), tol=1e-5)["ok"] is False


def test_tolerances_are_those_the_docstring_justifies():
    probe = load_probe()
    assert probe.TOLERANCE == {torch.bfloat16: 1e-2, torch.float32: 1e-5}


def test_peak_ratio_verdict_by_hand():
    probe = load_probe()
    assert probe.peak_ratio_ok(700.0, 989.5) is True  # 0.71x, what a good H100 GEMM reaches
    assert probe.peak_ratio_ok(250.0, 1000.0) is False  # 0.25x: a wrong table entry or a throttled GPU
    assert probe.peak_ratio_ok(300.0, 1000.0) is False  # the bounds are open
    assert probe.peak_ratio_ok(1300.0, 1000.0) is False  # faster than the peak: the entry is too low
    assert probe.peak_ratio_ok(500.0, None) is False  # no entry for this GPU


def test_table_key_is_the_one_peak_flops_reads():
    from mmprm.mfu import PEAK_BF16_TFLOPS, peak_flops

    probe = load_probe()
    expected = {
        "NVIDIA H100 80GB HBM3": "H100",
        "NVIDIA H100 PCIe": "H100 PCIe",
        "NVIDIA H100 NVL": "H100 NVL",
        "NVIDIA H200": "H200",
        "NVIDIA H200 NVL": "H200",  # the known mis-match: the NVL part gets the SXM figure
        "NVIDIA A100-SXM4-80GB": "A100",
        "NVIDIA L4": None,
    }
    for name, key in expected.items():
        assert probe.table_key(name) == key, name
        assert peak_flops(None, name) == (None if key is None else PEAK_BF16_TFLOPS[key] * 1e12)


def test_tree_rows_pack_into_the_tree_by_hand():
    from mmprm.training.packing import pack_rows

    probe = load_probe()
    rows = probe.tree_rows(prompt=64, depth=2, branch=3, step_tokens=12, seed=0)
    assert len(rows) == 9 and all(r.step_positions == [75, 87] for r in rows)
    tree = pack_rows(rows)
    # the prompt once, then 3 + 9 step nodes of 12 tokens each
    assert len(tree.input_ids) == 64 + 12 * 12 and len(tree.step_positions) == 12
    assert tree.weights == [3.0, 1.0, 1.0, 1.0] * 3


def test_a_probe_that_raises_is_reported_and_the_next_one_runs(monkeypatch, capsys, tmp_path):
    probe = load_probe()

    def broken(device):
        """Raises."""
        raise RuntimeError("boom")

    def fine(device):
        """Passes."""
        return {"ok": True, "value": 1}

    monkeypatch.setattr(probe, "PROBES", {"broken": broken, "fine": fine})
    out = tmp_path / "probe.jsonl"
    assert probe.main(["--allow-cpu", "--out", str(out)]) == 1
    lines = json_lines(capsys.readouterr().out)
    assert lines[0] == {"probe": "broken", "ok": False, "seconds": lines[0]["seconds"], "error": "RuntimeError: boom"}
    assert lines[1] == {"probe": "fine", "ok": True, "seconds": lines[1]["seconds"], "value": 1}
    assert lines[2]["script"] == "gpu_probe" and lines[2]["ok"] is False and lines[2]["failed"] == ["broken"]
    assert json_lines(out.read_text()) == lines


def test_cpu_run_prints_one_json_line_per_probe_and_the_summary(tmp_path):
    from torch.nn.attention import SDPBackend

    out = tmp_path / "probe.jsonl"
    res = probe_run("--allow-cpu", "--only", "flex_tree,sdpa_kernel,mfu,liger", "--out", str(out))
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    lines = json_lines(res.stdout)
    assert [line.get("probe") for line in lines] == ["liger", "flex_tree", "mfu", "sdpa_kernel", None]
    assert json_lines(out.read_text()) == lines
    assert all(line["ok"] is True and line["seconds"] >= 0 for line in lines[:-1]), lines
    liger, flex, mfu, sdpa, summary = lines
    assert summary == {**summary, "script": "gpu_probe", "ok": True, "failed": [], "device": "cpu"}
    # liger: the chunked path is checked against full logits; Liger itself is CUDA only
    assert liger["chunked"]["ok"] and liger["chunked"]["labelled_count_equal"]
    assert "CUDA only" in liger["not_applicable"] and "liger" not in liger
    # flex: forward checked on CPU, backward refused by torch there (found at run time, not assumed)
    assert flex["flex"]["out"]["rel_l2"] <= 1e-5 and "d_q" not in flex["flex"]
    assert "backward" in flex["not_applicable"]
    assert flex["blocks_nonempty"] < flex["blocks_total"]
    assert mfu["measured_tflops"] > 0 and mfu["table_key"] is None and "not_applicable" in mfu
    variants = ["gqa_causal", "repeated_causal", "gqa_mask", "repeated_mask"]
    assert all(sdpa[v]["backend"] in SDPBackend.__members__ and sdpa[v]["out_vs_gqa_causal"]["ok"] for v in variants)


@pytest.mark.slow  # inductor compiles the decoder layer (forward and backward): 15-40 s on CPU
def test_cpu_compile_probe_trains_as_eager():
    res = probe_run("--allow-cpu", "--only", "compile", timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    line, summary = json_lines(res.stdout)
    assert line["probe"] == "compile" and line["ok"] is True and summary["ok"] is True
    assert line["compiled_layers"] == 2 and line["graphs_compiled"] == 1  # one graph for every layer and batch
    assert line["losses"]["rel_l2"] <= 1e-5 and len(line["eager_losses"]) == line["steps"] == 3
    assert line["eager_step_s"] > 0 and line["compiled_step_s"] > 0
