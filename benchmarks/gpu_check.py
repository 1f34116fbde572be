"""GPU check: bf16 PRM training under DeepSpeed ZeRO-2 and ZeRO-3, the attention kernel, the scorer.

    make gpu-check                                   # one GPU, under 8 minutes
    python benchmarks/gpu_check.py --processes 8     # every GPU of the node

What a first GPU run of mmprm must show before a 7B job is trusted, on a tiny random-init
Qwen2.5-VL (hidden 512, 4 layers; nothing is downloaded) whose embeddings and LM head
(1025 x 512) pass ZeRO-3's persistence threshold, so ZeRO-3 really partitions them:

- `recipes/prm_train.py` through `accelerate launch --config_file launch/accelerate/deepspeed_zero{2,3}.yaml
  --mixed_precision bf16` with bf16 weights and `model.attn_implementation=auto` (flash_attention_2
  when flash-attn is installed, else sdpa): the loss falls and stays finite;
- the saved PRM, loaded with `mmprm.load_prm` in bf16 on the GPU, scores the eval rows as the
  trained model did in memory, and returns float32 probabilities;
- scorer throughput (steps per second).

Prints ONE JSON line; exit 0 when every check passed, 1 when one failed, 2 when there is no CUDA
GPU (the check does not run on CPU; `--allow-cpu` exists for the CPU test of this script only).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(
    stage: int, model: Path, train_file: Path, eval_file: Path, out: Path, args: argparse.Namespace, attn: str
) -> dict[str, Any]:
    """One bf16 prm_train run under ZeRO-`stage`; its losses, time and (ZeRO-3) partition sizes."""
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


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, default=1, help="GPUs to train on (default 1)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per ZeRO stage (default 30)")
    parser.add_argument("--rows", type=int, default=256, help="training rows (default 256)")
    parser.add_argument("--hidden-size", type=int, default=512, help="tiny model width (default 512)")
    parser.add_argument("--timeout", type=int, default=200, help="seconds per training run (default 200)")
    parser.add_argument("--out", default=None, help="working folder (default: a temporary one)")
    parser.add_argument("--allow-cpu", action="store_true", help="run on CPU anyway (for this script's own test)")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        print(
            f"gpu-check: no CUDA GPU visible (torch {torch.__version__}, torch.cuda.is_available() is False). "
            "Run `make gpu-check` on a GPU machine with a CUDA build of torch; nothing was checked.",
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
    attn = resolve_attn_implementation("auto")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    root = Path(args.out or tempfile.mkdtemp(prefix="mmprm_gpu_check_"))
    model = build_tiny_model("qwen2_5_vl", root / "model", seed=0, hidden_size=args.hidden_size, num_layers=4)
    train_file = write_step_data(root / "data", args.rows, 0, "train")
    eval_file = write_step_data(root / "data", 32, 1, "eval")
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "processes": args.processes,
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "attn_implementation": attn,
        "steps": args.steps,
    }
    for stage in (2, 3):
        result[f"zero{stage}"] = train(stage, model, train_file, eval_file, root / f"zero{stage}", args, attn)
    if result["zero3"]["ok"]:
        result["scorer"] = score(root / "zero3", eval_file, device, attn, repeats=3)
    result["seconds"] = round(time.time() - t_start, 1)
    result["ok"] = all(result.get(k, {"ok": False})["ok"] for k in ("zero2", "zero3", "scorer"))
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
