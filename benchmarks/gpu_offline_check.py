"""Rehearse the lent GPU machine here, offline: the carried wheels and mmprm on the image's versions.

    python benchmarks/gpu_offline_check.py                     # both parts; downloads .whl if absent
    python benchmarks/gpu_offline_check.py --only wheels --keep runs/offline

Two parts, ONE JSON line:
- `wheels`: a scratch Python 3.12 venv (pyenv's), given the image's versions of what the image holds
  (`benchmarks/gpu_image.txt`, from PyPI, no torch), then `gpu_wheels.sh install` with
  PIP_NO_INDEX=1, so nothing but the carried files comes in; `pip check` must name nothing but torch
  and triton (the image's, not in this venv), and the carried packages must import.
- `transformers_517`: this environment's CPU torch with transformers 5.17 (the image's) laid over
  it: a tiny model trains 3 PRM steps through `recipes/prm_train.py`, and `load_prm` scores.
Exit 0 when both pass.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
PYTHON_312 = Path(os.environ.get("PYTHON_312", "/root/.pyenv/versions/3.12.1/bin/python3"))
IMAGE_TRANSFORMERS = "5.17.0"
# transformers 5.17 wants huggingface_hub below 2 and imports httpx: the image's versions of both
OVERLAY_EXTRAS = ["huggingface_hub==1.33.0", "httpx==0.28.1", "httpcore==1.0.9", "h11==0.16.0", "anyio==4.15.1"]
# the carried packages that import without torch (deepspeed and liger-kernel need it)
CARRIED_IMPORTS = ["datasets", "math_verify", "pydantic", "latex2sympy2_extended", "hjson", "multiprocess", "dill"]


def sh(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=False, **kwargs)


def image_pins() -> list[str]:
    lines = (REPO / "benchmarks" / "gpu_image.txt").read_text().splitlines()
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]


def check_wheels(wheels: Path, work: Path) -> dict:
    """The scratch 3.12 venv: the image's versions, then the carried wheels with no index."""
    if not PYTHON_312.exists():
        return {"ok": False, "error": f"no Python 3.12 at {PYTHON_312} (set PYTHON_312)"}
    venv = work / "py312"
    shutil.rmtree(venv, ignore_errors=True)
    t0 = time.time()
    made = sh([str(PYTHON_312), "-m", "venv", str(venv)])
    py = str(venv / "bin" / "python")
    image = made.returncode == 0 and sh([py, "-m", "pip", "install", "-q", "--no-deps", *image_pins()])
    if not image or image.returncode != 0:
        return {
            "ok": False,
            "error": "the image's versions did not install: " + (made.stderr + (image and image.stderr or ""))[-1500:],
        }
    image_s = time.time() - t0
    t0 = time.time()
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "", "PIP_CONFIG_FILE": os.devnull}
    carried = sh(["bash", str(REPO / "benchmarks" / "gpu_wheels.sh"), "install", str(wheels), py], env=env)
    install_s = time.time() - t0
    check = sh([py, "-m", "pip", "check"]).stdout.splitlines()
    # torch and triton are the image's own: absent here, so every line naming them is expected
    other = [line for line in check if "torch" not in line.split(" requires ")[-1] and "triton" not in line]
    other = [line for line in other if line.strip() and not line.startswith("No broken")]
    imports = sh([py, "-c", "import " + ", ".join(CARRIED_IMPORTS)], env=env)
    size = sh(["bash", str(REPO / "benchmarks" / "gpu_wheels.sh"), "size", str(wheels)])
    return {
        "image_install_s": round(image_s, 1),
        "carried_install_s": round(install_s, 1),
        "install_rc": carried.returncode,
        "install_tail": carried.stdout.splitlines()[-6:] + carried.stderr.splitlines()[-4:],
        "pip_check_other": other,
        "pip_check_torch_lines": len(check) - len(other),
        "imports_ok": imports.returncode == 0,
        "imports_error": imports.stderr[-600:] if imports.returncode else None,
        "size": json.loads(size.stdout.strip().splitlines()[-1]) if size.stdout.strip() else None,
        "ok": carried.returncode == 0 and not other and imports.returncode == 0 and size.returncode == 0,
    }


