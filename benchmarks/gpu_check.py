"""GPU check: what a first GPU run of mmprm must show before a 7B job is trusted.

    make gpu-check                                   # every visible GPU, under 10 minutes on 8
    python benchmarks/gpu_check.py --processes 1     # one GPU
    python benchmarks/gpu_check.py --only zero3,scorer  # one group of checks (the rest not run)

On tiny random-init models (nothing is downloaded), with every visible GPU unless told otherwise:

- `recipes/prm_train.py` through `accelerate launch --config_file launch/accelerate/deepspeed_zero{2,3}.yaml
  --mixed_precision bf16`, bf16 weights, `model.attn_implementation=auto` (the kernel it chose is
  reported), a tiny Qwen2.5-VL (hidden 512, 4 layers) whose embeddings and LM head (1025 x 512) pass
  ZeRO-3's persistence threshold, so ZeRO-3 really partitions them across the processes: the loss
  falls and stays finite; ZeRO-3 runs with gradient checkpointing, as the 7B configs do;
- the same under ZeRO-3 with tree packing (`data.pack_trees=true`, sdpa: packing takes no flash
  kernel) on rows that share their prompt and first step; and once more with FlexAttention and the
  tree as a block mask (`model.attn_implementation=flex_attention`) on a tiny InternVL (the Qwen2-VL
  family has no FlexAttention in transformers), whose backward runs on a GPU only;
- the saved PRM, loaded with `mmprm.load_prm` in bf16 on the GPU, scores the eval rows as the
  trained model did in memory, and returns float32 probabilities; scorer steps per second;
- the scoring benchmark's GPU mode (`benchmarks/prm_scoring_throughput.py --device cuda`, bf16, a
  tiny Qwen2-VL of hidden 512 and 4 layers, 8 problems x 16 candidates): steps/s of every way of
  scoring, ours against the bare-forward floor (aim 0.8, reported, not a failure), and the ways'
  scores agree;
- flash-attn: imported and run against sdpa on one GPU; `model.attn_implementation=auto` would pick
  it, so a flash-attn missing, or built against another torch, is a failure here, not a quiet sdpa;
  the training runs use it when it works;
- one tiny vLLM engine per GPU under torchrun (`mmprm.generation.vllm.pin_local_gpu`):
  each rank's engine on a GPU of its own, each generating;
- one tiny vLLM engine over 2 GPUs (`tensor_parallel_size=2`), generating;
- the vLLM scorer (`prm.backend=vllm`) beside the HF scorer on one GPU in bf16
  (`benchmarks/prm_vllm_scoring.py`): both scorers' steps/s, and their scores agree;
- the memory of one decoder layer shaped as Qwen2.5-VL-7B's language model (hidden 3584, 28
  heads of 128, 4 KV heads, MLP 18944) training on one 4096-token sequence in bf16 with gradient
  checkpointing, measured at 1 and 2 layers and extrapolated to the model's 28 (weights, gradients
  and activations; optimizer states are ZeRO's, see the memory table in docs/scaling.md).

A check that cannot run (vllm not installed, one GPU for the 2-GPU engine, no GPU under
`--allow-cpu`) is a failure, unless named with `--skip NAME`: then it is not run, and the JSON
says so. Prints ONE JSON line, whose `failed` lists the failed checks; exit 0 when every check not
skipped passed, 1 when one failed or could not run, 2 when there is no CUDA GPU (the check does not
run on CPU; `--allow-cpu` exists for the CPU test of this script only) or the arguments are wrong.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

COLOURS = [(230, 25, 75), (60, 180, 75), (0, 130, 200), (245, 130, 48)]

# Every check, in the order run: the names --skip takes and the JSON's keys.
CHECKS: dict[str, str] = {
    "zero2": "bf16 prm_train under ZeRO-2: the loss falls and stays finite",
    "zero3": "the same under ZeRO-3 with gradient checkpointing; the LM head is partitioned",
    "zero3_packed": "ZeRO-3 with tree packing (sdpa)",
    "zero3_packed_flex": "ZeRO-3 with tree packing under FlexAttention (GPU only)",
    "scorer": "load_prm in bf16 scores as the trained model did; steps/s",
    "scoring_throughput": "the scoring benchmark on one GPU: ours vs the bare-forward floor; scores agree",
    "flash_attn": "flash-attn imports and agrees with sdpa on a GPU",
    "vllm": "one vLLM engine per GPU under torchrun, each on its own GPU",
    "vllm_tp": "one vLLM engine with tensor_parallel_size=2 (2 or more GPUs)",
    "vllm_scorer": "the vLLM scorer beside the HF scorer; scores agree",
    "memory_7b_layer": "memory of Qwen2.5-VL-7B-shaped decoder layers, extrapolated to 28",
}


def cannot_run(name: str, why: str) -> dict[str, Any]:
    """The result of a check that could not run: a failure unless the user skips it by name."""
    return {"ok": False, "skipped": f"{why}; not checked (--skip {name} to accept that)"}


def parse_skip(values: list[str]) -> set[str]:
    """The check names given to --skip (repeated, or comma separated); ValueError on an unknown one."""
    names = {n.strip() for v in values for n in v.split(",") if n.strip()}
    unknown = sorted(names - set(CHECKS))
    if unknown:
        raise ValueError(f"--skip {','.join(unknown)}: no such check (the checks: {', '.join(CHECKS)})")
    return names


def parse_only(values: list[str]) -> set[str]:
    """The checks to run, from --only (repeated, or comma separated): every other check is skipped as
    if named with --skip. ValueError on an unknown name."""
    names = {n.strip() for v in values for n in v.split(",") if n.strip()}
    unknown = sorted(names - set(CHECKS))
    if unknown:
        raise ValueError(f"--only {','.join(unknown)}: no such check (the checks: {', '.join(CHECKS)})")
    return names


def verdict(result: dict[str, Any], skip: set[str]) -> list[str]:
    """The checks that failed: not ok, could not run, or missing from `result`, unless in `skip`."""
    return [name for name in CHECKS if name not in skip and not result.get(name, {"ok": False})["ok"]]


def write_step_data(folder: Path, n: int, seed: int, name: str) -> Path:
    """n step-labelled rows (two addition steps, one image each); a wrong step and all after it get 0."""
    from PIL import Image

    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        image = folder / f"{name}_{i}.png"
        Image.new("RGB", (224 + 32 * (i % 3), 224), COLOURS[i % len(COLOURS)]).save(image)
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        wrong_at = rng.choice([None, 0, 1]) if i % 2 else None
        steps, labels, ok = [], [], True
        for k, (x, y) in enumerate([(a, b), (a + b, 1)]):
            ok = ok and wrong_at != k
            steps.append(f"{x} + {y} = {x + y + (0 if wrong_at != k else rng.randint(1, 3))}.")
            labels.append(1.0 if ok else 0.0)
        rows.append(
            {
                "id": f"{name}-{i}",
                "images": [str(image)],
                "question": "Add the numbers.",
                "steps": steps,
                "labels": labels,
            }
        )
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_tree_data(folder: Path, n: int, seed: int) -> Path:
    """`write_step_data` rows, each with a one-step prefix row and a branch beside it: rows that
    share their prompt and first step, as an MCTS export's do, so tree packing has work."""
    rows = []
    for row in map(json.loads, write_step_data(folder, n, seed, "tree").read_text().splitlines()):
        rows += [row, {**row, "id": row["id"] + "/prefix", "steps": row["steps"][:1], "labels": row["labels"][:1]}]
        rows.append(
            {
                **row,
                "id": row["id"] + "/branch",
                "steps": [row["steps"][0], "So it is 7."],
                "labels": [row["labels"][0], 0.0],
            }
        )
    path = folder / "tree_rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(
    stage: int,
    model: Path,
    train_file: Path,
    eval_file: Path,
    out: Path,
    args: argparse.Namespace,
    attn: str,
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    """One bf16 prm_train run under ZeRO-`stage` (more overrides in `extra`); its losses, time and
    (ZeRO-3) partition sizes."""
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        f"launch/accelerate/deepspeed_zero{stage}.yaml",
        "--num_processes",
        str(args.processes),
        "--main_process_port",
        str(free_port()),
        "--mixed_precision",
        "bf16",
        "--dynamo_backend",
        "no",
        "recipes/prm_train.py",
        f"model.name_or_path={model}",
        f"data.train_file={train_file}",
        f"data.eval_file={eval_file}",
        f"output_dir={out}",
        f"train.max_steps={args.steps}",
        "train.lr=5e-4",
        "train.batch_size=8",
        "train.log_every=1",
        f"train.eval_every={args.steps}",
        f"train.save_every={args.steps}",
        "train.warmup_steps=2",
        "train.report_to=none",
        "train.bf16=true",
        "model.dtype=bfloat16",
        f"model.attn_implementation={attn}",
        "data.max_length=512",
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
    env.update(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    t0 = time.time()
    try:
        res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {args.timeout}s"}
    seconds = time.time() - t0
    if res.returncode != 0:
        return {"ok": False, "error": (res.stdout + res.stderr)[-1500:], "seconds": round(seconds, 1)}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r["split"] == "train"]
    k = max(1, len(losses) // 4)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    result: dict[str, Any] = {
        "seconds": round(seconds, 1),
        "loss_first": round(first, 4),
        "loss_last": round(last, 4),
        "finite": all(math.isfinite(x) for x in losses),
    }
    result["ok"] = result["finite"] and last < first
    if "data.pack_trees=true" in extra:
        packs = re.search(r"tree packing: (\d+) rows in (\d+) packs", res.stdout + res.stderr)
        result["rows_in_packs"] = packs and [int(packs.group(1)), int(packs.group(2))]
        result["ok"] = result["ok"] and bool(packs) and packs.group(1) != packs.group(2)
    if stage == 3:
        report = out / "zero3_partitions.json"
        parts = json.loads(report.read_text())["parameters"] if report.exists() else []
        head = next((p for p in parts if p["name"].endswith("lm_head.weight")), None)
        result["lm_head"] = head and {
            "numel": head["numel"],
            "local_numel": head["local_numel"],
            "partitioned": head["partitioned"],
        }
        result["ok"] = result["ok"] and bool(head and head["partitioned"])
    return result


