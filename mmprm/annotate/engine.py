"""The annotation engine: many OmegaPRM searches in flight, their probes batched into one backend.

    problems = load_problems("problems.jsonl")                  # mmprm.data.problems
    rank, world = resolve_rank_world()                          # torchrun / accelerate / srun / single
    trees = TreeFile(out_dir / tree_file_name(rank, world), scan_dir=out_dir)
    engine = AnnotationEngine(backend, SearchConfig(), concurrency=64)
    engine.run([p for p in shard(problems, rank, world) if p.id not in trees.done], trees.append)
    merge_annotations(out_dir)                                  # -> out_dir/trees.jsonl

Why this shape: each search is sequential (a binary search waits for its last probe), so one
problem per GPU leaves the GPU idle. With `concurrency` problems in flight, every backend call
carries up to concurrency * k sequences. Every input problem gets exactly one record, appended
and fsynced as soon as it finishes; a torn last line from a kill -9 is cut off on restart and
finished ids are skipped, so rerunning the same command resumes without loss or duplicates.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from mmprm.annotate.backends.base import RolloutBackend, RolloutInputError, RolloutRequest, StepMode, was_truncated
from mmprm.annotate.search import OmegaSearch, Probe, Rollout, SearchConfig
from mmprm.data.problems import Problem
from mmprm.data.schema import DataError, iter_jsonl, write_jsonl
from mmprm.steps import parse_solution

# pred answer (None when the rollout gave none), gold answer, choices -> correct?
Verifier = Callable[[str | None, str, list[str] | None], bool]

STATUSES = ("annotated", "screened_all_correct", "screened_all_wrong", "no_steps", "no_answer", "error")


# -- ranks, shards and the per-rank tree file ---------------------------------------------------

def resolve_rank_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world size): explicit values, else torchrun/accelerate (RANK, WORLD_SIZE), else
    srun (SLURM_PROCID, SLURM_NTASKS), else LOCAL_RANK/LOCAL_WORLD_SIZE, else (0, 1)."""
    env = os.environ
    for r_key, w_key in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        if rank is None and world_size is None and r_key in env and w_key in env:
            rank, world_size = int(env[r_key]), int(env[w_key])
    rank = 0 if rank is None else rank
    world_size = 1 if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size}): set rank and world_size consistently")
    return rank, world_size


def shard(problems: list[Problem], rank: int, world_size: int) -> list[Problem]:
    """This rank's deterministic share: problems[i] with i % world_size == rank."""
    return problems[rank::world_size]


def tree_file_name(rank: int, world_size: int) -> str:
    return f"trees.rank{rank}-of-{world_size}.jsonl"


