"""Agreement of mmprm's answer verifier with the correctness flags shipped in public data.

    python benchmarks/answer_agreement.py [--data ../shared/data] [--show 20]

--data defaults to the full sets in ../shared/data when present, else the repo's data/ subset.

Prints one JSON line: per dataset, the number of solutions, how often `verify_solution` agrees
with the file's own flag, and the first disagreements (id, flag, ours, extracted answer, gold).

- mathv: MATH-V testmini CoTs of 3 models (`correct`), gold and options from testmini.jsonl;
- gsm8k: the 4 model solutions per problem of GSM8K's example_model_solutions (`is_correct`),
  gold after "A:" in `ground_truth`;
- qwen_math: Qwen2.5-Math's 100 MATH problems x 8 responses (`score`), gold `gt`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mmprm.answers import extract_answer, verify_solution  # noqa: E402

GSM8K_MODELS = ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification")


def _jsonl(path: Path) -> Iterator[dict]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def mathv_cases(data: Path) -> Iterator[tuple[str, str, str, list[str] | None, bool]]:
    """(case id, response, gold, options, flag) for every MATH-V CoT record."""
    problems = {r["id"]: r for r in _jsonl(data / "mathv" / "testmini.jsonl")}
    for path in sorted((data / "mathv" / "cot_testmini").glob("*.jsonl")):
        for r in _jsonl(path):
            p = problems[r["id"]]
            yield f"{path.stem}:{r['id']}", r["response"], p["answer"], p["options"] or None, bool(r["correct"])


def gsm8k_cases(data: Path) -> Iterator[tuple[str, str, str, list[str] | None, bool]]:
    for i, r in enumerate(_jsonl(data / "gsm8k" / "example_model_solutions.jsonl")):
        gold = extract_answer(r["ground_truth"])
        assert gold is not None, f"gsm8k line {i + 1}: no 'A:' in ground_truth"
        for name in GSM8K_MODELS:
            yield f"{name}:{i}", r[name]["solution"], gold, None, bool(r[name]["is_correct"])


def qwen_math_cases(data: Path) -> Iterator[tuple[str, str, str, list[str] | None, bool]]:
    for r in _jsonl(data / "qwen_math_bon" / "math_cot_100.jsonl"):
        for k, (resp, flag) in enumerate(zip(r["response"], r["score"])):
            yield f"{r['idx']}:{k}", resp, r["gt"], None, bool(flag)


DATASETS = {"mathv": mathv_cases, "gsm8k": gsm8k_cases, "qwen_math": qwen_math_cases}


def agreement(cases, show: int) -> dict:
    """Count agreement of `verify_solution` with the flags; keep the first `show` disagreements."""
    n = agree = ours_true = flag_true = 0
    disagreements = []
    start = time.perf_counter()
    for case_id, text, gold, options, flag in cases:
        ours = verify_solution(text, gold, options)
        n += 1
        agree += ours == flag
        ours_true += ours
        flag_true += flag
        if ours != flag and len(disagreements) < show:
            disagreements.append(
                {"id": case_id, "flag": flag, "ours": ours, "extracted": extract_answer(text), "gold": gold}
            )
    return {
        "n": n,
        "agreement": round(agree / max(n, 1), 4),
        "disagree": n - agree,
        "flag_correct": flag_true,
        "ours_correct": ours_true,
        "seconds": round(time.perf_counter() - start, 2),
        "disagreements": disagreements,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    repo = Path(__file__).resolve().parents[1]
    full = repo.parent / "shared" / "data"
    ap.add_argument("--data", type=Path, default=full if full.is_dir() else repo / "data")
    ap.add_argument("--show", type=int, default=20, help="disagreements listed per dataset")
    ap.add_argument("--only", choices=sorted(DATASETS), action="append", help="datasets to run")
    args = ap.parse_args(argv)
    report = {name: agreement(DATASETS[name](args.data), args.show) for name in (args.only or DATASETS)}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