def score(out: Path, eval_file: Path, device: str, attn: str, repeats: int) -> dict[str, Any]:
    """load_prm in bf16 on `device`: agreement with the in-memory eval scores, dtype, steps/s."""
    import torch

    import mmprm
    from mmprm.data.schema import load_examples

    scorer = mmprm.load_prm(out, device=device, dtype=torch.bfloat16, batch_size=16, attn_implementation=attn)
    examples = load_examples(eval_file)
    memory = {r["id"]: r["scores"] for r in map(json.loads, (out / "eval_predictions.jsonl").read_text().splitlines())}
    scores = scorer.score(examples)
    diff = max(abs(a - b) for e, s in zip(examples, scores) for a, b in zip(s, memory[e.id]))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.time()
    for _ in range(repeats):
        scorer.score(examples)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    steps = repeats * sum(len(e.steps) for e in examples)
    with torch.no_grad():  # the probabilities the scorer returns come from this cast
        probs = mmprm.models.prm.ProcessRewardModel.probabilities(torch.zeros(1, 2, dtype=torch.bfloat16))
    return {
        "round_trip_max_diff": diff,
        "probabilities_dtype": str(probs.dtype).replace("torch.", ""),
        "steps_per_s": round(steps / (time.time() - t0), 1),
        "ok": diff <= 2e-2 and probs.dtype == torch.float32,
    }


