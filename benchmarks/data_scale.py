"""PRM training at growing data sizes: does memory stay flat, and does a rerun skip tokenization?

    python benchmarks/data_scale.py              # 2k and 32k rows (2 min on 2 idle cores)
    python benchmarks/data_scale.py --sizes 2000,32000,128000   # the table in docs/scaling.md (8 min)
    python benchmarks/data_scale.py --quick      # smoke test (200 and 800 rows)
    python benchmarks/data_scale.py --num-proc 8 --sizes 2000,32000,256000

Writes step-labelled multimodal JSONL files of each size (negative paths included) whose rows point
at a pool of synthetic 640x480 JPEGs (shared by path to save disk; the collator opens each row's
image itself). Rows are shaped like real step-labelled data (`--rows realistic`, the default): a
15-30 word question and 8-16 steps of 6-18 words, around PRMBench's medians (22-word question,
12 steps of 12 words, 204 words a row, measured on its 394 rows); `--rows short` writes the
shorter rows of earlier versions (10-word question, 2-6 steps of 6-24 words). It builds the tiny
Qwen2-VL preset, and for each size runs the real `recipes/prm_train.py` as a subprocess twice: a first run that builds the tokenization cache, then
a rerun on the same cache. For each it reports, side by side:

  peak RSS      of the training process (psutil, polled every 20 ms); `peak_rss_tree_mib` adds
                its tokenization workers (forked: pages they share with it count once per process);
                `peak_anon_mib` is the part not backed by a file (Linux RssAnon): RSS also counts
                the pages of the memory-mapped cache that batches have read, which the kernel
                drops under pressure and which grow with the rows touched, not with the dataset
  first step    seconds from launching the process to its first optimizer step (metrics.jsonl)
  data_s        of which the data phase: tokenizing into the cache, or opening it (the recipe's
                `data` metrics row)
  steps/s       optimizer steps per second after the first (images opened per micro-batch)

Baseline: the eager data path the recipe had before (`--eager-sizes`, smaller sizes, as it holds
every row's pixel_values): all rows tokenized up front in one process with their images, kept in a
list, then the same first optimizer step. Prints ONE JSON line with the ratios:
peak RSS largest/smallest size (aim <= 1.25) and cached rerun / first run time to first step at the
largest size (aim < 0.10).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WORDS = (
    "we add the two numbers then multiply by three so the total is and the answer follows since each "
    "side of the square has length four which gives area perimeter bar chart shows"
).split()


def write_images(folder: Path, count: int, size: tuple[int, int], seed: int = 0) -> list[Path]:
    """`count` JPEGs of `size`: smooth colour gradients with noise, like photos or charts in size on disk."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w]
    paths = []
    for i in range(count):
        base = rng.uniform(0, 255, 3)
        grad = xx[..., None] * rng.uniform(-0.2, 0.2, 3) + yy[..., None] * rng.uniform(-0.2, 0.2, 3)
        pixels = np.clip(base + grad + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)
        path = folder / f"img_{i:03d}.jpg"
        Image.fromarray(pixels).save(path, quality=90)
        paths.append(path)
    return paths


# (question words, steps, words per step), each drawn uniformly from its range
ROW_SHAPES = {"realistic": ((15, 30), (8, 16), (6, 18)), "short": ((10, 10), (2, 6), (6, 24))}


def write_rows(path: Path, n: int, images: list[Path], seed: int = 0, shape: str = "realistic") -> Path:
    """n step-labelled rows of `ROW_SHAPES[shape]`, every other path negative from a random step on."""
    rng = random.Random(seed)
    question_words, num_steps, step_words = ROW_SHAPES[shape]
    with open(path, "w") as f:
        for i in range(n):
            k = rng.randint(*num_steps)
            steps = [
                " ".join(rng.choice(WORDS) for _ in range(rng.randint(*step_words))) + f" = {rng.randint(0, 99)}."
                for _ in range(k)
            ]
            wrong = rng.randrange(k) if i % 2 else None
            labels = [round(rng.uniform(0.0, 0.3), 2) if wrong is not None and j >= wrong else 1.0 for j in range(k)]
            f.write(
                json.dumps(
                    {
                        "id": f"r{i}",
                        "images": [str(images[i % len(images)])],
                        "question": f"Problem {i}: "
                        + " ".join(rng.choice(WORDS) for _ in range(rng.randint(*question_words)))
                        + "?",
                        "steps": steps,
                        "labels": labels,
                    }
                )
                + "\n"
            )
    return path


