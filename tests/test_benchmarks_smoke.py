"""The benchmarks run end to end (--quick) and print one JSON line with their numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_benchmark(name: str) -> dict:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / name), "--quick"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, proc.stdout[-2000:]  # ONE JSON line
    return json.loads(lines[0])


@pytest.mark.slow
def test_prm_scoring_throughput_quick():
    res = run_benchmark("prm_scoring_throughput.py")
    rates = res["steps_per_s"]
    assert set(rates) == {
        "shared_prefix",
        "prompt_cache",
        "per_candidate",
        "per_step_prefix",
        "prefetch_thread",
        "no_prefetch_thread",
    }
    assert all(v > 0 for v in rates.values())
    assert res["device"] == "cpu" and res["prefetch_default"] is False  # the thread is a GPU's default
    assert all(v > 0 for v in res["across_problems"]["steps_per_s"].values())
    assert res["ratio_ours_vs_per_candidate"] > 0 and res["ratio_ours_vs_per_step_prefix"] > 0
    assert res["ratio_ours_vs_prompt_cache"] > 0 and res["ratio_ours_vs_bare_forward"] > 0
    assert res["steps_scored"] == res["n"] * res["problems"] * res["steps_per_candidate"]
    # the three ways score the same steps: equal up to float error, or the comparison means nothing
    assert max(res["max_abs_score_diff"].values()) < 1e-4
    assert res["prefix_tokens"] > 0 and res["candidate_tokens"] > 0


@pytest.mark.slow
def test_prm_train_throughput_quick():
    res = run_benchmark("prm_train_throughput.py")
    for side in ("ours", "trl", "floor_lm", "floor_decoder"):
        assert res[side]["tokens_per_s"] > 0 and res[side]["peak_rss_mib"] > 0
        assert res[side]["final_loss"] == res[side]["final_loss"]  # not NaN
    # --quick is exactly one epoch (32 rows, 4 steps of 8) on every side: the same non-pad tokens
    assert res["ours"]["non_pad_tokens"] == res["trl"]["non_pad_tokens"] == res["floor_decoder"]["non_pad_tokens"]
    assert res["ratio_tokens_per_s_vs_floor_lm"] > 0 and res["ratio_tokens_per_s_vs_floor_decoder"] > 0
    assert res["ratio_tokens_per_s"] > 0 and res["ratio_peak_rss"] > 0


# ---- benchmarks/gpu_check.py (make gpu-check) -------------------------------------------------


def test_gpu_check_without_cuda_says_so_and_checks_nothing():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible: make gpu-check really runs here")
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert "gpu-check: no CUDA GPU visible" in proc.stderr and "nothing was checked" in proc.stderr


def load_gpu_check():
    """benchmarks/gpu_check.py as a module (by path: benchmarks/ is no package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_fails_a_check_it_could_not_run(tmp_path):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here: the vLLM checks can run")
    gpu_check = load_gpu_check()
    for res in (gpu_check.vllm_engines(tmp_path, 1, 10), gpu_check.vllm_scorer(10)):
        assert res["ok"] is False and "vllm is not installed" in res["skipped"], res
    res = gpu_check.vllm_tensor_parallel(tmp_path, 1, 10)
    assert res["ok"] is False and "--skip vllm_tp" in res["skipped"]


def load_benchmark(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_runs_the_scoring_benchmark_in_its_gpu_mode():
    """`make gpu-check` runs prm_scoring_throughput.py on the GPU in bf16 at a size where the GPU
    has work; it passes where the ways of scoring agree and reports the floor ratio with its aim."""
    gpu_check = load_gpu_check()
    args = load_benchmark("prm_scoring_throughput").build_parser().parse_args(gpu_check.scoring_benchmark_args("cuda"))
    assert (args.device, args.dtype, args.hidden_size, args.quick) == ("cuda", "bfloat16", 512, False)
    assert "scoring_throughput" in gpu_check.CHECKS
    bench = {
        "device": "cuda",
        "dtype": "bfloat16",
        "steps_per_s": {"shared_prefix": 900.0},
        "ratio_ours_vs_bare_forward": 0.7,
        "ratio_prefetch_thread_vs_bare_forward": 0.7,
        "ratio_no_prefetch_thread_vs_bare_forward": 0.5,
        "aim_ours_vs_bare_forward": 0.8,
        "across_problems": {"ratio_one_call_vs_per_question": 1.5},
        "max_abs_score_diff": {"shared_vs_per_candidate": 0.01, "prefetch_thread_vs_shared": 0.0},
    }
    res = gpu_check.scoring_verdict(bench)
    assert res["ok"] is True and res["aim_met"] is False and res["max_abs_score_diff"] == 0.01
    assert gpu_check.scoring_verdict({**bench, "dtype": "float32"})["ok"] is False  # 0.01 is a bug in fp32
    wrong = gpu_check.scoring_verdict({**bench, "max_abs_score_diff": {"shared_vs_per_candidate": 0.3}})
    assert wrong["ok"] is False


def test_gpu_check_tensor_parallel_on_one_gpu_is_not_a_failure(tmp_path, monkeypatch):
    """A one-GPU machine cannot run TP=2 at all: plain `make gpu-check` must still pass there."""
    import importlib.util

    gpu_check = load_gpu_check()
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "vllm" else real_find_spec(n, *a))
    res = gpu_check.vllm_tensor_parallel(tmp_path, 1, 10)
    assert res["ok"] is True and "needs 2 GPUs" in res["not_applicable"]
    assert "vllm_tp" not in gpu_check.verdict(
        {name: {"ok": True} for name in gpu_check.CHECKS} | {"vllm_tp": res}, set()
    )


def test_gpu_check_verdict_counts_a_skip_only_when_named():
    gpu_check = load_gpu_check()
    passed = {name: {"ok": True} for name in gpu_check.CHECKS}
    assert gpu_check.verdict(passed, set()) == []
    could_not = {**passed, "flash_attn": gpu_check.cannot_run("flash_attn", "flash-attn is not installed")}
    assert gpu_check.verdict(could_not, set()) == ["flash_attn"]
    assert gpu_check.verdict({**could_not, "flash_attn": {"ok": True, "skipped": "--skip"}}, {"flash_attn"}) == []
    missing = {k: v for k, v in passed.items() if k != "scorer"}  # a check that never reported
    assert gpu_check.verdict(missing, set()) == ["scorer"]
    assert gpu_check.verdict({**passed, "zero2": {"ok": False}}, {"vllm"}) == ["zero2"]
    assert gpu_check.parse_skip(["vllm,vllm_tp", "flash_attn"]) == {"vllm", "vllm_tp", "flash_attn"}
    with pytest.raises(ValueError, match=r"--skip nope: no such check \(the checks: zero2, "):
        gpu_check.parse_skip(["vllm,nope"])


def test_gpu_check_lists_its_checks_and_refuses_an_unknown_skip():
    script = [sys.executable, str(REPO / "benchmarks" / "gpu_check.py")]
    shown = subprocess.run([*script, "--help"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0
    for name in load_gpu_check().CHECKS:
        assert name in shown.stdout
    bad = subprocess.run([*script, "--skip", "vlm"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--skip vlm: no such check" in bad.stderr and bad.stdout == ""


def test_gpu_check_runs_one_group_with_only():
    """--only runs a group (benchmarks/gpu_lease_check.sh runs the check so: a timeout loses one
    group's JSON line); every other check counts as skipped, and an unknown name is refused."""
    gpu_check = load_gpu_check()
    assert gpu_check.parse_only(["zero3,scorer"]) == {"zero3", "scorer"}
    with pytest.raises(ValueError, match=r"--only nope: no such check"):
        gpu_check.parse_only(["nope"])
    skip = set(gpu_check.CHECKS) - {"zero3", "scorer"}
    assert gpu_check.verdict({"zero3": {"ok": True}, "scorer": {"ok": False}}, skip) == ["scorer"]
    bad = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--only", "zero9"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--only zero9: no such check" in bad.stderr


@pytest.mark.slow
def test_gpu_check_logic_on_cpu():
    """The same script end to end on CPU (small model, few steps): every path a GPU run takes."""
    pytest.importorskip("deepspeed")
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
    env.update(TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "gpu_check.py"),
            "--allow-cpu",
            "--steps",
            "4",
            "--rows",
            "32",
            "--hidden-size",
            "128",
            "--timeout",
            "600",
            "--probe-tokens",
            "64",
            "--probe-divisor",
            "16",
            "--skip",
            "zero3_packed_flex,vllm,vllm_tp",
            "--skip",
            "vllm_scorer",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads(lines[0])
    # flash-attn could not run (no GPU) and was not skipped by name: the one failure
    assert proc.returncode == 1 and res["failed"] == ["flash_attn"] and res["ok"] is False, res
    assert "--skip flash_attn" in res["flash_attn"]["skipped"]
    assert res["attn_implementation"] == "sdpa"  # what training used without a working flash-attn
    for stage in ("zero2", "zero3"):
        assert res[stage]["finite"] and "loss_first" in res[stage], res[stage]
    assert res["zero3"]["lm_head"] == {"numel": 1025 * 128, "local_numel": 1025 * 128, "partitioned": True}
    assert res["scorer"]["probabilities_dtype"] == "float32" and res["scorer"]["round_trip_max_diff"] <= 2e-2
    assert res["scorer"]["steps_per_s"] > 0
    assert res["scoring_throughput"]["ok"] and res["scoring_throughput"]["device"] == "cpu", res["scoring_throughput"]
    assert res["processes"] == 1  # every visible GPU: none here
    packed = res["zero3_packed"]
    assert packed["finite"] and packed["rows_in_packs"][0] > packed["rows_in_packs"][1] > 0, packed
    assert res["skipped_by_user"] == ["vllm", "vllm_scorer", "vllm_tp", "zero3_packed_flex"]
    for name in res["skipped_by_user"]:
        assert res[name] == {"ok": True, "skipped": "--skip"}
    assert res["memory_7b_layer"]["tokens"] == 64 and res["memory_7b_layer"]["seconds_2_layers"] > 0


@pytest.mark.slow
def test_data_scale_quick():
    res = run_benchmark("data_scale.py")
    for n in ("200", "800"):
        first, again = res["streamed"][n]["first_run"], res["streamed"][n]["cached_rerun"]
        assert not first["cache_reused"] and again["cache_reused"] and first["rows_kept"] == int(n)
        assert first["peak_rss_mib"] > 0 and first["steps_per_s"] > 0 and again["data_s"] < first["data_s"]
    assert res["ratio_peak_rss_largest_vs_smallest"] > 0 and res["ratio_first_step_cached_vs_first_run"] > 0
    assert set(res["eager_baseline"]) >= {"100", "200"}


@pytest.mark.slow
def test_tokenizer_corpus_quick():
    res = run_benchmark("tokenizer_corpus.py")
    for side in ("builtin", "task_corpus"):
        assert res[side]["tokens_per_row"] > 0 and res[side]["seconds_per_step"] > 0
    # the task-trained tokenizer writes the same rows in fewer tokens (measured: about 1.2x)
    assert res["token_ratio"] > 1.05 and res["step_time_ratio"] > 0


@pytest.mark.slow
def test_prm_collate_quick():
    res = run_benchmark("prm_collate.py")
    assert res["rows"] == 20 * res["rows_per_problem"] and 0 < res["cached_prompts"] <= 20
    assert res["cache_mb"] > 0 and res["collate_s"]["uncached"] > 0 and res["collate_s"]["cached"] > 0
    # the equality check passed (the script exits otherwise); speed is measured, not asserted here
    assert res["collate_ratio"] > 0 and res["step_ratio"] > 0


@pytest.mark.slow
def test_prm_prefetch_quick():
    res = run_benchmark("prm_prefetch.py")
    assert res["steps"] == 4 and res["step_s"]["inline"] > 0 and res["step_s"]["prefetch"] > 0
    # the equality check passed (the script exits otherwise); speed is measured, not asserted here
    assert res["step_ratio"] > 0


def test_hf_sampling_quick():
    res = run_benchmark("hf_sampling.py")
    for setting in ("no_cut", "top_k50_top_p0.9"):
        # both sides decoded the same number of steps (the script exits otherwise); speed is
        # measured, not asserted here
        assert res[setting]["step_s"]["generate"] > 0 and res[setting]["step_s"]["inverse_cdf"] > 0
        assert res[setting]["ratio"] > 0


def test_gqa_attention_quick():
    res = run_benchmark("gqa_attention.py")
    # the script fails unless both sides made the same tokens from the same logits
    assert res["rollouts"]["bitwise_equal"] and res["rollouts"]["padded"]
    assert res["decode_attention_7b"]["bitwise_equal"]
    assert res["rollouts"]["ratio"] > 0 and res["decode_attention_7b"]["ratio"] > 0


def test_shared_prefill_quick():
    res = run_benchmark("shared_prefill.py")
    for size in ("demo", "448px"):
        # the script fails unless a prompt prefilled once sampled the rollouts of its rows apart
        assert res[f"{size}_4_tokens"]["rollouts_equal"] and res[f"{size}_4_tokens"]["ratio"] > 0


def test_prm_packing_quick():
    res = run_benchmark("prm_packing.py")
    # an OmegaPRM-shaped tree per problem: the gold path and two wrong branches per step
    assert res["rows_per_problem"] > 5 and 0.2 < res["packed_token_share"] < 0.8
    assert res["rows_per_s"]["rows"] > 0 and res["rows_per_s"]["packed"] > 0 and res["ratio"] > 0
    assert res["rows_per_s"]["packed_full_mask"] > 0 and res["ratio_blocks_vs_full_mask"] > 0
    # the script fails unless the written-out backward of the blocks gave autograd's gradients
    assert res["gradients_equal"] and res["ratio_written_backward_vs_autograd"] > 0


@pytest.mark.slow
def test_sft_memory_quick():
    res = run_benchmark("sft_memory.py")
    assert res["chunk_tokens"] == 128 and res["tokens"] == 512
    assert res["full"]["loss"] == pytest.approx(res["chunked"]["loss"], rel=1e-5)
    # At 512 tokens x 32,000 logits the step's rise is of the size of the model load's own peak,
    # which the process-lifetime RSS peak also holds: the memory claim is the full-size run's.
    assert res["full"]["step_rise_mib"] >= 0 and res["chunked"]["step_rise_mib"] >= 0
    assert res["peak_rss_ratio"] > 0


@pytest.mark.slow
def test_sft_packing_quick():
    res = run_benchmark("sft_packing.py")
    # the demo's SFT rows: one image of 3-4 tiles and its solution, packed about 8 to a sequence
    assert res["rows"] == 48 and 80 < res["mean_row_tokens"] < 256 and res["rows_per_pack"] > 4
    assert res["padding_share"]["packed"] == 0 and res["padding_share"]["padded_unsorted"] > 0
    assert all(v > 0 for v in res["rows_per_s"].values()) and res["ratio"] > 0 and res["ratio_vs_unsorted"] > 0
    assert res["same_rows"]["ratio"] > 0 and res["same_rows"]["padding_share"] < 0.1