def vllm_engines(root: Path, processes: int, timeout: int) -> dict[str, Any]:
    """One tiny vLLM engine per GPU, started by torchrun as the annotation recipe starts them:
    every rank must report a GPU of its own and generated text."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return cannot_run("vllm", "vllm is not installed (pip install 'mmprm[vllm]')")
    from mmprm.models.tiny import VLLM_HEAD_DIM, build_tiny_model

    model = build_tiny_model("qwen2", root / "vllm_model", seed=0, head_dim=VLLM_HEAD_DIM, vllm_ready=True)
    reports = root / "vllm_reports"
    reports.mkdir(exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(processes),
        "--master_port",
        str(free_port()),
        __file__,
        "--vllm-worker",
        str(model),
        "--out",
        str(reports),
    ]
    t0 = time.time()
    try:
        res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout}s"}
    if res.returncode != 0:
        return {"ok": False, "error": (res.stdout + res.stderr)[-1500:]}
    ranks = [json.loads(p.read_text()) for p in sorted(reports.glob("rank*.json"))]
    devices = [r["device_uuid"] for r in ranks]
    return {
        "seconds": round(time.time() - t0, 1),
        "engines": len(ranks),
        "visible_devices": [r["visible"] for r in ranks],
        "ok": len(ranks) == processes and len(set(devices)) == processes and all(r["generated_tokens"] for r in ranks),
    }


def scoring_benchmark_args(device: str) -> list[str]:
    """The scoring benchmark's command-line arguments: its GPU mode, or a smoke run on CPU."""
    if device == "cuda":
        return ["--device", "cuda", "--dtype", "bfloat16", "--hidden-size", "512", "--layers", "4", "--problems", "8"]
    return ["--quick"]


