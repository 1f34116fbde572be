"""`mmprm env`: what this environment can run, checked for real, as `accelerate env` and
`ds_report` do: Python, torch and its CUDA build, the NVIDIA driver, the GPUs, and each library
mmprm uses (its version, and whether it imports and, where CUDA exists, runs one CUDA op).

Exit 1 on any problem: a library installed but broken, no CUDA GPU (unless `--cpu-ok`), a
driver too old for torch's CUDA build, a Python older than mmprm supports. A library that is
not installed is listed with the extra that installs it, and is no problem by itself.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import importlib.util
import io
import json
import platform
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Any, Literal

MIN_PYTHON = (3, 11)
SCALING_DOC = "docs/scaling.md#install-on-a-cluster"
# The oldest Linux driver of each CUDA major version (CUDA release notes, minor version
# compatibility): a torch built for CUDA 13 sees no GPU on a 535 or 550 driver.
MIN_DRIVER = {12: 525, 13: 580}

Status = Literal["ok", "not installed", "broken"]


@dataclass
class Library:
    """One library's row: its distribution, version, status and what was checked or went wrong."""

    name: str
    version: str | None
    status: Status
    detail: str = ""


# (import name, distribution, extra that installs it or None when mmprm requires it)
LIBRARIES: list[tuple[str, str, str | None]] = [
    ("transformers", "transformers", None),
    ("accelerate", "accelerate", None),
    ("peft", "peft", None),
    ("deepspeed", "deepspeed", "deepspeed"),
    ("flash_attn", "flash-attn", "flash"),
    ("vllm", "vllm", "vllm"),
    ("wandb", "wandb", "wandb"),
]


def python_problem(version: tuple[int, ...]) -> str | None:
    """A message when `version` is older than mmprm supports, else None."""
    if tuple(version[:2]) < MIN_PYTHON:
        got, need = ".".join(map(str, version[:3])), ".".join(map(str, MIN_PYTHON))
        return f"Python {got}: mmprm needs >= {need} (vllm 0.33 does): make a venv with python{need} or newer"
    return None


def driver_problem(torch_cuda: str | None, driver: str | None) -> str | None:
    """A message when the NVIDIA `driver` (e.g. "550.54.15") is too old for torch's CUDA build
    (`torch.version.cuda`, e.g. "13.0"), else None (also when either is unknown)."""
    if not torch_cuda or not driver:
        return None
    major = int(torch_cuda.split(".")[0])
    need = MIN_DRIVER.get(major)
    have = int(driver.split(".")[0])
    if need is not None and have < need:
        return (
            f"torch is built for CUDA {torch_cuda}, which needs an NVIDIA driver >= {need}; this one is {driver}: "
            f"use the CUDA forward-compatibility libraries or a torch/vllm pair built for CUDA 12 ({SCALING_DOC})"
        )
    return None


