"""`train.compile`: steps/s of `recipes/prm_train.py` with and without compiled decoder layers.

    python benchmarks/compile_training.py                       # tiny Qwen2, hidden 256, 4 layers
    python benchmarks/compile_training.py --hidden 64 --layers 2 --steps 12 --rounds 1   # test size
    python benchmarks/compile_training.py --quick               # smoke test

Both runs are the recipe itself (a subprocess each, as a user runs it) on the same synthetic
step-labelled rows (`prm_train_throughput.write_rows`), batch 8, fp32, the same seed. A step's
time is the `step_s` the recipe logs. The first step of the compiled run pays the compile (and
each new shape class may add one); the steady rate is the median over the steps after
`--warmup`. The sides alternate for `--rounds` rounds and each keeps its best round (the machine
is shared). Prints ONE JSON line, with the two runs' losses (the same within float error).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from prm_train_throughput import write_rows  # noqa: E402


def run(model: Path, data: Path, out: Path, a: argparse.Namespace, compile: bool) -> dict:
    """One prm_train run; its per-step seconds, losses and wall time."""
    cmd = [
        sys.executable, str(REPO / "recipes" / "prm_train.py"),
        f"model.name_or_path={model}", f"data.train_file={data}", f"output_dir={out}",
        f"train.max_steps={a.steps}", "train.batch_size=8", "train.lr=1e-4", "train.log_every=1",
        f"train.save_every={a.steps}", f"train.eval_every={a.steps}", "data.max_length=512",
        "train.report_to=none", "train.prefetch_batches=false", f"train.compile={str(compile).lower()}",
    ]  # fmt: skip
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise RuntimeError(f"prm_train (compile={compile}) failed:\n{res.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["split"] == "train"]
    steady = [r["step_s"] for r in rows[a.warmup :]]
    return {
        "first_step_s": round(rows[0]["step_s"], 3),
        "median_step_s": round(statistics.median(steady), 4),
        "steps_per_s": round(1 / statistics.median(steady), 3),
        "wall_s": round(wall, 1),
        "losses": [r["loss"] for r in rows],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the steady rate")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="hidden 64, 2 layers, 4 steps, 1 round")
    a = p.parse_args()
    if a.quick:
        a.hidden, a.layers, a.steps, a.warmup, a.rounds = 64, 2, 4, 1, 1
    from mmprm.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = build_tiny_model("qwen2", tmp / "model", hidden_size=a.hidden, num_layers=a.layers)
        data = write_rows(tmp / "rows.jsonl", 8 * a.steps)
        best: dict[str, dict] = {}
        for r in range(a.rounds):
            for side in ("eager", "compiled"):
                res = run(model, data, tmp / f"{side}{r}", a, compile=side == "compiled")
                if side not in best or res["median_step_s"] < best[side]["median_step_s"]:
                    best[side] = res
        eager, compiled = best["eager"], best["compiled"]
        diff = max(abs(x - y) for x, y in zip(eager.pop("losses"), compiled.pop("losses"), strict=True))
        print(
            json.dumps(
                {
                    "model": f"tiny qwen2, hidden {a.hidden}, {a.layers} layers",
                    "steps": a.steps,
                    "eager": eager,
                    "compiled": compiled,
                    "ratio_steps_per_s_compiled_vs_eager": round(compiled["steps_per_s"] / eager["steps_per_s"], 3),
                    "max_loss_diff": diff,
                }
            )
        )


if __name__ == "__main__":
    main()