def scoring_verdict(bench: dict[str, Any]) -> dict[str, Any]:
    """The scoring benchmark's JSON, as this check reports it: ok when the ways of scoring agree
    (bf16 within 2e-2, float32 within 1e-4); the ratio to the floor is reported against its aim."""
    worst = max(bench["max_abs_score_diff"].values())
    ratio, aim = bench["ratio_ours_vs_bare_forward"], bench["aim_ours_vs_bare_forward"]
    return {
        "device": bench["device"],
        "dtype": bench["dtype"],
        "steps_per_s": bench["steps_per_s"],
        "ratio_ours_vs_bare_forward": ratio,
        "ratio_prefetch_thread_vs_bare_forward": bench["ratio_prefetch_thread_vs_bare_forward"],
        "ratio_no_prefetch_thread_vs_bare_forward": bench["ratio_no_prefetch_thread_vs_bare_forward"],
        "aim_ours_vs_bare_forward": aim,
        "aim_met": ratio >= aim,
        "across_problems": bench["across_problems"],
        "max_abs_score_diff": worst,
        "ok": worst <= (1e-4 if bench["dtype"] == "float32" else 2e-2),
    }


def scoring_throughput(device: str, timeout: int) -> dict[str, Any]:
    """`benchmarks/prm_scoring_throughput.py` on one GPU (`scoring_benchmark_args`), judged by
    `scoring_verdict`."""
    bench = run_json_benchmark("prm_scoring_throughput.py", scoring_benchmark_args(device), timeout)
    return bench if "error" in bench else scoring_verdict(bench)


def run_json_benchmark(script: str, args: list[str], timeout: int) -> dict[str, Any]:
    """The last JSON line of `benchmarks/SCRIPT ARGS` on the first visible GPU, or {"ok": False,
    "error": ...} when it fails, prints none or runs past TIMEOUT seconds."""
    cmd = [sys.executable, str(REPO / "benchmarks" / script), *args]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}
    try:
        res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False, env=env)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout}s"}
    lines = [line for line in res.stdout.splitlines() if line.startswith("{")]
    if res.returncode != 0 or not lines:
        return {"ok": False, "error": (res.stdout + res.stderr)[-1500:]}
    return json.loads(lines[-1])