def rss_anon(pid: int) -> int:
    """Resident memory not backed by a file, in bytes (Linux /proc; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def watch(cmd: list[str], env: dict[str, str], metrics: Path, log: Path) -> dict[str, Any]:
    """Run `cmd`, polling its RSS (alone and with its children) and its metrics file."""
    import psutil

    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        ps = psutil.Process(proc.pid)
        peak = peak_tree = peak_anon = 0
        first_step = None
        while proc.poll() is None:
            try:
                rss = ps.memory_info().rss
                tree = rss + sum(c.memory_info().rss for c in ps.children(recursive=True))
            except psutil.Error:  # a worker exited between listing and reading
                rss = tree = 0
            peak, peak_tree, peak_anon = max(peak, rss), max(peak_tree, tree), max(peak_anon, rss_anon(proc.pid))
            if first_step is None and metrics.is_file() and '"split": "train"' in metrics.read_text():
                first_step = time.perf_counter() - t0
            time.sleep(0.02)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed ({proc.returncode}):\n{log.read_text()[-3000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    data = next((r for r in rows if r["split"] == "data"), {})
    # steps/s after the first step (which pays one-off warm-up), from the recipe's own clock
    rate = (train[-1]["step"] - train[0]["step"]) / max(1e-9, train[-1]["seconds"] - train[0]["seconds"])
    return {
        "peak_rss_mib": round(peak / 2**20),
        "peak_rss_tree_mib": round(peak_tree / 2**20),
        "peak_anon_mib": round(peak_anon / 2**20),
        "first_step_s": round(first_step if first_step is not None else time.perf_counter() - t0, 2),
        "steps_per_s": round(rate, 3),
        "wall_s": round(time.perf_counter() - t0, 1),
        "data_s": data.get("seconds"),
        "cache_reused": bool(data.get("reused")),
        "rows_kept": data.get("kept"),
    }


def run_recipe(
    model: Path, data: Path, out: Path, cache: Path, a: argparse.Namespace, env: dict[str, str]
) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        str(REPO / "recipes" / "prm_train.py"),
        f"model.name_or_path={model}",
        f"data.train_file={data}",
        f"output_dir={out}",
        f"train.max_steps={a.steps}",
        f"train.batch_size={a.batch_size}",
        "train.log_every=1",
        f"train.save_every={10**9}",
        "train.report_to=none",
        f"data.max_length={a.max_length}",
        f"data.num_proc={a.num_proc}",
        f"data.cache_dir={cache}",
    ]
    res = watch(cmd, env, out / "metrics.jsonl", out / "log.txt")
    return res


def eager_child(a: argparse.Namespace) -> None:
    """The baseline: the recipe's data path before streaming. Every row tokenized up front with its
    images and kept (pixel_values included), then one optimizer step like the recipe's first."""
    import torch

    from mmprm.data.schema import load_examples, load_image
    from mmprm.models.loading import load_backbone
    from mmprm.models.prm import PRMSpec, build_prm
    from mmprm.scoring.losses import soft_ce_token_pair
    from mmprm.steps import tokenize_steps
    from mmprm.training.collate import collate_steps, model_input_keys

    t0 = time.perf_counter()
    backbone, processor = load_backbone(a.model, dtype=torch.float32)
    model = build_prm(backbone, processor, PRMSpec())
    data = []
    for ex in load_examples(a.data, require_labels=True):
        tok = tokenize_steps(
            processor, ex.question, ex.steps, [load_image(p) for p in ex.images], ex.labels, a.max_length
        )
        if tok is not None:
            data.append(tok)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    batch = collate_steps(data[: a.batch_size], processor.tokenizer.pad_token_id)
    logits = model(batch["input_ids"], batch["attention_mask"], batch["step_mask"], **model_input_keys(batch))
    soft_ce_token_pair(logits, batch["targets"]).backward()
    optimizer.step()
    print(json.dumps({"rows": len(data), "in_process_first_step_s": time.perf_counter() - t0}))


