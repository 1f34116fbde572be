"""Best-of-N reranking with a PRM: candidates -> step scores -> every aggregator and baseline -> report.

    # score pre-generated candidates (our candidates format; see `mmprm convert-candidates`)
    python recipes/bon_rerank.py --config recipes/configs/tiny/bon_rerank.yaml
    # generate N samples per problem from a policy first (HF here, vLLM on GPUs)
    python recipes/bon_rerank.py --config recipes/configs/tiny/bon_rerank.yaml \
        generate.enabled=true generate.policy=runs/tiny/policy generate.problems_file=runs/tiny/data/test_problems.jsonl
    # sharded (one process per GPU or SLURM task), then merge:
    python recipes/bon_rerank.py --config C.yaml shard.index=0 shard.count=4   # ... 1, 2, 3
    mmprm merge-bon OUTPUT_DIR

Writes OUTPUT_DIR/candidates.jsonl (when generating), scored.shard*.jsonl, and - once all shards are
in - scored.jsonl, report.json, report.md and bon_curve.png.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from mmprm.config import ConfigError, load_config, parse_cli
from mmprm.data.schema import DataError, write_jsonl


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 0.9
    max_new_tokens: int = 1024
    seed: int = 0


@dataclass
class GenerateConfig:
    enabled: bool = False
    policy: str = ""
    problems_file: str = ""  # JSONL of {id, images, question, answer}
    n: int = 8
    backend: str = "hf"  # hf | vllm
    batch_size: int = 64
    step_mode: str = "tags"  # tags | blank_lines
    sampling: SamplingConfig = field(default_factory=SamplingConfig)


@dataclass
class ScoringConfig:
    batch_size: int = 16
    share_prefix: bool = True
    max_length: int | None = None
    device: str = "auto"


@dataclass
class ReportConfig:
    n_subsets: int = 32
    resamples: int = 1000
    seed: int = 0
    weighted_by: str = "min"
    title: str = "Best-of-N accuracy"


@dataclass
class ShardConfig:
    index: int = 0
    count: int = 1


@dataclass
class Config:
    prm: str = ""  # a directory written by recipes/prm_train.py
    candidates_file: str | None = None
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    shard: ShardConfig = field(default_factory=ShardConfig)
    output_dir: str = "runs/bon"

    def validate(self) -> None:
        if not self.prm:
            raise ValueError("prm: required (a PRM directory from recipes/prm_train.py)")
        if not self.generate.enabled and not self.candidates_file:
            raise ValueError("candidates_file: required unless generate.enabled=true")
        if self.generate.enabled and not (self.generate.policy and self.generate.problems_file):
            raise ValueError("generate.policy and generate.problems_file: required when generate.enabled=true")
        if not 0 <= self.shard.index < self.shard.count:
            raise ValueError(f"shard.index={self.shard.index} must be in [0, shard.count={self.shard.count})")


def generate_candidates(cfg: Config, out_dir: Path) -> Path:
    """Sample N solutions per problem with the policy, verify them, write our candidates file."""
    from mmprm.annotate.backends.base import RolloutRequest
    from mmprm.answers import answers_match
    from mmprm.rerank.candidates import load_problems
    from mmprm.steps import parse_solution

    g = cfg.generate
    problems = load_problems(g.problems_file)
    problems = problems[cfg.shard.index :: cfg.shard.count]
    backend = make_backend(cfg)
    requests = [RolloutRequest(p["id"], p["question"], p["images"], [], g.n) for p in problems]
    t0 = time.time()
    texts = backend.generate(requests)
    print(f"generated {len(problems) * g.n} candidates in {time.time() - t0:.1f}s")
    rows = []
    for p, outs in zip(problems, texts):
        cands = []
        for text in outs:
            parsed = parse_solution(text, g.step_mode)
            cands.append({"text": text, "steps": parsed.steps, "answer": parsed.answer,
                          "correct": parsed.answer is not None and answers_match(parsed.answer, p["answer"],
                                                                                  p.get("choices"))})
        rows.append({"id": p["id"], "images": p["images"], "question": p["question"], "answer": p["answer"],
                     "candidates": cands})
    path = out_dir / (f"candidates.shard{cfg.shard.index}-of-{cfg.shard.count}.jsonl" if cfg.shard.count > 1
                      else "candidates.jsonl")
    write_jsonl(path, rows)
    return path


def make_backend(cfg: Config):
    from mmprm.annotate.backends.base import SamplingConfig as BackendSampling

    s = cfg.generate.sampling
    sampling = BackendSampling(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                               max_new_tokens=s.max_new_tokens, seed=s.seed + cfg.shard.index)
    if cfg.generate.backend == "vllm":
        from mmprm.annotate.backends.vllm import VLLMBackend

        return VLLMBackend(cfg.generate.policy, sampling, step_mode=cfg.generate.step_mode)
    if cfg.generate.backend != "hf":
        raise ConfigError(f"generate.backend: {cfg.generate.backend!r} is not one of ['hf', 'vllm']")
    import torch

    from mmprm.annotate.backends.hf import HFBackend
    from mmprm.models.loading import load_backbone

    model, processor = load_backbone(cfg.generate.policy)
    model.to("cuda" if torch.cuda.is_available() else "cpu")
    return HFBackend(model, processor, sampling, step_mode=cfg.generate.step_mode, batch_size=cfg.generate.batch_size)


def main(argv: list[str]) -> None:
    config_path, overrides = parse_cli(argv)
    cfg = load_config(Config, config_path, overrides)
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    # ---- candidates ------------------------------------------------------------------------
    from mmprm.rerank.candidates import load_candidates

    if cfg.generate.enabled:
        cand_file = generate_candidates(cfg, out_dir)
        problems = load_candidates(cand_file)  # already this shard's problems
    else:
        problems = load_candidates(cfg.candidates_file)[cfg.shard.index :: cfg.shard.count]
    n_cands = sum(len(p.candidates) for p in problems)
    print(f"shard {cfg.shard.index}/{cfg.shard.count}: {len(problems)} problems, {n_cands} candidates")

    # ---- scoring: one forward per candidate, the problem's prompt encoded once ---------------
    import torch

    from mmprm.models.prm import load_prm
    from mmprm.steps import prm_steps

    device = cfg.scoring.device if cfg.scoring.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    scorer = load_prm(cfg.prm, device=device, batch_size=cfg.scoring.batch_size, max_length=cfg.scoring.max_length)
    examples = []
    for p in problems:
        for c in p.candidates:
            steps = c.steps if c.steps else [c.text]
            examples.append({"id": p.id, "question": p.question, "images": p.images,
                             "steps": prm_steps(steps, c.answer if c.steps else None)})
    t0 = time.time()
    probs = scorer.score(examples, share_prefix=cfg.scoring.share_prefix, progress=True)
    elapsed = time.time() - t0
    n_steps = sum(len(x) for x in probs)
    print(f"scored {len(examples)} candidates ({n_steps} steps) in {elapsed:.1f}s "
          f"({n_steps / max(elapsed, 1e-9):.1f} steps/s)")

    # ---- write this shard; report when the run is complete --------------------------------
    from mmprm.rerank.shards import merge_scored, report_from_scored, shard_path

    rows, k = [], 0
    for p in problems:
        cands = []
        for c in p.candidates:
            cands.append({"step_probs": probs[k], "answer": c.answer, "correct": bool(c.correct)})
            k += 1
        rows.append({"id": p.id, "candidates": cands})
    write_jsonl(shard_path(out_dir, cfg.shard.index, cfg.shard.count), rows)
    if cfg.shard.count == 1:
        merged = merge_scored(out_dir)
        r = cfg.report
        report = report_from_scored(merged, out_dir, r.n_subsets, r.resamples, r.seed, r.weighted_by, r.title)
        n = str(report["n_max"])
        summary = {m: round(v[n]["mean"], 4) for m, v in report["methods"].items()}
        print(json.dumps({"n_max": report["n_max"], "accuracy_at_n_max": summary}))
        print(f"wrote {out_dir / 'report.md'} and {out_dir / 'bon_curve.png'}")
    else:
        print(f"wrote shard {cfg.shard.index}; after all {cfg.shard.count} shards: mmprm merge-bon {out_dir}")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ConfigError, DataError, FileNotFoundError) as e:
        print(f"bon_rerank: {e}", file=sys.stderr)
        sys.exit(2)