def check_transformers_517(work: Path) -> dict:
    """3 PRM steps and a score with transformers 5.17 over this environment's CPU torch."""
    from gpu_check import write_step_data

    overlay = work / "transformers_517"
    t0 = time.time()
    got = sh(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(overlay),
            f"transformers=={IMAGE_TRANSFORMERS}",
            *OVERLAY_EXTRAS,
        ]
    )
    if got.returncode != 0:
        return {"ok": False, "error": got.stderr[-1500:]}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(overlay), str(REPO)]), "TOKENIZERS_PARALLELISM": "false"}
    env.pop("ACCELERATE_USE_CPU", None)
    model, out = work / "model", work / "prm"
    data = write_step_data(work / "data", 16, 0, "train")
    steps = [
        [sys.executable, "-m", "mmprm.cli", "tiny-model", "--arch", "qwen2_vl", "--out", str(model)],
        [
            sys.executable,
            "recipes/prm_train.py",
            "--config",
            "recipes/configs/tiny/prm_train.yaml",
            f"model.name_or_path={model}",
            f"data.train_file={data}",
            "data.eval_file=null",
            f"output_dir={out}",
            "train.max_steps=3",
            "train.batch_size=4",
            "train.log_every=1",
            "train.save_every=3",
            "train.eval_every=3",
            "train.report_to=none",
        ],
        [
            sys.executable,
            "-c",
            "import json, sys, transformers, mmprm\n"
            "from mmprm.data.schema import load_examples\n"
            "scores = mmprm.load_prm(sys.argv[1]).score(load_examples(sys.argv[2]))\n"
            "print(json.dumps({'transformers': transformers.__version__, 'rows': len(scores),"
            " 'steps': sum(map(len, scores)), 'in_0_1': all(0 <= p <= 1 for s in scores for p in s)}))",
            str(out),
            str(data),
        ],
    ]
    for cmd in steps:
        run = sh(cmd, cwd=REPO, env=env)
        if run.returncode != 0:
            return {"ok": False, "failed": " ".join(cmd[:3]), "error": (run.stdout + run.stderr)[-2000:]}
    scored = json.loads(run.stdout.strip().splitlines()[-1])
    losses = [
        r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == "train"
    ]
    return {
        **scored,
        "train_losses": [round(x, 4) for x in losses],
        "seconds": round(time.time() - t0, 1),
        "ok": scored["transformers"] == IMAGE_TRANSFORMERS
        and len(losses) == 3
        and scored["in_0_1"]
        and scored["steps"] > 0,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=["wheels", "transformers_517"], default=None)
    parser.add_argument(
        "--wheels", default=str(REPO / ".whl"), help="the carried wheels (default .whl; downloaded if absent)"
    )
    parser.add_argument("--keep", default=None, help="keep the scratch folders here")
    args = parser.parse_args(argv)
    work = Path(args.keep or tempfile.mkdtemp(prefix="mmprm_offline_"))
    work.mkdir(parents=True, exist_ok=True)
    wheels = Path(args.wheels)
    result: dict = {"script": "gpu_offline_check"}
    if args.only in (None, "wheels"):
        if not wheels.is_dir():
            got = sh(["bash", str(REPO / "benchmarks" / "gpu_wheels.sh"), "download", str(wheels)])
            if got.returncode != 0:
                print(got.stdout + got.stderr, file=sys.stderr)
        result["wheels"] = check_wheels(wheels, work)
    if args.only in (None, "transformers_517"):
        result["transformers_517"] = check_transformers_517(work)
    result["ok"] = all(v["ok"] for k, v in result.items() if isinstance(v, dict))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