def run_eager(model: Path, data: Path, out: Path, a: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    import psutil

    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        __file__,
        "--_eager",
        "--model",
        str(model),
        "--data",
        str(data),
        "--batch-size",
        str(a.batch_size),
        "--max-length",
        str(a.max_length),
    ]
    t0 = time.perf_counter()
    log = out / "log.txt"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        ps, peak = psutil.Process(proc.pid), 0
        while proc.poll() is None:
            try:
                peak = max(peak, ps.memory_info().rss)
            except psutil.Error:
                pass
            time.sleep(0.02)
    if proc.returncode != 0:
        raise RuntimeError(f"eager baseline failed ({proc.returncode}):\n{log.read_text()[-3000:]}")
    return {"peak_rss_mib": round(peak / 2**20), "first_step_s": round(time.perf_counter() - t0, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="2000,32000", help="row counts, comma-separated")
    ap.add_argument("--eager-sizes", default="500,2000", help="row counts for the eager baseline ('' to skip)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--rows", choices=sorted(ROW_SHAPES), default="realistic", help="row shape (see above)")
    ap.add_argument("--num-proc", type=int, default=2, help="tokenization workers of the recipe")
    ap.add_argument("--image-size", default="640x480")
    ap.add_argument("--images", type=int, default=64, help="distinct image files the rows point at")
    ap.add_argument("--keep", help="work folder to keep (default: a temporary one, removed)")
    ap.add_argument("--quick", action="store_true", help="200 and 800 rows, 4 steps, eager 100 and 200")
    ap.add_argument("--_eager", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._eager:
        return eager_child(a)
    if a.quick:
        a.sizes, a.eager_sizes, a.steps, a.images = "200,800", "100,200", 4, 8
    sizes = [int(s) for s in a.sizes.split(",")]
    eager_sizes = [int(s) for s in a.eager_sizes.split(",") if s]
    w, h = (int(x) for x in a.image_size.split("x"))
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "PYTHONWARNINGS": "ignore",
    }

    from mmprm.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="data_scale_") as tmp:
        work = Path(a.keep) if a.keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = build_tiny_model("qwen2_vl", work / "model", seed=0)
        images = write_images(work / "images", a.images, (w, h))
        results: dict[str, Any] = {}
        for n in sizes:
            data = write_rows(work / f"rows_{n}.jsonl", n, images, shape=a.rows)
            cache = work / f"cache_{n}"
            first = run_recipe(model, data, work / f"run_{n}_first", cache, a, env)
            again = run_recipe(model, data, work / f"run_{n}_cached", cache, a, env)
            assert not first["cache_reused"] and again["cache_reused"], (first, again)
            results[str(n)] = {"first_run": first, "cached_rerun": again}
            print(f"{n} rows: {json.dumps(results[str(n)])}", file=sys.stderr)
        eager: dict[str, Any] = {}
        for n in eager_sizes:
            data = work / f"rows_{n}.jsonl"
            if not data.exists():
                write_rows(data, n, images, shape=a.rows)
            eager[str(n)] = run_eager(model, data, work / f"eager_{n}", a, env)
            print(f"eager {n} rows: {json.dumps(eager[str(n)])}", file=sys.stderr)

    small, large = results[str(sizes[0])], results[str(sizes[-1])]
    out: dict[str, Any] = {
        "benchmark": "data_scale",
        "model": "tiny qwen2_vl",
        "image_size": a.image_size,
        "rows": a.rows,
        "max_length": a.max_length,
        "steps": a.steps,
        "batch_size": a.batch_size,
        "num_proc": a.num_proc,
        "streamed": results,
        "ratio_peak_rss_largest_vs_smallest": round(
            large["first_run"]["peak_rss_mib"] / small["first_run"]["peak_rss_mib"], 3
        ),
        "ratio_peak_rss_cached_largest_vs_smallest": round(
            large["cached_rerun"]["peak_rss_mib"] / small["cached_rerun"]["peak_rss_mib"], 3
        ),
        "ratio_peak_anon_largest_vs_smallest": round(
            large["first_run"]["peak_anon_mib"] / max(1, small["first_run"]["peak_anon_mib"]), 3
        ),
        "ratio_peak_anon_cached_largest_vs_smallest": round(
            large["cached_rerun"]["peak_anon_mib"] / max(1, small["cached_rerun"]["peak_anon_mib"]), 3
        ),
        "ratio_first_step_cached_vs_first_run": round(
            large["cached_rerun"]["first_step_s"] / large["first_run"]["first_step_s"], 3
        ),
        # the data phase alone (tokenizing vs opening the cache), without interpreter and imports
        "ratio_data_s_cached_vs_first_run": round(large["cached_rerun"]["data_s"] / large["first_run"]["data_s"], 4),
        "aims": {"ratio_peak_rss_largest_vs_smallest": "<= 1.25", "ratio_first_step_cached_vs_first_run": "< 0.10"},
        # the same three ratios at every size (the aims are stated at 32k against 2k)
        "ratios_by_size": {
            n: {
                "peak_rss_vs_smallest": round(r["first_run"]["peak_rss_mib"] / small["first_run"]["peak_rss_mib"], 3),
                "peak_anon_vs_smallest": round(
                    r["first_run"]["peak_anon_mib"] / max(1, small["first_run"]["peak_anon_mib"]), 3
                ),
                "first_step_cached_vs_first_run": round(
                    r["cached_rerun"]["first_step_s"] / r["first_run"]["first_step_s"], 3
                ),
            }
            for n, r in results.items()
        },
    }
    if eager:
        lo, hi = eager[str(eager_sizes[0])], eager[str(eager_sizes[-1])]
        per_row_kib = (hi["peak_rss_mib"] - lo["peak_rss_mib"]) * 1024 / max(1, eager_sizes[-1] - eager_sizes[0])
        out["eager_baseline"] = {**eager, "rss_kib_per_row": round(per_row_kib, 1)}
        same = str(eager_sizes[-1])
        if same in results:  # same rows, both paths: the eager path's peak over the streamed one's
            out["ratio_peak_rss_eager_vs_streamed_at_" + same] = round(
                eager[same]["peak_rss_mib"] / results[same]["first_run"]["peak_rss_mib"], 3
            )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
