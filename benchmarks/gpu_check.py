"""GPU check: what a first GPU run of mmprm must show before a 7B job is trusted.

    make gpu-check                                   # every visible GPU, under 10 minutes on 8
    python benchmarks/gpu_check.py --processes 1     # one GPU

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
- one tiny vLLM engine per GPU under torchrun (`mmprm.generation.vllm.pin_local_gpu`):
  each rank's engine on a GPU of its own, each generating (skipped, saying so, without vllm);
- the vLLM scorer (`scoring.backend=vllm`) beside the HF scorer on one GPU in bf16
  (`benchmarks/prm_vllm_scoring.py`): both scorers' steps/s, and their scores agree;
- the memory of one decoder layer shaped as Qwen2.5-VL-7B's language model (hidden 3584, 28
  heads of 128, 4 KV heads, MLP 18944) training on one 4096-token sequence in bf16 with gradient
  checkpointing, measured at 1 and 2 layers and extrapolated to the model's 28 (weights, gradients
  and activations; optimizer states are ZeRO's, see the memory table in docs/scaling.md).

Prints ONE JSON line; exit 0 when every check passed, 1 when one failed, 2 when there is no CUDA
GPU (the check does not run on CPU; `--allow-cpu` exists for the CPU test of this script only).
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
        return {"ok": True, "skipped": "vllm is not installed (pip install 'mmprm[vllm]' to check it)"}
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


def vllm_scorer(timeout: int) -> dict[str, Any]:
    """The vLLM scorer and the HF scorer side by side on one GPU, bf16
    (`benchmarks/prm_vllm_scoring.py`): both steps/s, and the scores agree."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return {"ok": True, "skipped": "vllm is not installed (pip install 'mmprm[vllm]' to check it)"}
    cmd = [sys.executable, str(REPO / "benchmarks" / "prm_vllm_scoring.py"), "--device", "cuda", "--dtype", "bfloat16"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}
    try:
        res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False, env=env)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout}s"}
    lines = [line for line in res.stdout.splitlines() if line.startswith("{")]
    if res.returncode != 0 or not lines:
        return {"ok": False, "error": (res.stdout + res.stderr)[-1500:]}
    bench = json.loads(lines[-1])
    return {**bench, "ok": bench["max_abs_score_diff"] <= 2e-2}


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
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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
    parser.add_argument("--vllm-worker", default=None, help=argparse.SUPPRESS)  # a torchrun rank of the vLLM check
    args = parser.parse_args(argv)
    if args.vllm_worker:
        vllm_worker(args.vllm_worker, Path(args.out))
        return 0

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
    from mmprm.models.loading import resolve_attn_implementation
    from mmprm.models.tiny import build_tiny_model

    t_start = time.time()
    if args.processes is None:
        args.processes = max(1, torch.cuda.device_count())
    attn = resolve_attn_implementation("auto")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    root = Path(args.out or tempfile.mkdtemp(prefix="mmprm_gpu_check_"))
    model = build_tiny_model("qwen2_5_vl", root / "model", seed=0, hidden_size=args.hidden_size, num_layers=4)
    train_file = write_step_data(root / "data", args.rows, 0, "train")
    eval_file = write_step_data(root / "data", 32, 1, "eval")
    tree_file = write_tree_data(root / "data", max(8, args.rows // 3), 2)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "processes": args.processes,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "deepspeed": deepspeed.__version__,
        "attn_implementation": attn,
        "steps": args.steps,
    }
    checkpointing = ("model.gradient_checkpointing=true",)
    result["zero2"] = train(2, model, train_file, eval_file, root / "zero2", args, attn)
    result["zero3"] = train(3, model, train_file, eval_file, root / "zero3", args, attn, checkpointing)
    packed = ("data.pack_trees=true", *checkpointing)
    result["zero3_packed"] = train(3, model, tree_file, eval_file, root / "packed", args, "sdpa", packed)
    if device == "cuda":
        internvl = build_tiny_model("internvl", root / "internvl", seed=0, hidden_size=args.hidden_size, num_layers=4)
        flex = ("data.pack_trees=true", *checkpointing)
        result["zero3_packed_flex"] = train(
            3, internvl, tree_file, eval_file, root / "packed_flex", args, "flex_attention", flex
        )
    else:
        result["zero3_packed_flex"] = {"ok": True, "skipped": "no GPU: FlexAttention has no backward on CPU"}
    if result["zero3"]["ok"]:
        result["scorer"] = score(root / "zero3", eval_file, device, attn, repeats=3)
    result["vllm"] = (
        vllm_engines(root, args.processes, args.timeout)
        if device == "cuda"
        else {"ok": True, "skipped": "no GPU: vLLM's CUDA engine is not started"}
    )
    result["vllm_scorer"] = (
        vllm_scorer(args.timeout * 2)
        if device == "cuda"
        else {"ok": True, "skipped": "no GPU: vLLM's CUDA engine is not started"}
    )
    divisor = args.probe_divisor
    width = {"hidden": 3584 // divisor, "mlp": 18944 // divisor, "heads": 28, "kv_heads": 4}
    result["memory_7b_layer"] = layer_memory(args.probe_tokens, device, width)
    result["seconds"] = round(time.time() - t_start, 1)
    checks = ("zero2", "zero3", "zero3_packed", "zero3_packed_flex", "scorer", "vllm", "vllm_scorer", "memory_7b_layer")
    result["ok"] = all(result.get(k, {"ok": False})["ok"] for k in checks)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