def vllm_scorer(timeout: int) -> dict[str, Any]:
    """The vLLM scorer and the HF scorer side by side on one GPU, bf16
    (`benchmarks/prm_vllm_scoring.py`): both steps/s, and the scores agree."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return cannot_run("vllm_scorer", "vllm is not installed (pip install 'mmprm[vllm]')")
    bench = run_json_benchmark("prm_vllm_scoring.py", ["--device", "cuda", "--dtype", "bfloat16"], timeout)
    return bench if "error" in bench else {**bench, "ok": bench["max_abs_score_diff"] <= 2e-2}


def flash_attn_check(device: str) -> dict[str, Any]:
    """flash-attn imported and run on one GPU, its output beside sdpa's on the same bf16 inputs."""
    import importlib.util

    import torch

    if importlib.util.find_spec("flash_attn") is None:
        return cannot_run(
            "flash_attn",
            "flash-attn is not installed (pip install 'mmprm[flash]' --no-build-isolation, "
            "after torch); training uses sdpa without it",
        )
    if device != "cuda":
        return cannot_run("flash_attn", "no GPU: flash-attn runs on CUDA only")
    try:
        import flash_attn
        from flash_attn import flash_attn_func
    except Exception as e:  # an undefined symbol: built against another torch or CUDA
        return {
            "ok": False,
            "error": f"flash-attn is installed but does not import ({type(e).__name__}: {e}); rebuild it "
            "against this torch: pip install --force-reinstall --no-build-isolation 'mmprm[flash]'",
        }
    q, k, v = (torch.randn(2, 256, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))  # (B, S, H, D)
    out = flash_attn_func(q, k, v, causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    ).transpose(1, 2)
    diff = (out.float() - ref.float()).abs().max().item()
    return {"version": flash_attn.__version__, "max_abs_diff_vs_sdpa": diff, "ok": diff <= 2e-2}


def vllm_tensor_parallel(root: Path, gpus: int, timeout: int) -> dict[str, Any]:
    """One tiny vLLM engine over the first 2 GPUs (`tensor_parallel_size=2`), generating."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return cannot_run("vllm_tp", "vllm is not installed (pip install 'mmprm[vllm]')")
    if gpus < 2:
        # nothing a single-GPU machine could run: not a gap in the check, so not a failure either
        return {"ok": True, "not_applicable": f"tensor_parallel_size=2 needs 2 GPUs, {gpus} visible"}
    from mmprm.models.tiny import VLLM_HEAD_DIM, build_tiny_model

    # 4 heads, 2 KV heads: both split over 2 GPUs
    model = build_tiny_model("qwen2", root / "vllm_tp_model", seed=0, hidden_size=256, head_dim=VLLM_HEAD_DIM)
    out = root / "vllm_tp"
    out.mkdir(exist_ok=True)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(visible.split(",")[:2]) if visible else "0,1"}
    cmd = [sys.executable, __file__, "--vllm-tp-worker", str(model), "--out", str(out)]
    t0 = time.time()
    try:
        res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout}s"}
    report = out / "tp.json"
    if res.returncode != 0 or not report.exists():
        return {"ok": False, "error": (res.stdout + res.stderr)[-1500:]}
    tp = json.loads(report.read_text())
    return {"seconds": round(time.time() - t0, 1), **tp, "ok": tp["generated_tokens"] > 0}


def vllm_tp_worker(model: str, out: Path) -> None:
    """The engine of `vllm_tensor_parallel`: tensor_parallel_size=2, generate, report."""
    from mmprm.generation.base import RolloutRequest, SamplingConfig
    from mmprm.generation.vllm import VLLMBackend

    backend = VLLMBackend(
        model,
        SamplingConfig(max_new_tokens=16, seed=0),
        dtype="bfloat16",
        max_model_len=512,
        gpu_memory_utilization=0.2,
        enforce_eager=True,
        tensor_parallel_size=2,
    )
    backend.generate([RolloutRequest(f"p{i}", "What is 2 + 3?", [], [], 4) for i in range(8)])
    report = {"tensor_parallel_size": 2, "generated_tokens": backend.stats.generated_tokens}
    backend.close()
    (out / "tp.json").write_text(json.dumps(report))


def vllm_worker(model: str, out: Path) -> None:
    """One torchrun rank of `vllm_engines`: pin this rank's GPU, start an engine, generate."""
    from mmprm.generation.base import RolloutRequest, SamplingConfig
    from mmprm.generation.vllm import VLLMBackend, pin_local_gpu

    pin_local_gpu()
    import torch

    rank = os.environ["LOCAL_RANK"]
    backend = VLLMBackend(
        model,
        SamplingConfig(max_new_tokens=16, seed=int(rank)),
        dtype="bfloat16",
        max_model_len=512,
        gpu_memory_utilization=0.2,
        enforce_eager=True,
    )
    backend.generate([RolloutRequest(f"p{i}", "What is 2 + 3?", [], [], 4) for i in range(8)])
    report = {
        "rank": rank,
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "device_uuid": str(torch.cuda.get_device_properties(0).uuid),
        "generated_tokens": backend.stats.generated_tokens,
    }
    backend.close()
    (out / f"rank{rank}.json").write_text(json.dumps(report))


