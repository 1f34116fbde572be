"""Annotate process labels with OmegaPRM MCTS: problems in, trees and PRM training data out.

    # one process (CPU or one GPU)
    python recipes/mcts_annotate.py --config recipes/configs/tiny/mcts_annotate.yaml
    # one worker per GPU (each rank takes problems[i] with i % world == rank, one vLLM engine each)
    torchrun --nproc_per_node 8 recipes/mcts_annotate.py --config FILE model.backend=vllm
    accelerate launch --num_processes 8 recipes/mcts_annotate.py --config FILE model.backend=vllm
    srun --ntasks 16 --gpus-per-task 1 python recipes/mcts_annotate.py --config FILE model.backend=vllm
    # any key can be overridden: search.max_rollouts=500 engine.concurrency=128 data.limit=100

Output in OUTPUT_DIR: `trees.rank{r}-of-{w}.jsonl` (one record per problem with its status,
appended and fsynced problem by problem), and once every rank is done, `trees.jsonl` (merged),
`prm_data.jsonl` (step-labelled rows for recipes/prm_train.py), `export_report.json` + `.png`;
each rank also leaves `summary.rank{r}-of-{w}.json` (throughput, statuses). After a crash (even
kill -9) rerun the same command: finished problems are skipped and nothing is lost.
`mmprm merge-annotations OUTPUT_DIR` merges by hand.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tqdm.auto import tqdm

from mmprm.annotate.backends.base import SamplingConfig
from mmprm.annotate.engine import (
    AnnotationEngine,
    TreeFile,
    finished_ids,
    merge_annotations,
    resolve_rank_world,
    rule_verifier,
    shard,
    tree_file_name,
)
from mmprm.annotate.export import ExportConfig, export_examples, write_report
from mmprm.annotate.search import SearchConfig
from mmprm.config import ConfigError, load_config, parse_cli, to_dict
from mmprm.data.problems import load_problems
from mmprm.data.schema import DataError, read_jsonl, write_jsonl


@dataclass
class ModelConfig:
    name_or_path: str = ""
    backend: Literal["hf", "vllm"] = "hf"
    dtype: str = "auto"  # hf: torch dtype name or auto; vllm: its dtype option
    system_prompt: str | None = None
    hf_batch_size: int = 64  # hf: sequences per generate call
    vllm_gpu_memory_utilization: float = 0.9
    vllm_max_model_len: int | None = None
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)  # more vllm.LLM args, e.g. {enforce_eager: true}


@dataclass
class DataConfig:
    problems_file: str = ""  # JSONL of {"id", "images", "question", "answer", optional "choices"}
    limit: int | None = None  # first N problems only (before sharding)
    check_images: bool = True


@dataclass
class EngineConfig:
    step_mode: Literal["tags", "blank_lines"] = "tags"  # tags: an SFT'd policy; blank_lines: any policy
    concurrency: int = 64  # problems in flight; a backend call carries up to concurrency * k rollouts


@dataclass
class VerifyConfig:
    judge: bool = False  # ask an LLM judge about answers the rule-based checker rejects
    judge_url: str = "http://localhost:8000/v1"
    judge_model: str = ""
    judge_api_key_env: str = "OPENAI_API_KEY"


@dataclass
class AnnotateConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    output_dir: str = "runs/mcts"
    rank: int | None = None  # default: from torchrun / accelerate / srun, else 0
    world_size: int | None = None

    def validate(self) -> None:
        if not self.model.name_or_path:
            raise ValueError("model.name_or_path is required (the policy that writes rollouts)")
        if not self.data.problems_file:
            raise ValueError("data.problems_file is required (JSONL of id, images, question, answer)")
        if self.engine.concurrency < 1 or self.model.hf_batch_size < 1:
            raise ValueError("engine.concurrency and model.hf_batch_size must be >= 1")
        self.search.validate()
        self.sampling.validate()
        self.export.validate()


def main(argv: list[str]) -> int:
    try:
        config_path, overrides = parse_cli(argv)
        cfg = load_config(AnnotateConfig, config_path, overrides)
        rank, world = resolve_rank_world(cfg.rank, cfg.world_size)
        problems = load_problems(cfg.data.problems_file, cfg.data.check_images)
    except (ConfigError, DataError, ValueError) as e:
        print(f"mcts_annotate: {e}", file=sys.stderr)
        return 2
    if cfg.data.limit is not None:
        problems = problems[: cfg.data.limit]
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        (out_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2) + "\n")

    # Resume: this rank's file is repaired (torn last line cut) and every finished id is skipped.
    trees = TreeFile(out_dir / tree_file_name(rank, world), scan_dir=out_dir)
    mine = shard(problems, rank, world)
    todo = [p for p in mine if p.id not in trees.done]
    print(f"rank {rank}/{world}: {len(mine)} problems in this shard, {len(mine) - len(todo)} already done, "
          f"{len(todo)} to annotate", file=sys.stderr)

    # Backend: one engine per rank; vLLM gets its own GPU when several ranks share a node.
    if cfg.model.backend == "vllm":
        from mmprm.annotate.backends.vllm import VLLMBackend, pin_local_gpu

        pin_local_gpu()
        llm_kwargs = {"gpu_memory_utilization": cfg.model.vllm_gpu_memory_utilization, "dtype": cfg.model.dtype}
        if cfg.model.vllm_max_model_len:
            llm_kwargs["max_model_len"] = cfg.model.vllm_max_model_len
        llm_kwargs.update(cfg.model.vllm_kwargs)
        backend = VLLMBackend(cfg.model.name_or_path, cfg.sampling, cfg.engine.step_mode, cfg.model.system_prompt,
                              **llm_kwargs)
    else:
        import torch

        from mmprm.annotate.backends.hf import HFBackend

        device = f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu"
        backend = HFBackend.from_pretrained(cfg.model.name_or_path, cfg.sampling, dtype=cfg.model.dtype,
                                            device=device, step_mode=cfg.engine.step_mode,
                                            batch_size=cfg.model.hf_batch_size, system=cfg.model.system_prompt)
    verify = rule_verifier
    if cfg.verify.judge:
        from mmprm.annotate.judge import LLMJudge, judged_verifier

        verify = judged_verifier(LLMJudge(cfg.verify.judge_url, cfg.verify.judge_model, cfg.verify.judge_api_key_env))

    # The loop: the engine keeps `concurrency` searches in flight; each finished problem is
    # committed to the tree file at once, so a kill loses at most the problems in flight.
    engine = AnnotationEngine(backend, cfg.search, verify, cfg.engine.step_mode, cfg.engine.concurrency)
    bar = tqdm(total=len(todo), unit="problem", desc=f"rank {rank}", dynamic_ncols=True)
    start = time.perf_counter()

    def on_record(rec: dict) -> None:
        trees.append(rec)
        bar.update(1)

    def on_batch(stats) -> None:
        elapsed = max(time.perf_counter() - start, 1e-9)
        bar.set_postfix(rollouts_s=f"{stats.rollouts / elapsed:.1f}",
                        batch=stats.sequences_per_call[-1] if stats.sequences_per_call else 0)

    try:
        stats = engine.run(todo, on_record, on_batch)
    finally:
        bar.close()
        trees.close()
    summary = {"rank": rank, "world_size": world, "engine": stats.summary(),
               "generated_tokens": backend.stats.generated_tokens}
    (out_dir / f"summary.rank{rank}-of-{world}.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary), file=sys.stderr)

    # Merge and export once every problem has a record; the last rank to finish does it (a tie
    # writes the same files twice, atomically, which is harmless).
    missing = {p.id for p in problems} - finished_ids(out_dir)
    if missing:
        print(f"rank {rank}: done; {len(missing)} problems still with other ranks - the last rank to finish "
              f"merges (or run: mmprm merge-annotations {out_dir})", file=sys.stderr)
        return 0
    merged = merge_annotations(out_dir)
    rows, export_stats = export_examples(read_jsonl(out_dir / "trees.jsonl"), cfg.export)
    write_jsonl(out_dir / "prm_data.jsonl", rows)
    write_report({**export_stats, "merge": merged}, out_dir / "export_report.json", out_dir / "export_report.png")
    print(f"merged {merged['records']} problems {merged['by_status']}; wrote {len(rows)} PRM training rows to "
          f"{out_dir / 'prm_data.jsonl'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
