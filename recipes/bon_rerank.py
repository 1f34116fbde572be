r"""Best-of-N reranking with a PRM: candidates -> step scores -> every aggregator and baseline -> report.

    # score pre-generated candidates (our candidates format; see `mmprm convert-candidates`)
    python recipes/bon_rerank.py --config recipes/configs/tiny/bon_rerank.yaml
    # generate N samples per problem from a policy first (generate.backend=hf, or vllm on GPUs)
    python recipes/bon_rerank.py --config recipes/configs/tiny/bon_rerank.yaml generate.enabled=true \
        generate.policy=runs/tiny/toy_policy generate.problems_file=runs/tiny/toy_problems/problems.jsonl
    # sharded (one process per GPU or SLURM task; launch/slurm/bon_rerank.sbatch), then merge:
    python recipes/bon_rerank.py --config C.yaml shard.index=0 shard.count=4   # ... 1, 2, 3
    mmprm merge-bon OUTPUT_DIR

Writes to OUTPUT_DIR: candidates[.shardI-of-C].jsonl (when generating), scored.shardI-of-C.jsonl,
report_settings.json, and - once all shards are in - scored.jsonl, report.json, report.md and
bon_curve.png. A shard is a contiguous block of the problems, so the merged scores equal an
unsharded run's (generation is not: each shard samples its own seed).

With `scoring.max_length` set, a candidate whose steps do not all fit is scored on the steps that
do and marked `truncated`; such a candidate is ranked last by every PRM aggregator (it never wins
on a partial score), weighs nothing in the weighted vote, and is counted in report.json/md.
Raise `scoring.max_length` (or leave it unset) to score every step.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from mmprm.config import ConfigError, load_config, parse_cli, require_model_dir
from mmprm.data.schema import DataError, write_jsonl


@dataclass
class SamplingConfig:
    """Sampling of the N candidates.

    Attributes:
        temperature: sampling temperature (> 0: candidates must differ)
        top_k: keep the k most likely tokens (0 turns it off)
        top_p: nucleus sampling mass
        max_new_tokens: token cap per candidate
        seed: base seed; shard I samples with seed + I
    """

    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 0.9
    max_new_tokens: int = 4096  # MM-PRM's cap, as in annotation
    seed: int = 0


@dataclass
class GenerateConfig:
    """Generate candidates from a policy first (else read candidates_file).

    Attributes:
        enabled: sample N candidates per problem before scoring
        policy: the policy model directory (required when enabled)
        problems_file: JSONL of {id, images, question, answer, choices?} (required when enabled)
        n: candidates per problem
        backend: hf (transformers generate) | vllm
        batch_size: hf: sequences per generate call
        step_mode: how steps are written and read: tags (SFT'd policy) | blank_lines; unset (null)
            takes the policy's saved spec (mmprm_policy.json from recipes/policy_sft.py), else tags
        system_prompt: system prompt sent to the policy; unset takes the saved spec, "" sends none
        sampling: sampling settings (section)
        vllm_kwargs: vllm: extra vllm.LLM arguments, e.g. {enforce_eager: true}
    """

    enabled: bool = False
    policy: str = ""
    problems_file: str = ""
    n: int = 8
    backend: Literal["hf", "vllm"] = "hf"
    batch_size: int = 64
    step_mode: Literal["tags", "blank_lines"] | None = None
    system_prompt: str | None = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class ScoringConfig:
    """How the PRM scores candidates.

    Attributes:
        batch_size: candidates per forward
        share_prefix: run the shared image + question prefix once per problem (same scores, faster)
        max_length: tokens per candidate; trailing steps past it are not scored; null: no truncation
        device: auto (cuda when available, else cpu), cpu, cuda or cuda:N
    """

    batch_size: int = 16
    share_prefix: bool = True
    max_length: int | None = None
    device: str = "auto"


@dataclass
class ReportConfig:
    """The Best-of-N report.

    Attributes:
        n_subsets: candidate subsets per problem and N (all of them when C(n_max, N) is at most this)
        resamples: bootstrap resamples over problems for the 95% intervals
        seed: seed of the subsets and resamples
        weighted_by: aggregator whose scores weight the weighted_vote baseline (a probability-scale one)
        title: title of report.md and the plot
    """

    n_subsets: int = 32
    resamples: int = 1000
    seed: int = 0
    weighted_by: str = "min"
    title: str = "Best-of-N accuracy"


@dataclass
class ShardConfig:
    """This process's share of the problems (contiguous blocks).

    Attributes:
        index: this shard, 0 <= index < count
        count: number of shards; `mmprm merge-bon OUTPUT_DIR` joins them
    """

    index: int = 0
    count: int = 1


@dataclass
class ModelConfig:
    """Model loading.

    Attributes:
        attn_implementation: attention kernel of every model this recipe loads: sdpa | flash_attention_2
            (mmprm[flash], CUDA) | eager | auto (flash-attn when installed and a GPU is visible, else sdpa)
    """

    attn_implementation: str = "sdpa"


@dataclass
class Config:
    """bon_rerank settings.

    Attributes:
        prm: PRM directory written by recipes/prm_train.py; required
        candidates_file: our candidates JSONL (`mmprm convert-candidates`); unused when generate.enabled
        model: model loading (section)
        generate: generation (section)
        scoring: scoring (section)
        report: report (section)
        shard: sharding (section)
        output_dir: where candidates, scores, report.json/.md and bon_curve.png go
    """

    prm: str = ""
    candidates_file: str | None = None
    model: ModelConfig = field(default_factory=ModelConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    shard: ShardConfig = field(default_factory=ShardConfig)
    output_dir: str = "runs/bon"

    def validate(self) -> None:
        if not self.prm:
            raise ValueError("prm: required (a PRM directory from recipes/prm_train.py)")
        from mmprm.models.loading import resolve_attn_implementation

        resolve_attn_implementation(self.model.attn_implementation)  # before any weight loads
        if not self.generate.enabled and not self.candidates_file:
            raise ValueError("candidates_file: required unless generate.enabled=true")
        if self.generate.enabled and not (self.generate.policy and self.generate.problems_file):
            raise ValueError("generate.policy and generate.problems_file: required when generate.enabled=true")
        if self.generate.n < 1 or self.generate.batch_size < 1:
            raise ValueError("generate.n and generate.batch_size: must be >= 1")
        if not 0 <= self.shard.index < self.shard.count:
            raise ValueError(f"shard.index={self.shard.index} must be in [0, shard.count={self.shard.count})")
        from mmprm.scoring.aggregators import AGGREGATORS

        vote_weights = [m for m in AGGREGATORS if m not in ("sum_logpr", "sum_logodds")]  # must be >= 0
        if self.report.weighted_by not in vote_weights:
            raise ValueError(f"report.weighted_by: {self.report.weighted_by!r} is not one of {vote_weights}")


def generate_candidates(cfg: Config, out_dir: Path) -> Path:
    """Sample N solutions per problem of this shard, verify them, write our candidates file.

    Each candidate's `steps` are `prm_steps(parsed steps, parsed answer)`: the PRM sees the answer
    it judges, exactly as in training. Nothing parsed -> `steps: []` (scored on the whole text).
    """
    from mmprm.annotate.backends.base import RolloutRequest
    from mmprm.answers import answers_match
    from mmprm.rerank.candidates import Candidate, load_problems, write_candidates
    from mmprm.rerank.shards import take_shard
    from mmprm.steps import parse_solution, prm_steps

    g = cfg.generate
    problems = take_shard(load_problems(g.problems_file), cfg.shard.index, cfg.shard.count)
    backend = make_backend(cfg)
    per_call = max(1, g.batch_size // g.n)  # problems per backend call: about batch_size sequences
    t0 = time.time()
    for lo in range(0, len(problems), per_call):
        chunk = problems[lo : lo + per_call]
        texts = backend.generate([RolloutRequest(p.id, p.question, p.images, [], g.n) for p in chunk])
        for p, outs in zip(chunk, texts):
            for text in outs:
                parsed = parse_solution(text, backend.step_mode)
                correct = answers_match(parsed.answer, p.answer, p.choices)  # None answer -> False
                p.candidates.append(
                    Candidate(
                        text=text,
                        steps=prm_steps(parsed.steps, parsed.answer),
                        answer=parsed.answer,
                        correct=correct,
                        meta={"complete": parsed.complete},
                    )
                )
        done, elapsed = lo + len(chunk), time.time() - t0
        print(
            f"generated {done}/{len(problems)} problems x {g.n} in {elapsed:.0f}s "
            f"(ETA {elapsed / done * (len(problems) - done):.0f}s)",
            flush=True,
        )
    n_parsed = sum(bool(c.steps) for p in problems for c in p.candidates)
    n_correct = sum(bool(c.correct) for p in problems for c in p.candidates)
    print(f"{len(problems) * g.n} candidates: {n_parsed} with parsable steps, {n_correct} correct")
    name = (
        f"candidates.shard{cfg.shard.index}-of-{cfg.shard.count}.jsonl" if cfg.shard.count > 1 else "candidates.jsonl"
    )
    write_candidates(out_dir / name, problems)
    return out_dir / name


def make_backend(cfg: Config):
    """The generation backend, prompting the policy as its SFT saved it (`mmprm_policy.json`)
    unless `generate.system_prompt` / `generate.step_mode` say otherwise (then with a warning)."""
    from mmprm.annotate.backends import make_rollout_backend
    from mmprm.annotate.backends.base import SamplingConfig as BackendSampling
    from mmprm.annotate.backends.base import worker_seed
    from mmprm.policy import resolve_prompt_format

    s = cfg.generate.sampling
    # Each shard samples its own stream; a rerun of the same shard samples the same candidates.
    sampling = BackendSampling(
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        max_new_tokens=s.max_new_tokens,
        seed=worker_seed(s.seed, cfg.shard.index),
    )
    try:
        system, step_mode = resolve_prompt_format(
            cfg.generate.policy, cfg.generate.system_prompt, cfg.generate.step_mode, where="bon_rerank generate"
        )
    except ValueError as e:  # a broken mmprm_policy.json
        raise ConfigError(f"generate.policy: {e}") from None
    return make_rollout_backend(
        cfg.generate.policy,
        sampling,
        step_mode,
        system,
        backend=cfg.generate.backend,
        batch_size=cfg.generate.batch_size,
        attn_implementation=cfg.model.attn_implementation,
        vllm_kwargs=cfg.generate.vllm_kwargs,
    )


def main(argv: list[str]) -> None:
    config_path, overrides = parse_cli(argv, Config)
    cfg = load_config(Config, config_path, overrides)
    if cfg.generate.enabled:  # generation can take hours: a typo in either path must not wait for it
        require_model_dir(cfg, "generate.policy")
        require_model_dir(cfg, "prm", hub=False)
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    # ---- candidates ------------------------------------------------------------------------
    from mmprm.rerank.candidates import load_candidates
    from mmprm.rerank.shards import SETTINGS_FILE, take_shard

    if cfg.generate.enabled:
        cand_file = generate_candidates(cfg, out_dir)
        problems = load_candidates(cand_file)  # already this shard's problems; validated on the way back
    else:
        cand_file = Path(cfg.candidates_file)
        problems = take_shard(load_candidates(cand_file), cfg.shard.index, cfg.shard.count)
    # Every report number needs each candidate's verdict: refuse before any scoring.
    unknown = [
        f"{cand_file}: id={p.id}: candidates[{j}].correct: unknown (give the problem's gold `answer` "
        "or each candidate's `correct`)"
        for p in problems
        for j, c in enumerate(p.candidates)
        if c.correct is None
    ]
    if unknown:
        raise DataError(unknown)
    n_cands = sum(len(p.candidates) for p in problems)
    print(f"shard {cfg.shard.index}/{cfg.shard.count}: {len(problems)} problems, {n_cands} candidates")

    # ---- scoring: one forward per candidate, the problem's prompt encoded once ---------------
    from mmprm.models.loading import resolve_device
    from mmprm.models.prm import load_prm
    from mmprm.steps import StepTokenError

    device = resolve_device(cfg.scoring.device)
    require_model_dir(cfg, "prm", hub=False)
    scorer = load_prm(
        cfg.prm,
        device=device,
        batch_size=cfg.scoring.batch_size,
        max_length=cfg.scoring.max_length,
        attn_implementation=cfg.model.attn_implementation,
    )
    # Steps are what the PRM scores (answer attached); a candidate with no steps is scored on its
    # whole text as one step, and one with no text either is left out (its score is 0).
    inputs = [[{**x, "id": f"{p.id}/candidates[{j}]"} for j, x in enumerate(p.prm_inputs())] for p in problems]
    examples = [x for xs in inputs for x in xs if x["steps"]]
    t0 = time.time()
    try:
        probs = iter(scorer.score(examples, share_prefix=cfg.scoring.share_prefix, progress=True))
    except StepTokenError:
        for p, xs in zip(problems, inputs):  # name the candidate whose text the PRM's tokenizer cannot take
            for j, x in enumerate(xs):
                try:
                    scorer.tokenize(x)
                except StepTokenError as e:
                    raise DataError([f"{cand_file}: id={p.id}: candidates[{j}]: {e}"]) from None
        raise
    except ValueError as e:  # the scorer names the candidate, e.g. a prompt longer than max_length
        raise ConfigError(f"scoring: {e}") from e
    elapsed = time.time() - t0
    n_steps = sum(len(x["steps"]) for x in examples)
    print(
        f"scored {len(examples)} candidates ({n_steps} steps) in {elapsed:.1f}s "
        f"({n_steps / max(elapsed, 1e-9):.1f} steps/s)"
    )

    # ---- write this shard; report when the run is complete --------------------------------
    from mmprm.rerank.shards import merge_scored, report_from_scored, shard_path

    rows, dropped, cut = [], 0, 0
    for p, xs in zip(problems, inputs):
        cands = []
        for c, x in zip(p.candidates, xs):
            step_probs = next(probs) if x["steps"] else []
            # Steps past scoring.max_length come back NaN: keep the scored prefix for inspection,
            # and mark the candidate so the report ranks it last instead of trusting a partial score.
            kept = [q for q in step_probs if not math.isnan(q)]
            row = {"step_probs": kept, "answer": c.answer, "correct": bool(c.correct)}
            if len(kept) < len(step_probs):
                row["truncated"] = True
                dropped += len(step_probs) - len(kept)
                cut += 1
            cands.append(row)
        rows.append({"id": p.id, "candidates": cands})
    if cut:
        print(
            f"warning: {cut} candidates ({dropped} steps) did not fit scoring.max_length={cfg.scoring.max_length}: "
            "they are ranked last by every aggregator; raise scoring.max_length to score them fully"
        )
    write_jsonl(shard_path(out_dir, cfg.shard.index, cfg.shard.count), rows)
    (out_dir / SETTINGS_FILE).write_text(json.dumps(asdict(cfg.report), indent=2) + "\n")
    if cfg.shard.count == 1:
        merged = merge_scored(out_dir, count=1)
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
