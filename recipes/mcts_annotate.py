"""Annotate process labels with OmegaPRM MCTS: problems in, trees and PRM training data out.

    # one process (CPU or one GPU)
    python recipes/mcts_annotate.py --config recipes/configs/tiny/mcts_annotate.yaml
    # one worker per GPU (each rank takes problems[i] with i % world == rank, one vLLM engine each)
    torchrun --nproc_per_node 8 recipes/mcts_annotate.py --config FILE policy.backend=vllm
    accelerate launch --num_processes 8 recipes/mcts_annotate.py --config FILE policy.backend=vllm
    srun --ntasks 16 --gpus-per-task 1 python recipes/mcts_annotate.py --config FILE policy.backend=vllm
    # any key can be overridden: search.max_rollouts=500 engine.concurrency=128 data.limit=100

Output in OUTPUT_DIR: `trees.rank{r}-of-{w}.jsonl` (one record per problem with its status,
appended and fsynced problem by problem), and once every rank is done, `trees.jsonl` (merged),
`prm_data.jsonl` (step-labelled rows for recipes/prm_train.py), `export_report.json` + `.png`;
each rank also leaves `summary.rank{r}-of-{w}.json` (throughput, statuses). After a crash (even
kill -9) rerun the same command: finished problems are skipped and nothing is lost; problems
that failed with a transient error (judge or backend down) are retried, and
`engine.max_consecutive_failures` such failures in a row stop the run (exit 3) instead of
erroring out the rest. A second worker started on the same OUTPUT_DIR and rank stops at once
(exit 3), naming the live holder of the rank file. `mmprm merge-annotations OUTPUT_DIR` merges by hand.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from tqdm.auto import tqdm

from mmprm.annotate.engine import (
    AnnotationEngine,
    AnnotationOutage,
    RankBusyError,
    TreeFile,
    finished_ids,
    iter_records,
    merge_annotations,
    problem_fingerprint,
    resolve_rank_world,
    rule_verifier,
    tree_file_name,
)
from mmprm.annotate.export import ExportConfig, iter_examples, write_export_report
from mmprm.annotate.omega import OmegaConfig
from mmprm.chat import ChatClient, ChatConfig
from mmprm.config import ConfigError, load_config, parse_cli, require_model_dir, to_dict
from mmprm.config_sections import ModelLoadConfig, PolicyConfig
from mmprm.data.problems import load_problems, problem_ids
from mmprm.data.schema import DataError, write_jsonl
from mmprm.generation.base import SamplingConfig


@dataclass
class AnnotateDataConfig:
    """The problems to annotate.

    Attributes:
        problems_file: JSONL of {id, images, question, answer, optional choices}; required
        limit: first N problems only (before sharding); null takes all
        check_images: open every image once before starting (a bad file fails now, not hours in)
    """

    problems_file: str = ""
    limit: int | None = None
    check_images: bool = True


@dataclass
class EngineConfig:
    """How rollouts are batched and read.

    Attributes:
        concurrency: problems in flight; one backend call carries up to concurrency x k rollouts
        max_consecutive_failures: transient errors in a row that stop the run as an outage
        continuous: vllm only: each search's next probe enters the running engine as soon as its last
            returns, instead of one blocking call per round that waits for its longest rollout (the
            same records either way) | null: on for vllm, off for hf (hf generates in rounds only)
        request_timeout_s: continuous only: a probe the engine has not finished this many seconds after
            its submission is aborted and its problem gets a transient error record (retried on resume),
            so a request the engine never reports finished cannot keep the run waiting; null: no limit
    """

    concurrency: int = 64
    max_consecutive_failures: int = 16
    continuous: bool | None = None
    request_timeout_s: float | None = 1800.0


@dataclass
class VerifyConfig:
    """How a rollout's final answer is checked.

    Attributes:
        judge: also ask an LLM judge about answers the rule-based checker rejects
        judge_chat: the judge's OpenAI-compatible endpoint (url, model, key, retries, cache)
    """

    judge: bool = False
    judge_chat: ChatConfig = field(default_factory=ChatConfig)


@dataclass
class AnnotateConfig:
    """mcts_annotate settings.

    Attributes:
        policy: the policy whose rollouts the search samples (section); policy.path required;
            policy.sampling: MM-PRM's defaults
        model: model loading (section)
        data: the problems
        search: OmegaPRM search (MM-PRM's defaults)
        engine: batching
        verify: answer checking
        export: trees -> training rows
        output_dir: where per-rank trees, the merged trees.jsonl, prm_data.jsonl and the report go
        rank: this worker's rank; null reads torchrun / accelerate / srun variables, else 0
        world_size: number of workers; null reads it like rank, else 1
    """

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    model: ModelLoadConfig = field(default_factory=ModelLoadConfig)
    data: AnnotateDataConfig = field(default_factory=AnnotateDataConfig)
    search: OmegaConfig = field(default_factory=OmegaConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    output_dir: str = "runs/mcts"
    rank: int | None = None
    world_size: int | None = None

    # Keys read under their old names for one release (mmprm.config), with a warning.
    RENAMED_KEYS: ClassVar[dict[str, str]] = {
        "model.name_or_path": "policy.path",
        "model.backend": "policy.backend",
        "model.dtype": "policy.dtype",
        "model.system_prompt": "policy.system_prompt",
        "model.hf_batch_size": "policy.batch_size",
        "model.vllm_gpu_memory_utilization": "policy.vllm.gpu_memory_utilization",
        "model.vllm_max_model_len": "policy.vllm.max_model_len",
        "model.vllm_kwargs": "policy.vllm.kwargs",
        "engine.step_mode": "policy.step_mode",
        "sampling": "policy.sampling",
    }

    def validate(self) -> None:
        from mmprm.models.loading import resolve_attn_implementation

        if self.policy.backend == "hf":
            resolve_attn_implementation(self.model.attn_implementation)  # before any weight loads
        if not self.policy.path:
            raise ValueError("policy.path is required (the policy that writes rollouts)")
        if not self.data.problems_file:
            raise ValueError("data.problems_file is required (JSONL of id, images, question, answer)")
        if self.engine.concurrency < 1 or self.engine.max_consecutive_failures < 1:
            raise ValueError("engine.concurrency and engine.max_consecutive_failures must be >= 1")
        if self.engine.request_timeout_s is not None and not self.engine.request_timeout_s > 0:
            raise ValueError(f"engine.request_timeout_s: {self.engine.request_timeout_s} must be > 0 seconds (or null)")
        if self.engine.continuous and self.policy.backend != "vllm":
            raise ValueError(
                f"engine.continuous=true needs policy.backend=vllm (the {self.policy.backend} backend generates in "
                "rounds): set engine.continuous=false or null"
            )
        if self.verify.judge and not self.verify.judge_chat.model:
            raise ValueError("verify.judge_chat.model: set the judge's model name (and url) when verify.judge=true")
        self.search.validate()
        self.export.validate()


def rank_sampling(cfg: AnnotateConfig, rank: int) -> SamplingConfig:
    """The sampling settings of rank `rank`'s backend.

    vLLM seeds every probe by its problem and its place in the search (`probe_seed`), which keeps
    problems apart on its own: every rank takes the base seed, so a problem draws the same rollouts
    on any number of ranks. HF generate seeds whole calls, so there each rank takes its own stream
    (`worker_seed`), else two ranks' calls would draw alike.
    """
    if cfg.policy.backend == "vllm":
        return cfg.policy.sampling
    return cfg.policy.sampling_for(rank)


def main(argv: list[str]) -> int:
    """Annotate this rank's unfinished problems, then merge and export once every rank is done.
    Exit 0: done, 1: transient failures to retry, 2: a config or data error, 3: stopped (rank busy,
    or an outage)."""
    try:
        cfg, rank, world, mine = load_inputs(argv)
    except (ConfigError, DataError, ValueError) as e:
        print(f"mcts_annotate: {e}", file=sys.stderr)
        return 2
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    # Resume: this rank's file is locked (one worker per rank), repaired (torn last line cut), and
    # every finished id is skipped; transient error records are retried.
    try:
        trees = TreeFile(out_dir / tree_file_name(rank, world), scan_dir=out_dir)
    except RankBusyError as e:
        print(f"mcts_annotate: rank {rank}: {e}", file=sys.stderr)
        return 3
    # A tree labels its steps against its problem's gold answer: a problem edited since must not be
    # skipped as done, nor its old tree exported.
    fingerprint = lambda p: problem_fingerprint(p.question, p.answer, p.choices)  # noqa: E731
    changed = [p.id for p in mine if trees.done.get(p.id, fingerprint(p)) != fingerprint(p)]
    if changed:
        trees.close()
        print(
            f"mcts_annotate: {cfg.data.problems_file}: {len(changed)} problem(s) changed (question, answer or "
            f"choices) since their trees in {out_dir} were made, e.g. id={changed[0]}: their labels would be "
            "wrong; annotate into a new output_dir, or restore those problems",
            file=sys.stderr,
        )
        return 2
    if rank == 0:
        (out_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2) + "\n")
    todo = [p for p in mine if p.id not in trees.done]
    print(
        f"rank {rank}/{world}: {len(mine)} problems in this shard, {len(mine) - len(todo)} already done, "
        f"{len(todo)} to annotate",
        file=sys.stderr,
    )

    try:
        # the policy prompted as its SFT saved it (mmprm_policy.json) unless policy.system_prompt /
        # policy.step_mode say otherwise, sampling as rank_sampling says
        backend = cfg.policy.build(cfg.model.attn_implementation, sampling=rank_sampling(cfg, rank))
    except ConfigError as e:
        trees.close()
        print(f"mcts_annotate: {e}", file=sys.stderr)
        return 2
    print(
        f"rank {rank}: prompt format: step_mode={backend.step_mode}, system prompt={backend.system!r}", file=sys.stderr
    )
    engine = make_engine(cfg, backend, make_verifier(cfg, out_dir, rank))
    try:
        stats = annotate(engine, todo, trees, rank)
    except AnnotationOutage as e:
        print(f"mcts_annotate: rank {rank}: {e}", file=sys.stderr)
        return 3
    finally:
        trees.close()
        backend.close()  # a vLLM engine stops now, not in the interpreter's exit (its threads can abort there)
    write_summary(out_dir, rank, world, stats, engine, backend)
    return merge_when_complete(cfg, out_dir, todo, stats, trees, rank)


def load_inputs(argv: list[str]) -> tuple[AnnotateConfig, int, int, list[Any]]:
    """(config, rank, world size, this rank's problems): of the rows up to data.limit, every
    world-th (`shard`), their images checked; every row is validated; the policy's directory must
    exist."""
    config_path, overrides = parse_cli(argv, AnnotateConfig)
    cfg = load_config(AnnotateConfig, config_path, overrides)
    rank, world = resolve_rank_world(cfg.rank, cfg.world_size)
    limit = cfg.data.limit
    # Only this rank's rows are kept, and only their images opened: 8 ranks do not each hold 100k.
    mine_only = lambda i: (limit is None or i < limit) and i % world == rank  # noqa: E731
    mine = load_problems(cfg.data.problems_file, cfg.data.check_images, check_rows=mine_only, keep_rows=mine_only)
    require_model_dir(cfg, "policy.path")  # named here, not in a traceback from the loader
    return cfg, rank, world, mine


def make_verifier(cfg: AnnotateConfig, out_dir: Path, rank: int) -> Any:
    """What decides a rollout's answer is right: the rule matcher, or an LLM judge behind it
    (verify.judge), whose replies this rank caches in the output folder."""
    if not cfg.verify.judge:
        return rule_verifier
    from mmprm.annotate.judge import LLMJudge, judged_verifier

    client = ChatClient(
        cfg.verify.judge_chat, config_key="verify.judge_chat", cache_path=out_dir / f"judge_cache.rank{rank}.jsonl"
    )
    return judged_verifier(LLMJudge(client))


def make_engine(cfg: AnnotateConfig, backend: Any, verify: Any) -> AnnotationEngine:
    """The engine that keeps engine.concurrency searches in flight over `backend` (continuous
    batching by default on vLLM)."""
    return AnnotationEngine(
        backend,
        cfg.search,
        verify,
        backend.step_mode,
        cfg.engine.concurrency,
        cfg.engine.max_consecutive_failures,
        prefix_temperature=cfg.policy.sampling.prefix_temperature,
        continuous=cfg.policy.backend == "vllm" if cfg.engine.continuous is None else cfg.engine.continuous,
        request_timeout_s=cfg.engine.request_timeout_s,
    )


def annotate(engine: AnnotationEngine, todo: list[Any], trees: TreeFile, rank: int) -> Any:
    """Run the search over `todo` with a progress bar; returns the engine's stats. Each finished
    problem is committed to the tree file at once, so a kill loses at most the problems in flight."""
    bar = tqdm(total=len(todo), unit="problem", desc=f"rank {rank}", dynamic_ncols=True)
    start = time.perf_counter()

    def on_record(rec: dict) -> None:
        trees.append(rec)
        bar.update(1)

    def on_batch(stats) -> None:
        elapsed = max(time.perf_counter() - start, 1e-9)
        bar.set_postfix(
            rollouts_s=f"{stats.rollouts / elapsed:.1f}",
            batch=stats.sequences_per_call[-1] if stats.sequences_per_call else 0,
        )

    try:
        return engine.run(todo, on_record, on_batch)
    finally:
        bar.close()


def write_summary(out_dir: Path, rank: int, world: int, stats: Any, engine: AnnotationEngine, backend: Any) -> None:
    """summary.rank{r}-of-{w}.json (this rank's throughput and statuses), also printed."""
    summary = {
        "rank": rank,
        "world_size": world,
        "engine": stats.summary(),
        "continuous": engine.continuous,
        "generated_tokens": backend.stats.generated_tokens,
    }
    (out_dir / f"summary.rank{rank}-of-{world}.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary), file=sys.stderr)


def merge_when_complete(
    cfg: AnnotateConfig, out_dir: Path, todo: list[Any], stats: Any, trees: TreeFile, rank: int
) -> int:
    """Merge and export once every problem has a record; the exit code. The last rank to finish
    does it (a tie writes the same files twice, atomically, which is harmless)."""
    missing = set(problem_ids(cfg.data.problems_file, cfg.data.limit)) - finished_ids(out_dir)
    retry = stats.by_status.get("error", 0) and {p.id for p in todo} & missing
    if retry:
        print(
            f"rank {rank}: {len(retry)} problems failed with transient errors (see 'message' in "
            f"{trees.path}); rerun the same command to retry them",
            file=sys.stderr,
        )
        return 1
    if missing:
        print(
            f"rank {rank}: done; {len(missing)} problems still with other ranks - the last rank to finish "
            f"merges (or run: mmprm merge-annotations {out_dir})",
            file=sys.stderr,
        )
        return 0
    export_prm_data(cfg, out_dir)
    return 0


def export_prm_data(cfg: AnnotateConfig, out_dir: Path) -> None:
    """trees.jsonl merged from every rank, prm_data.jsonl (step-labelled rows for prm_train) and the
    export report."""
    merged = merge_annotations(out_dir)
    export_stats: dict[str, Any] = {}  # filled while the rows stream to disk, one tree at a time
    write_jsonl(
        out_dir / "prm_data.jsonl", iter_examples(iter_records(out_dir / "trees.jsonl"), cfg.export, export_stats)
    )
    write_export_report(
        {**export_stats, "merge": merged}, out_dir / "export_report.json", out_dir / "export_report.png"
    )
    negatives, whole = export_stats["negative_paths"], export_stats["completed_negative_paths"]
    print(
        f"merged {merged['records']} problems {merged['by_status']}; wrote {export_stats['paths']} PRM training rows "
        f"({negatives} negative, {whole} of them whole wrong solutions) to {out_dir / 'prm_data.jsonl'}",
        file=sys.stderr,
    )
    if cfg.export.negatives == "complete" and whole < negatives:
        # Cut negatives end mid-solution with no answer while positives end with one: a PRM can
        # learn "has an answer" instead of the step (see mmprm.annotate.export).
        print(
            f"note: {negatives - whole} negative paths stop at their first error (their trees kept no wrong "
            "rollout: annotated with search.keep_failed_rollouts=false or by an older mmprm); re-annotate "
            "those problems to export them whole",
            file=sys.stderr,
        )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