def layer_memory(tokens: int, device: str, width: dict[str, int]) -> dict[str, Any]:
    """Peak memory of training a Qwen2.5-VL-7B-shaped decoder stack on one `tokens`-long sequence
    (bf16, gradient checkpointing), at 1 and 2 layers, extrapolated to the model's 28."""
    import torch
    from transformers import Qwen2Config, Qwen2Model

    peaks, seconds = {}, {}
    for layers in (1, 2):
        config = Qwen2Config(
            vocab_size=1024,  # the 152k embedding is the same at any depth: left out of the per-layer figure
            hidden_size=width["hidden"],
            intermediate_size=width["mlp"],
            num_attention_heads=width["heads"],
            num_key_value_heads=width["kv_heads"],
            num_hidden_layers=layers,
            max_position_embeddings=max(tokens, 32768),
        )
        model = Qwen2Model(config).to(device=device, dtype=torch.bfloat16)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        ids = torch.randint(0, 1024, (1, tokens), device=device)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.time()
        model(input_ids=ids).last_hidden_state.float().pow(2).mean().backward()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            peaks[layers] = (torch.cuda.max_memory_allocated() - base) / 2**30
        seconds[layers] = round(time.time() - t0, 2)
        del model, ids
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    result: dict[str, Any] = {"tokens": tokens, **{f"seconds_{k}_layers": v for k, v in seconds.items()}}
    if peaks:
        per_layer = peaks[2] - peaks[1]
        result.update(
            peak_gib_1_layer=round(peaks[1], 2),
            per_layer_gib=round(per_layer, 3),
            estimated_gib_28_layers=round(peaks[1] + 27 * per_layer, 1),
        )
    result["ok"] = all(v > 0 for v in seconds.values())
    return result


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="checks (names for --skip): " + "; ".join(f"{k}: {v}" for k, v in CHECKS.items()),
    )
    parser.add_argument("--processes", type=int, default=None, help="GPUs to use (default: every visible one)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per training run (default 30)")
    parser.add_argument("--rows", type=int, default=256, help="training rows (default 256)")
    parser.add_argument("--hidden-size", type=int, default=512, help="tiny model width (default 512)")
    parser.add_argument("--probe-tokens", type=int, default=4096, help="sequence of the memory probe (default 4096)")
    parser.add_argument(
        "--probe-divisor", type=int, default=1, help="divide the probe's 7B widths by this (CPU test only)"
    )
    parser.add_argument("--timeout", type=int, default=200, help="seconds per training run (default 200)")
    parser.add_argument("--out", default=None, help="working folder (default: a temporary one)")
    parser.add_argument("--allow-cpu", action="store_true", help="run on CPU anyway (for this script's own test)")
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        metavar="NAME[,NAME]",
        help=f"do not run these checks, and do not count them as failed (one of: {', '.join(CHECKS)})",
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME[,NAME]",
        help="run only these checks (a group), the others as if skipped: so that a timeout of one group "
        "loses that group's JSON line only (benchmarks/gpu_lease_check.sh runs the check so)",
    )
    parser.add_argument("--vllm-worker", default=None, help=argparse.SUPPRESS)  # a torchrun rank of the vLLM check
    parser.add_argument("--vllm-tp-worker", default=None, help=argparse.SUPPRESS)  # the TP=2 engine
    args = parser.parse_args(argv)
    if args.vllm_worker:
        vllm_worker(args.vllm_worker, Path(args.out))
        return 0
    if args.vllm_tp_worker:
        vllm_tp_worker(args.vllm_tp_worker, Path(args.out))
        return 0
    try:
        skip = parse_skip(args.skip)
        only = parse_only(args.only)
    except ValueError as e:
        print(f"gpu-check: {e}", file=sys.stderr)
        return 2

    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        print(
            f"gpu-check: no CUDA GPU visible (torch {torch.__version__}, torch.cuda.is_available() is False). "
            "Run `make gpu-check` on a GPU machine with a CUDA build of torch (a CUDA 13 build needs driver "
            ">= 580); nothing was checked.",
            file=sys.stderr,
        )
        return 2
    try:
        import deepspeed
    except ImportError:
        print("gpu-check: deepspeed is not installed: pip install 'mmprm[deepspeed]'", file=sys.stderr)
        return 2
    from mmprm.models.tiny import build_tiny_model

    if only:
        skip |= set(CHECKS) - only
    t_start = time.time()
    if args.processes is None:
        args.processes = max(1, torch.cuda.device_count())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    root = Path(args.out or tempfile.mkdtemp(prefix="mmprm_gpu_check_"))
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "gpus": torch.cuda.device_count(),
        "processes": args.processes,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "deepspeed": deepspeed.__version__,
        "steps": args.steps,
        "only": sorted(only),
        "skipped_by_user": sorted(skip),
    }

    def run(name: str, check: Any, *check_args: Any) -> dict[str, Any] | None:
        if name in skip:
            result[name] = {"ok": True, "skipped": "--skip"}
            return None
        result[name] = check(*check_args)
        return result[name]

    # what `model.attn_implementation=auto` picks where flash-attn works; sdpa where it does not
    flash = run("flash_attn", flash_attn_check, device)
    attn = "flash_attention_2" if flash and flash["ok"] else "sdpa"
    result["attn_implementation"] = attn
    if {"zero2", "zero3", "zero3_packed"} - skip:
        build_tiny_model("qwen2_5_vl", root / "model", seed=0, hidden_size=args.hidden_size, num_layers=4)
    model = root / "model"
    train_file = write_step_data(root / "data", args.rows, 0, "train")
    eval_file = write_step_data(root / "data", 32, 1, "eval")
    tree_file = write_tree_data(root / "data", max(8, args.rows // 3), 2)
    checkpointing = ("model.gradient_checkpointing=true",)
    packed = ("data.pack_trees=true", *checkpointing)
    run("zero2", train, 2, model, train_file, eval_file, root / "zero2", args, attn)
    zero3 = run("zero3", train, 3, model, train_file, eval_file, root / "zero3", args, attn, checkpointing)
    run("zero3_packed", train, 3, model, tree_file, eval_file, root / "packed", args, "sdpa", packed)
    if device == "cuda":
        internvl = root / "internvl"
        if "zero3_packed_flex" not in skip:
            build_tiny_model("internvl", internvl, seed=0, hidden_size=args.hidden_size, num_layers=4)
        run(
            "zero3_packed_flex",
            train,
            3,
            internvl,
            tree_file,
            eval_file,
            root / "packed_flex",
            args,
            "flex_attention",
            packed,
        )
    else:
        run("zero3_packed_flex", cannot_run, "zero3_packed_flex", "no GPU: FlexAttention has no backward on CPU")
    if zero3 is not None and zero3["ok"]:
        run("scorer", score, root / "zero3", eval_file, device, attn, 3)
    elif "scorer" not in skip:
        result["scorer"] = cannot_run("scorer", "the ZeRO-3 run it scores did not pass")
    run("scoring_throughput", scoring_throughput, device, args.timeout * 2)
    if device == "cuda":
        run("vllm", vllm_engines, root, args.processes, args.timeout)
        run("vllm_tp", vllm_tensor_parallel, root, torch.cuda.device_count(), args.timeout * 2)
        run("vllm_scorer", vllm_scorer, args.timeout * 2)
    else:
        for name in ("vllm", "vllm_tp", "vllm_scorer"):
            run(name, cannot_run, name, "no GPU: vLLM's CUDA engine is not started")
    divisor = args.probe_divisor
    width = {"hidden": 3584 // divisor, "mlp": 18944 // divisor, "heads": 28, "kv_heads": 4}
    run("memory_7b_layer", layer_memory, args.probe_tokens, device, width)
    result["seconds"] = round(time.time() - t_start, 1)
    result["failed"] = verdict(result, skip)
    result["ok"] = not result["failed"]
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