def nvidia_driver() -> str | None:
    """The driver version nvidia-smi reports, None without nvidia-smi or a driver."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        res = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = res.stdout.strip().splitlines()
    return lines[0].strip() if res.returncode == 0 and lines else None


def _cuda_op(module: str, mod: Any) -> str:
    """One real use of `module` on the GPU; returns what it showed, raises when it fails."""
    import torch

    if module == "flash_attn":
        from flash_attn import flash_attn_func

        q = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.bfloat16)  # (B, S, H, D)
        flash_attn_func(q, q, q, causal=True)
        torch.cuda.synchronize()
        return "flash_attn_func ran on cuda"
    if module == "deepspeed":
        # without a CUDA accelerator DeepSpeed trains on the CPU without a word
        name = mod.accelerator.get_accelerator().device_name()
        if name != "cuda":
            raise RuntimeError(f"DeepSpeed's accelerator is {name!r}, not cuda")
        return "accelerator cuda"
    if module == "vllm":
        importlib.import_module("vllm._C")  # its compiled kernels, linked against one torch and CUDA
        return "compiled kernels load"
    return "imports"


def check_library(module: str, dist: str, extra: str | None, cuda: bool) -> Library:
    """Version from the installed metadata; then import it and, with `cuda`, use it once."""
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version is None and importlib.util.find_spec(module) is None:
        how = f"pip install 'mmprm[{extra}]'" if extra else "pip install -e . (mmprm requires it)"
        return Library(dist, None, "not installed", how)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed and vLLM talk on import
            mod = importlib.import_module(module)
            detail = _cuda_op(module, mod) if cuda else "imports"
    except Exception as e:  # an undefined symbol, a missing CUDA library: the install is broken
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        hint = " (built against another torch or CUDA? reinstall it after torch)" if "symbol" in str(e) else ""
        return Library(dist, version, "broken", f"{type(e).__name__}: {first}{hint}")
    return Library(dist, version or getattr(mod, "__version__", None), "ok", detail)


def collect(cpu_ok: bool) -> tuple[dict[str, Any], list[str]]:
    """The report and its problems."""
    problems: list[str] = []
    report: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform()}
    if p := python_problem(sys.version_info):
        problems.append(p)
    try:
        import torch
    except Exception as e:
        problems.append(f"torch does not import ({type(e).__name__}: {e}): install torch first")
        return report, problems
    report["torch"] = torch.__version__
    report["torch_cuda"] = torch.version.cuda
    report["driver"] = nvidia_driver()
    cuda = torch.cuda.is_available()
    report["cuda_available"] = cuda
    gpus = []
    if cuda:
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append(
                {
                    "name": props.name,
                    "capability": f"{props.major}.{props.minor}",
                    "memory_gib": props.total_memory / 2**30,
                }
            )
        try:
            x = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
            (x @ x).sum().item()
            report["cuda_op"] = "bf16 matmul ran on cuda:0"
        except Exception as e:
            problems.append(f"torch sees a GPU but a CUDA op fails: {type(e).__name__}: {e}")
    else:
        why = driver_problem(torch.version.cuda, report["driver"])
        if why:
            problems.append(why)
        elif torch.version.cuda is None:
            if not cpu_ok:
                problems.append(
                    f"torch {torch.__version__} is a CPU build: install a CUDA torch (make install does on a GPU "
                    "machine), or pass --cpu-ok where no GPU is meant to be"
                )
        elif not cpu_ok:
            problems.append(
                f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"
                + ("" if report["driver"] else " and nvidia-smi finds no driver")
                + ": run on a GPU node, or pass --cpu-ok where no GPU is meant to be"
            )
    report["gpus"] = gpus
    libraries = [check_library(m, d, e, cuda) for m, d, e in LIBRARIES]
    report["libraries"] = [asdict(lib) for lib in libraries]
    for lib, (_, _, extra) in zip(libraries, LIBRARIES):
        if lib.status == "broken" or (lib.status == "not installed" and extra is None):
            problems.append(f"{lib.name}: {lib.status}: {lib.detail}")
    return report, problems


def render(report: dict[str, Any], problems: list[str]) -> str:
    """The report as lines a person reads."""
    lines = [f"Python        {report['python']} ({report['platform']})"]
    if "torch" in report:
        lines.append(f"torch         {report['torch']} (CUDA build: {report['torch_cuda'] or 'none, CPU only'})")
        lines.append(f"NVIDIA driver {report['driver'] or 'none found (nvidia-smi)'}")
        lines.append(
            f"CUDA          {'available: ' + report.get('cuda_op', '') if report['cuda_available'] else 'no GPU'}"
        )
        for i, gpu in enumerate(report["gpus"]):
            lines.append(f"  cuda:{i}      {gpu['name']}, sm {gpu['capability']}, {gpu['memory_gib']:.0f} GiB")
        for lib in report["libraries"]:
            lines.append(f"{lib['name']:<13} {lib['version'] or '-':<12} {lib['status']:<14} {lib['detail']}")
    lines.append("problems:" if problems else "no problems")
    lines += [f"  - {p}" for p in problems]
    return "\n".join(lines)


def cli_env(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="mmprm env",
        description="Report Python, torch, CUDA, the driver, the GPUs and each library mmprm uses, each checked "
        "for real (import, and one CUDA op where CUDA exists). Exit 1 on any problem.",
    )
    parser.add_argument("--cpu-ok", action="store_true", help="no CUDA GPU is not a problem (a CPU-only machine)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    report, problems = collect(args.cpu_ok)
    report["problems"] = problems
    print(json.dumps(report) if args.json else render(report, problems))
    return 1 if problems else 0
