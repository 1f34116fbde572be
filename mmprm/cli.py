"""The `mmprm` command: small tools around the recipes (validate, tiny-model, convert, merge).

Each subcommand imports its module only when run, so `mmprm validate` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

# name -> (module, function, one-line help); functions take argv and return an exit code
COMMANDS: dict[str, tuple[str, str, str]] = {
    "validate": ("mmprm.cli", "cli_validate", "check step-labelled JSONL files before any work starts"),
    "env": ("mmprm.env_report", "cli_env", "report torch, CUDA, the driver, GPUs and libraries, each checked for real"),
    "tiny-model": ("mmprm.models.tiny", "cli_tiny_model", "write a tiny random-init model directory"),
    "convert": ("mmprm.data.convert", "cli_convert", "import PRM data (TRL, Math-Shepherd, PRM800K, openr, MM-PRM)"),
    "convert-candidates": (
        "mmprm.rerank.candidates",
        "cli_convert_candidates",
        "build Best-of-N candidate files from MATH-V, GSM8K, Qwen-Math or text solutions",
    ),
    "merge-annotations": (
        "mmprm.annotate.engine",
        "cli_merge_annotations",
        "merge per-rank annotation trees into one file",
    ),
    "convert-sft": (
        "mmprm.data.sft",
        "cli_convert_sft",
        "build SFT data (tagged steps) from GSM8K or MATH-V worked solutions",
    ),
    "eval-set": (
        "mmprm.data.eval_sets",
        "cli_eval_set",
        "write MathVista, MathVerse, MATH-V, OlympiadBench or MM-K12 as problems.jsonl; `score`: score saved outputs",
    ),
    "bon-report": ("mmprm.rerank.report", "cli_bon_report", "Best-of-N report from a scored candidates file"),
    "synthetic": ("mmprm.data.synthetic", "cli_synthetic", "write the colour-tile demo task (train/test splits)"),
    "merge-bon": ("mmprm.rerank.shards", "cli_merge_bon", "merge sharded Best-of-N scores and write the report"),
    "bon-table": ("mmprm.rerank.shards", "cli_bon_table", "one Best-of-N table over runs, one per benchmark"),
    "export-vllm": ("mmprm.models.vllm_prm", "cli_export_vllm", "write a PRM directory as vLLM serves it"),
    "convert-internvl": (
        "mmprm.models.internvl_convert",
        "cli_convert_internvl",
        "write an InternVL chat checkpoint (MM-PRM, VisualPRM) in transformers' format",
    ),
}


def cli_validate(argv: list[str]) -> int:
    from mmprm.data.schema import scan_examples

    parser = argparse.ArgumentParser(prog="mmprm validate", description="Validate step-labelled JSONL files.")
    parser.add_argument(
        "files", nargs="+", metavar="PATH", help="a JSONL file, or a directory: each *.jsonl directly in it is checked"
    )
    parser.add_argument("--require-labels", action="store_true", help="every row must carry labels (training data)")
    parser.add_argument("--no-image-check", action="store_true", help="skip opening image files")
    args = parser.parse_args(argv)
    bad = 0
    paths: list[Path] = []
    for given in map(Path, args.files):
        if given.is_dir():
            found = sorted(p for p in given.glob("*.jsonl") if p.is_file())
            if not found:
                print(
                    f"{given}: a directory with no *.jsonl files (give a JSONL file or a folder of them)",
                    file=sys.stderr,
                )
                bad += 1
            paths += found
        else:
            paths.append(given)
    for path in paths:
        n_problems = n_examples = n_steps = labelled = 0  # counted as read: a file of any size fits
        for ex, problems in scan_examples(path, args.require_labels, not args.no_image_check):
            for line in problems:
                print(line)
            n_problems += len(problems)
            if ex is not None:
                n_examples, n_steps, labelled = (
                    n_examples + 1,
                    n_steps + len(ex.steps),
                    labelled + (ex.labels is not None),
                )
        if n_problems:
            bad += 1
            print(f"{path}: {n_problems} problem(s)", file=sys.stderr)
        else:
            print(f"{path}: OK ({n_examples} examples, {n_steps} steps, {labelled} labelled)", file=sys.stderr)
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: mmprm COMMAND [ARGS]\n\ncommands:")
        for name, (_, _, help_) in COMMANDS.items():
            print(f"  {name:<20} {help_}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"mmprm: unknown command {name!r}; run `mmprm --help`", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    return int(getattr(importlib.import_module(module), func)(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