def _read_records(path: Path, repair: bool) -> list[dict[str, Any]]:
    """Complete records of a tree file. Bytes after the last newline are a write torn by a kill:
    ignored, and cut off when `repair` (only the owning rank repairs its file)."""
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if repair and end < len(data):
        os.truncate(path, end)
    records = []
    for lineno, line in enumerate(data[:end].splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise DataError([f"{path}:{lineno}: id=?: line: invalid JSON inside the file ({e.msg}); "
                             "it was edited or corrupted: delete that line to re-annotate the problem"]) from None
    return records


class TreeFile:
    """Append-only per-rank record file that survives kill -9 at any moment.

    Args:
        path: this rank's file (created if missing; a torn last line is cut off).
        scan_dir: also count ids finished in other `trees.rank*` files here as done, so a rerun
            with another world size still skips them.
    """

    def __init__(self, path: str | Path, scan_dir: str | Path | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.done: set[str] = set()
        if self.path.exists():
            self.done.update(str(r["id"]) for r in _read_records(self.path, repair=True))
        if scan_dir is not None:
            self.done.update(finished_ids(scan_dir, skip=self.path))
        self._f = open(self.path, "a", encoding="utf-8")

    def append(self, record: dict[str, Any]) -> None:
        """Commit one record: a single line, flushed and fsynced before returning."""
        if str(record["id"]) in self.done:
            raise ValueError(f"{self.path}: id={record['id']} already has a record")
        self._f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        self.done.add(str(record["id"]))

    def close(self) -> None:
        self._f.close()


def finished_ids(output_dir: str | Path, skip: Path | None = None) -> set[str]:
    """Ids with a complete record in any `trees.rank*-of-*.jsonl` of `output_dir` (read-only)."""
    ids: set[str] = set()
    for path in sorted(Path(output_dir).glob("trees.rank*-of-*.jsonl")):
        if skip is None or path.resolve() != Path(skip).resolve():
            ids.update(str(r["id"]) for r in _read_records(path, repair=False))
    return ids


def merge_annotations(output_dir: str | Path, out: str | Path | None = None,
                      problems_file: str | Path | None = None) -> dict[str, Any]:
    """Merge every `trees.rank*-of-*.jsonl` of `output_dir` into one file (default `trees.jsonl`).

    Keeps the first record per id (files in name order); returns a summary with counts per
    status, duplicates dropped and, given the problems file, the ids that have no record yet.
    """
    output_dir = Path(output_dir)
    files = sorted(output_dir.glob("trees.rank*-of-*.jsonl"))
    if not files:
        raise FileNotFoundError(f"{output_dir}: no trees.rank*-of-*.jsonl files (run recipes/mcts_annotate.py first)")
    seen: set[str] = set()
    duplicates = 0
    by_status: dict[str, int] = {}

    def rows():
        nonlocal duplicates
        for path in files:
            for rec in _read_records(path, repair=False):
                rid = str(rec["id"])
                if rid in seen:
                    duplicates += 1
                    continue
                seen.add(rid)
                by_status[rec.get("status", "?")] = by_status.get(rec.get("status", "?"), 0) + 1
                yield rec

    out = Path(out) if out is not None else output_dir / "trees.jsonl"
    n = write_jsonl(out, rows())
    summary: dict[str, Any] = {"out": str(out), "files": [p.name for p in files], "records": n,
                               "duplicates_dropped": duplicates, "by_status": by_status}
    if problems_file is not None:
        ids = [str(r["id"]) for _, r, err in iter_jsonl(problems_file) if r is not None and "id" in r]
        summary["missing"] = [i for i in ids if i not in seen]
    return summary


def cli_merge_annotations(argv: list[str]) -> int:
    """`mmprm merge-annotations OUTPUT_DIR [--out FILE] [--problems FILE]`."""
    parser = argparse.ArgumentParser(prog="mmprm merge-annotations",
                                     description="Merge per-rank annotation trees into one JSONL file.")
    parser.add_argument("output_dir", help="the annotation run's output_dir")
    parser.add_argument("--out", default=None, help="merged file (default OUTPUT_DIR/trees.jsonl)")
    parser.add_argument("--problems", default=None, help="problems file: report ids that have no record")
    args = parser.parse_args(argv)
    try:
        summary = merge_annotations(args.output_dir, args.out, args.problems)
    except (FileNotFoundError, DataError) as e:
        print(f"mmprm merge-annotations: {e}", file=sys.stderr)
        return 1
    missing = summary.get("missing", [])
    print(json.dumps({**summary, "missing": len(missing)}))
    if missing:
        print(f"{len(missing)} problem(s) have no record yet (e.g. {missing[:5]}): rerun the annotation command "
              "to finish them", file=sys.stderr)
        return 1
    return 0


# -- the engine -------------------------------------------------------------------------------

def rule_verifier(pred: str | None, gold: str, choices: list[str] | None = None) -> bool:
    """Default verifier: mmprm's rule-based answer checker (math-verify + normalisation)."""
    from mmprm.answers import answers_match

    return pred is not None and answers_match(pred, gold, choices)


@dataclass
class EngineStats:
    """Totals of one `AnnotationEngine.run`."""

    problems: int = 0
    by_status: dict[str, int] = field(default_factory=dict)
    rollouts: int = 0
    truncated_rollouts: int = 0  # stopped before an answer (max_new_tokens, or none written)
    backend_calls: int = 0
    sequences_per_call: list[int] = field(default_factory=list)
    backend_seconds: float = 0.0
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        calls = max(1, self.backend_calls)
        return {"problems": self.problems, "by_status": dict(self.by_status), "rollouts": self.rollouts,
                "truncated_rollouts": self.truncated_rollouts,
                "backend_calls": self.backend_calls, "mean_sequences_per_call": sum(self.sequences_per_call) / calls,
                "backend_seconds": round(self.backend_seconds, 3), "seconds": round(self.seconds, 3),
                "problems_per_s": self.problems / max(self.seconds, 1e-9),
                "rollouts_per_s": self.rollouts / max(self.seconds, 1e-9)}


@dataclass
class _Active:
    problem: Problem
    search: OmegaSearch
    gen: Any
    probe: Probe
    started: float
    verdicts: dict[str | None, bool] = field(default_factory=dict)


class AnnotationEngine:
    """Drives up to `concurrency` problems' searches at once over one backend.

    Args:
        backend: any `RolloutBackend` (HF, vLLM, simulated).
        search: OmegaPRM hyper-parameters.
        verify: `(pred, gold, choices) -> bool`; `rule_verifier` when None.
        step_mode: how rollouts are split into steps ("tags" or "blank_lines").
        concurrency: problems in flight; each backend call carries up to concurrency * k sequences.
    """

    def __init__(self, backend: RolloutBackend, search: SearchConfig, verify: Verifier | None = None,
                 step_mode: StepMode = "tags", concurrency: int = 64):
        if concurrency < 1:
            raise ValueError("engine.concurrency must be >= 1")
        search.validate()
        self.backend = backend
        self.search_cfg = search
        self.verify = verify or rule_verifier
        self.step_mode = step_mode
        self.concurrency = concurrency
        self.stats = EngineStats()

    def run(self, problems: Iterable[Problem], on_record: Callable[[dict[str, Any]], None],
            on_batch: Callable[[EngineStats], None] | None = None) -> EngineStats:
        """Annotate `problems`, handing each finished record to `on_record` (in finishing order)."""
        start = time.perf_counter()
        queue = iter(problems)
        active: list[_Active] = []
        exhausted = False
        while True:
            while not exhausted and len(active) < self.concurrency:
                problem = next(queue, None)
                if problem is None:
                    exhausted = True
                    break
                search = OmegaSearch(self.search_cfg)
                gen = search.run()
                active.append(_Active(problem, search, gen, next(gen), time.perf_counter()))
            if not active:
                break
            texts = self._generate(active, on_record)
            still: list[_Active] = []
            for item, outs in zip(active, texts):
                if outs is None:
                    continue  # its problem already got an error record
                try:
                    rollouts = [self._rollout(item, t) for t in outs]
                    self.stats.rollouts += len(rollouts)
                    item.probe = item.gen.send(rollouts)
                    still.append(item)
                except StopIteration as stop:
                    self._finish(item, on_record, result=stop.value)
                except Exception as e:  # noqa: BLE001 - one bad problem must not stop the run
                    self._finish(item, on_record, error=f"{type(e).__name__}: {e}")
            active = still
            if on_batch is not None:
                on_batch(self.stats)
        self.stats.seconds += time.perf_counter() - start
        return self.stats

    def _generate(self, active: list[_Active], on_record: Callable[[dict[str, Any]], None]) -> list[list[str] | None]:
        """One backend call for every active probe; a request the backend cannot even build a
        prompt for (bad image, ...) turns its problem into an error record and the rest retry."""
        live = list(range(len(active)))
        out: list[list[str] | None] = [None] * len(active)
        while live:
            requests = [RolloutRequest(active[i].problem.id, active[i].problem.question, active[i].problem.images,
                                       list(active[i].probe.prefix), active[i].probe.n) for i in live]
            t0 = time.perf_counter()
            try:
                texts = self.backend.generate(requests)
            except RolloutInputError as e:
                bad = live.pop(e.index)
                self._finish(active[bad], on_record, error=f"RolloutInputError: {e}")
                continue
            self.stats.backend_seconds += time.perf_counter() - t0
            self.stats.backend_calls += 1
            self.stats.sequences_per_call.append(sum(r.n for r in requests))
            if len(texts) != len(requests) or any(len(t) != r.n for t, r in zip(texts, requests)):
                raise RuntimeError("backend returned a different number of rollouts than requested")
            for i, t in zip(live, texts):
                out[i] = t
            break
        return out

    def _rollout(self, item: _Active, text: str) -> Rollout:
        parsed = parse_solution(text, self.step_mode)
        if was_truncated(text):
            # Cut at max_new_tokens: an answer read from it (blank-line mode) is a half-written
            # guess, so the rollout is unfinished (answer None), never searched for an error.
            return Rollout(parsed.steps, None, False)
        if parsed.answer not in item.verdicts:
            # Many rollouts give the same answer; math-verify or a judge runs once per answer.
            item.verdicts[parsed.answer] = bool(
                parsed.answer is not None and self.verify(parsed.answer, item.problem.answer, item.problem.choices))
        return Rollout(parsed.steps, parsed.answer, item.verdicts[parsed.answer])

    def _finish(self, item: _Active, on_record: Callable[[dict[str, Any]], None], result: Any = None,
                error: str | None = None) -> None:
        p = item.problem
        rec: dict[str, Any] = {"id": p.id, "status": "error" if error else result.status, "question": p.question,
                               "images": p.images, "answer": p.answer}
        if p.choices is not None:
            rec["choices"] = p.choices
        if p.meta:
            rec["meta"] = p.meta
        if error:
            rec["message"] = error
            rec["stats"] = {"rollouts": item.search.rollouts}
        else:
            rec["stats"] = result.stats()
            self.stats.truncated_rollouts += result.truncated_rollouts
            rec["nodes"] = result.nodes
            rec["first_errors"] = result.first_errors
        rec["seconds"] = round(time.perf_counter() - item.started, 3)
        on_record(rec)
        self.stats.problems += 1
        self.stats.by_status[rec["status"]] = self.stats.by_status.get(rec["status"], 0) + 1
