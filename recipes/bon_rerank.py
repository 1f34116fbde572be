r"""Best-of-N reranking with a PRM: candidates -> step scores -> every aggregator and baseline -> report.

    # score pre-generated candidates (our candidates format; see `mmprm convert-candidates`)
    python recipes/bon_rerank.py --config recipes/configs/tiny/bon_rerank.yaml
    # generate N samples per problem from a policy first (policy.backend=hf, or vllm on GPUs)
    python recipes/bon_rerank.py --config recipes/configs/tiny/bon_rerank.yaml generate.enabled=true \
        policy.path=runs/tiny/toy_policy generate.problems_file=runs/tiny/toy_problems/problems.jsonl
    # sharded (one process per GPU or SLURM task; launch/slurm/bon_rerank.sbatch), then merge:
    python recipes/bon_rerank.py --config C.yaml shard.index=0 shard.count=4   # ... 1, 2, 3
    mmprm merge-bon OUTPUT_DIR

Writes to OUTPUT_DIR: candidates[.shardI-of-C].jsonl (when generating), scored.shardI-of-C.jsonl,
report_settings.json, and - once all shards are in - scored.jsonl, report.json, report.md and
bon_curve.png. A shard is a contiguous block of the problems, so the merged scores equal an
unsharded run's (generation is not: each shard samples its own seed).

With `prm.max_length` set, a candidate whose steps do not all fit is scored on the steps that
do and marked `truncated`; such a candidate is ranked last by every PRM aggregator (it never wins
on a partial score), weighs nothing in the weighted vote, and is counted in report.json/md.
Raise `prm.max_length` (or leave it unset) to score every step.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from mmprm.chat import ChatConfig, ChatError
from mmprm.config import ConfigError, load_config, parse_cli, require_model_dir
from mmprm.config_sections import ModelLoadConfig, PolicyConfig, PRMScorerConfig, ShardConfig
from mmprm.data.schema import DataError
from mmprm.scoring.aggregators import EdgeRules


@dataclass
class BenchmarkConfig:
    """An answer benchmark as the problems to sample for (instead of generate.problems_file).

    Attributes:
        name: mathvista | mathverse | mathvision | olympiadbench | mmk12; null: none
            (mmprm.data.eval_sets: each read in its released format, judged by its own answer rule)
        source: the released file or folder, a save_to_disk / parquet copy, or a Hub dataset id;
            null: the benchmark's Hub id
        split: null: the benchmark's evaluation split (testmini, test, ...)
        subset: OlympiadBench's subset; null: OE_MM_maths_en_COMP (MM-PRM's)
        image_root: where the rows' relative image paths start; null: the source file's folder
        limit: the first N problems only; null: all
    """

    name: Literal["mathvista", "mathverse", "mathvision", "olympiadbench", "mmk12"] | None = None
    source: str | None = None
    split: str | None = None
    subset: str | None = None
    image_root: str | None = None
    limit: int | None = None


@dataclass
class GenerateConfig:
    """Generate candidates from the policy first (else read candidates_file).

    Attributes:
        enabled: sample N candidates per problem from `policy` before scoring
        problems_file: JSONL of {id, images, question, answer, choices?} (required when enabled,
            unless generate.benchmark names one)
        benchmark: an answer benchmark as the problems (section); its report breaks accuracy down by
            the benchmark's own columns
        n: candidates per problem
        extraction: how each candidate's answer is read and judged: rules (offline: the answer
            parsed from the reply, judged by the benchmark's rule) | llm (the benchmark authors' own
            LLM extraction - MathVista's few-shot GPT extraction, MathVerse's extract-then-judge -
            asked of generate.judge; MathVista and MathVerse only; mmprm.data.eval_sets.llm_extract)
        judge: extraction=llm: the OpenAI-compatible endpoint (mmprm.chat.ChatConfig keys); its
            replies are cached in OUTPUT_DIR/extraction_cache.jsonl
    """

    enabled: bool = False
    problems_file: str = ""
    benchmark: BenchmarkConfig = field(default_factory=BenchmarkConfig)
    n: int = 8
    extraction: Literal["rules", "llm"] = "rules"
    judge: ChatConfig = field(default_factory=ChatConfig)


@dataclass
class RerankPRMConfig(PRMScorerConfig):
    """The PRM that scores the candidates (mmprm.config_sections.PRMScorerConfig).

    Attributes:
        path: PRM directory written by recipes/prm_train.py; required
        batch_size: candidates per forward
    """

    batch_size: int = 16


@dataclass
class ScoringConfig:
    """How the candidates are scored.

    Attributes:
        share_prefix: run the shared image + question prefix once per problem (same scores, faster)
        chunk_problems: problems read, scored and written to the shard file at a time: memory holds
            one chunk, and a killed run resumes after the last chunk it wrote
    """

    share_prefix: bool = True
    chunk_problems: int = 256

    def validate(self) -> None:
        if self.chunk_problems < 1:
            raise ValueError(f"scoring.chunk_problems: {self.chunk_problems} must be >= 1")


@dataclass
class ReportConfig:
    """The Best-of-N report.

    Attributes:
        n_subsets: candidate subsets per problem and N (all of them when C(n_max, N) is at most this)
        resamples: bootstrap resamples over problems for the 95% intervals
        seed: seed of the subsets and resamples
        weighted_by: aggregator whose scores weight the weighted_vote baseline (a probability-scale one)
        edge_rules: every aggregator's rules for an empty candidate and p = 0 or 1: mmprm (clamped to
            [1e-6, 1 - 1e-6], an empty candidate lowest) | mm_prm (MM-PRM's eval/prm/extract_calculate.py:
            an empty candidate 0, +/-9999 sentinels; mmprm.scoring.aggregators); a truncated candidate
            ranks last under both
        title: title of report.md and the plot
    """

    n_subsets: int = 32
    resamples: int = 1000
    seed: int = 0
    weighted_by: str = "min"
    edge_rules: EdgeRules = "mmprm"
    title: str = "Best-of-N accuracy"


@dataclass
class BonRerankConfig:
    """bon_rerank settings.

    Attributes:
        prm: the PRM (section); prm.path required
        candidates_file: our candidates JSONL (`mmprm convert-candidates`), or a file that
            candidates_reader reads; unused when generate.enabled
        candidates_reader: null: candidates_file is our candidates JSONL; a name: the Best-of-N
            candidates reader (mmprm.data.readers: mathv, gsm8k, qwen_math, text, or one you
            registered) that reads candidates_file, written as OUTPUT_DIR/candidates.<name>.jsonl first
        model: model loading (section)
        policy: the policy that generates when generate.enabled (section)
        generate: generation (section)
        scoring: scoring (section)
        report: report (section)
        shard: sharding (section)
        output_dir: where candidates, scores, report.json/.md and bon_curve.png go
    """

    prm: RerankPRMConfig = field(default_factory=RerankPRMConfig)
    candidates_file: str | None = None
    candidates_reader: str | None = None
    model: ModelLoadConfig = field(default_factory=ModelLoadConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    shard: ShardConfig = field(default_factory=ShardConfig)
    output_dir: str = "runs/bon"

    # Keys read under their old names for one release (mmprm.config), with a warning.
    RENAMED_KEYS: ClassVar[dict[str, str]] = {
        "prm": "prm.path",
        **{f"scoring.{k}": f"prm.{k}" for k in ("batch_size", "max_length", "device", "backend", "convention")},
        "scoring.vllm_kwargs": "prm.vllm.kwargs",
        "generate.policy": "policy.path",
        **{f"generate.{k}": f"policy.{k}" for k in ("backend", "batch_size", "step_mode", "system_prompt", "sampling")},
        "generate.vllm_kwargs": "policy.vllm.kwargs",
    }

    def validate(self) -> None:
        if not self.prm.path:
            raise ValueError("prm.path: required (a PRM directory from recipes/prm_train.py)")
        from mmprm.models.loading import resolve_attn_implementation

        resolve_attn_implementation(self.model.attn_implementation)  # before any weight loads
        if not self.generate.enabled and not self.candidates_file:
            raise ValueError("candidates_file: required unless generate.enabled=true")
        if self.candidates_reader is not None:
            from mmprm.data.readers import UnknownReaderError, get_reader

            try:
                get_reader("candidates", self.candidates_reader)
            except UnknownReaderError as e:
                raise ValueError(f"candidates_reader: {e}") from None
        g = self.generate
        if g.enabled and not (self.policy.path and (g.problems_file or g.benchmark.name)):
            raise ValueError(
                "policy.path and generate.problems_file (or generate.benchmark.name): required when "
                "generate.enabled=true"
            )
        if g.problems_file and g.benchmark.name:
            raise ValueError("generate.problems_file and generate.benchmark.name: give one, not both")
        if self.generate.n < 1:
            raise ValueError("generate.n: must be >= 1")
        if g.extraction == "llm":
            if g.benchmark.name not in (None, "mathvista", "mathverse"):
                raise ValueError(
                    f"generate.extraction=llm: {g.benchmark.name} has no LLM extraction of its authors here "
                    "(MathVista's and MathVerse's only); use generate.extraction=rules"
                )
            if not (g.judge.url and g.judge.model):
                raise ValueError("generate.extraction=llm: set generate.judge.url and generate.judge.model")
        from mmprm.scoring.aggregators import AGGREGATORS

        vote_weights = [m for m in AGGREGATORS if m not in ("sum_logpr", "sum_logodds")]  # must be >= 0
        if self.report.weighted_by not in vote_weights:
            raise ValueError(f"report.weighted_by: {self.report.weighted_by!r} is not one of {vote_weights}")


def generate_candidates(cfg: BonRerankConfig, out_dir: Path) -> Path:
    """Sample N solutions per problem of this shard, verify them, write our candidates file.

    Each candidate's `steps` are `prm_steps(parsed steps, parsed answer)`: the PRM sees the answer
    it judges, exactly as in training. Nothing parsed -> `steps: []` (scored on the whole text).
    Each backend call's problems are appended (fsync'ed) to `<file>.partial` as they finish; a
    killed run resumes after the last one written, and the finished file is only renamed into place.
    """
    from mmprm.data import store
    from mmprm.rerank.candidates import count_rows, load_problems_for_generation
    from mmprm.rerank.shards import shard_bounds

    g = cfg.generate
    problems_file = Path(g.problems_file) if g.problems_file else benchmark_problems(g.benchmark, out_dir)
    name = (
        f"candidates.shard{cfg.shard.index}-of-{cfg.shard.count}.jsonl" if cfg.shard.count > 1 else "candidates.jsonl"
    )
    final = out_dir / name
    partial = final.with_name(name + ".partial")
    run = {"policy": str(Path(cfg.policy.path).resolve()), "problems_file": str(problems_file.resolve()), "n": g.n}
    run["sampling"] = asdict(cfg.policy.sampling)
    if g.extraction != "rules":  # verdicts from another extraction are another run's
        run["extraction"] = f"{g.extraction}:{g.judge.model}"
    store.check_same_run(final.with_name(name + ".run.json"), run, final, partial)
    if final.exists():
        print(f"candidates already generated ({final}); delete it to sample again")
        return final
    done = store.resume(partial)
    lo, hi = shard_bounds(count_rows(problems_file), cfg.shard.index, cfg.shard.count)
    in_block = lambda i: lo <= i < hi  # noqa: E731
    problems = load_problems_for_generation(problems_file, check_rows=in_block, keep_rows=in_block)  # every row checked
    todo = [p for p in problems if p.id not in done]
    if done:
        print(f"resuming: {len(done)} problems already sampled in {partial}, {len(todo)} to go")
    if not problems:  # more shards than problems: an empty block, and no engine to start for it
        final.touch()
        return final
    judge = None
    if g.extraction == "llm":
        from mmprm.chat import ChatClient

        judge = ChatClient(g.judge, config_key="generate.judge", cache_path=out_dir / "extraction_cache.jsonl")
    # Each shard samples its own stream; a rerun of the same shard samples the same candidates.
    backend = cfg.policy.build(cfg.model.attn_implementation, sampling=cfg.policy.sampling_for(cfg.shard.index))
    try:
        sample_into(partial, backend, todo, cfg, len(done), len(problems), judge)
    finally:
        # The PRM loads next on the same GPU: stop the engine now (the memory it took), not at exit.
        backend.close()
    os.replace(partial, final)
    return final


def benchmark_problems(bench: BenchmarkConfig, out_dir: Path) -> Path:
    """OUT_DIR/problems.jsonl: the benchmark's problems (images beside it where the rows hold them).

    Written once, atomically (shards that start together write the same rows); a rerun reuses it.
    """
    from mmprm.data.eval_sets import SOURCES, read_eval_set, write_problems

    path = out_dir / "problems.jsonl"
    if path.exists():
        return path
    rows = read_eval_set(bench.name, bench.source, bench.split, bench.subset, bench.image_root, out_dir / "images")[
        : bench.limit
    ]
    tmp = path.with_name(f"problems.jsonl.{os.getpid()}.tmp")
    write_problems(rows, tmp)
    os.replace(tmp, path)
    split, hub = SOURCES[bench.name]
    print(f"{bench.name}: {len(rows)} problems from {bench.source or hub} ({bench.split or split}) in {path}")
    return path


def extraction_label(cfg: BonRerankConfig) -> str:
    """Which extraction gave the candidates' verdicts, as the report names it."""
    g = cfg.generate
    if not g.enabled:
        return f"as recorded in {cfg.candidates_file}"
    if g.extraction == "llm":
        return f"llm ({g.judge.model} at {g.judge.url}; the benchmark authors' prompts)"
    return "rules"


def sample_into(
    partial: Path,
    backend: Any,
    todo: list[Any],
    cfg: BonRerankConfig,
    n_done: int,
    n_problems: int,
    judge: Any = None,
) -> None:
    """Sample and verify `todo`'s solutions, appending each problem's row to `partial`.

    A candidate is judged by the rule of its problem's benchmark (`mmprm.data.eval_sets.answer_correct`;
    `mmprm.answers.answers_match` for other problems), or with `judge` (a `ChatClient`) by the
    benchmark's LLM extraction on the whole reply (`mmprm.data.eval_sets.llm_extract`)."""
    from mmprm.data import store
    from mmprm.data.eval_sets import answer_correct
    from mmprm.generation.base import RolloutRequest, problems_per_call
    from mmprm.rerank.candidates import Candidate
    from mmprm.steps import parse_solution, prm_steps

    g = cfg.generate
    per_call = problems_per_call(backend, g.n, cfg.policy.batch_size)
    t0, n_parsed, n_correct = time.time(), 0, 0
    with store.open_append(partial) as f:
        for lo in range(0, len(todo), per_call):
            chunk = todo[lo : lo + per_call]
            texts = backend.generate([RolloutRequest(p.id, p.question, p.images, [], g.n) for p in chunk])
            for p, outs in zip(chunk, texts):
                verdicts = llm_verdicts(judge, outs, p) if judge is not None else [None] * len(outs)
                for text, verdict in zip(outs, verdicts):
                    parsed = parse_solution(text, backend.step_mode)
                    meta: dict[str, Any] = {"complete": parsed.complete}
                    if verdict is None:
                        correct = answer_correct(parsed.answer, p)  # None answer -> False
                    else:
                        correct, meta["extraction"] = verdict.correct, verdict.extraction
                    p.candidates.append(
                        Candidate(
                            text=text,
                            steps=prm_steps(parsed.steps, parsed.answer),
                            answer=parsed.answer,
                            correct=correct,
                            meta=meta,
                        )
                    )
                    n_parsed += bool(p.candidates[-1].steps)
                    n_correct += bool(correct)
                store.append_row(f, p.to_json())
                p.candidates = []  # written: keep no text in memory
            finished, elapsed = lo + len(chunk), time.time() - t0
            print(
                f"generated {n_done + finished}/{n_problems} problems x {g.n} in {elapsed:.0f}s "
                f"(ETA {elapsed / finished * (len(todo) - finished):.0f}s)",
                flush=True,
            )
    print(f"{len(todo) * g.n} candidates sampled in this run: {n_parsed} with parsable steps, {n_correct} correct")


def llm_verdicts(judge: Any, texts: list[str], problem: Any) -> list[Any]:
    """Each reply of `problem` judged by its benchmark's LLM extraction, `judge.config.concurrency` at once."""
    from mmprm.data.eval_sets.llm_extract import llm_answer_correct

    try:
        return judge.map(lambda text: llm_answer_correct(judge, text, problem), texts)
    except ValueError as e:  # a problem of a benchmark without an LLM protocol
        raise ConfigError(f"generate.extraction=llm: {e}") from None


def batched(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    """Lists of `size` items (the last may be shorter), pulled from `items` as needed."""
    it = iter(items)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


def score_chunk(scorer: Any, problems: list[Any], share_prefix: bool, cand_file: Path) -> tuple[list[dict], dict]:
    """Score every candidate of `problems`: one shard-file row per problem, and counts.

    Steps are what the PRM scores (answer attached); a candidate with no steps is scored on its
    whole text as one step, and one with no text either is left out (its score is 0). Steps past
    prm.max_length come back NaN: the scored prefix is kept for inspection, and the candidate
    is marked so the report ranks it last instead of trusting a partial score.
    """
    from mmprm.steps import StepTokenError

    inputs = [[{**x, "id": f"{p.id}/candidates[{j}]"} for j, x in enumerate(p.prm_inputs())] for p in problems]
    examples = [x for xs in inputs for x in xs if x["steps"]]
    try:
        probs = iter(scorer.score(examples, share_prefix=share_prefix, progress=False))
    except StepTokenError:
        for p, xs in zip(problems, inputs):  # name the candidate whose text the PRM's tokenizer cannot take
            for j, x in enumerate(xs):
                try:
                    scorer.tokenize(x)
                except StepTokenError as e:
                    raise DataError([f"{cand_file}: id={p.id}: candidates[{j}]: {e}"]) from None
        raise
    except ValueError as e:  # the scorer names the candidate, e.g. a prompt longer than max_length
        raise ConfigError(f"prm: {e}") from e
    rows, stats = [], {"candidates": len(examples), "steps": sum(len(x["steps"]) for x in examples)}
    stats["dropped_steps"] = stats["cut"] = 0
    for p, xs in zip(problems, inputs):
        cands = []
        for c, x in zip(p.candidates, xs):
            step_probs = next(probs) if x["steps"] else []
            kept = [q for q in step_probs if not math.isnan(q)]
            row = {"step_probs": kept, "answer": c.answer, "correct": bool(c.correct)}
            if len(kept) < len(step_probs):
                row["truncated"] = True
                stats["dropped_steps"] += len(step_probs) - len(kept)
                stats["cut"] += 1
            cands.append(row)
        # a benchmark's category columns go with the scores: the report breaks accuracy down by them
        rows.append({"id": p.id, **({"meta": p.meta} if p.meta else {}), "candidates": cands})
    return rows, stats


def main(argv: list[str]) -> None:
    """Candidates of this shard (generated or read), scored by the PRM, then the report once the
    run is complete."""
    config_path, overrides = parse_cli(argv, BonRerankConfig)
    cfg = load_config(BonRerankConfig, config_path, overrides)
    if cfg.generate.enabled:  # generation can take hours: a typo in either path must not wait for it
        require_model_dir(cfg, "policy.path")
        require_model_dir(cfg, "prm.path", hub=False)
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    cand_file, lo, hi, n_problems = shard_candidates(cfg, out_dir)
    score_shard(cfg, out_dir, cand_file, lo, hi, n_problems)
    write_report(cfg, out_dir)


def shard_candidates(cfg: BonRerankConfig, out_dir: Path) -> tuple[Path, int, int | None, int]:
    """(candidates file, first row, end row (None: to the end), problems): this shard's block of
    the candidates, generated first when generate.enabled, and checked before any scoring."""
    from mmprm.rerank.candidates import check_candidates, count_rows
    from mmprm.rerank.shards import shard_bounds

    if cfg.generate.enabled:
        cand_file, lo, hi = generate_candidates(cfg, out_dir), 0, None  # the file is this shard's block
        empty = count_rows(cand_file) == 0
    else:
        cand_file = Path(cfg.candidates_file)
        if not cand_file.exists():
            raise DataError([f"{cand_file}: file not found (write it with `mmprm convert-candidates`)"])
        if cfg.candidates_reader is not None:
            cand_file = read_candidates(cfg.candidates_reader, cand_file, out_dir)
        n_rows = count_rows(cand_file)
        lo, hi = shard_bounds(n_rows, cfg.shard.index, cfg.shard.count)
        empty = n_rows > 0 and lo == hi  # an empty file is refused below, as bad input
    if empty:
        # More shards than problems: this shard's block is empty, but merge-bon needs its file.
        print(f"shard {cfg.shard.index}/{cfg.shard.count}: no problems (the run has fewer problems than shards)")
        return cand_file, lo, hi, 0
    # Every report number needs each candidate's verdict: refuse before any scoring.
    n_problems, n_cands = check_candidates(cand_file, lo, hi, need_correct=True)
    print(f"shard {cfg.shard.index}/{cfg.shard.count}: {n_problems} problems, {n_cands} candidates")
    return cand_file, lo, hi, n_problems


def read_candidates(reader: str, source: Path, out_dir: Path) -> Path:
    """OUT_DIR/candidates.<reader>.jsonl: `source` read by the candidates reader `reader`, written
    in our format (atomically: shards that start together write the same rows)."""
    from mmprm.data.readers import get_reader
    from mmprm.rerank.candidates import write_candidates

    path = out_dir / f"candidates.{reader}.jsonl"
    problems = get_reader("candidates", reader)(source)
    write_candidates(path, problems)
    print(f"{source}: {len(problems)} problems read by the {reader} candidates reader into {path}")
    return path


def score_shard(cfg: BonRerankConfig, out_dir: Path, cand_file: Path, lo: int, hi: int | None, n_problems: int) -> None:
    """The shard's scored file: rows appended chunk by chunk to `<file>.partial` (a killed run
    resumes after the last chunk written), renamed into place once every problem is scored."""
    from mmprm.data import store
    from mmprm.rerank.candidates import iter_candidates
    from mmprm.rerank.shards import shard_path

    final = shard_path(out_dir, cfg.shard.index, cfg.shard.count)
    partial = final.with_name(final.name + ".partial")
    # A resumed shard must come from the same PRM, candidates and scoring, or its rows would mix two runs.
    run = {
        "prm": str(Path(cfg.prm.path).resolve()),
        "convention": cfg.prm.convention,
        "candidates_file": str(cand_file.resolve()),
        "share_prefix": cfg.scoring.share_prefix,
        "max_length": cfg.prm.max_length,
        # The scores do not depend on it, but merge-bon reports every shard under one rule. None for
        # mmprm's own rules, so that a run file without the key reads as them.
        "edge_rules": None if cfg.report.edge_rules == "mmprm" else cfg.report.edge_rules,
    }
    store.check_same_run(final.with_name(final.name + ".run.json"), run, final, partial)
    if final.exists():
        print(f"shard {cfg.shard.index} already scored ({final}); delete it to rescore")
        return
    if n_problems == 0:  # an empty shard: its empty file, without loading the PRM
        final.touch()
        return
    done = store.resume(partial)
    if done:
        print(f"resuming: {len(done)} problems already scored in {partial}")
    require_model_dir(cfg, "prm.path", hub=False)
    scorer = cfg.prm.build(cfg.model.attn_implementation)
    try:
        todo = (p for p in iter_candidates(cand_file, lo, hi) if p.id not in done)
        dropped, cut = score_into(partial, scorer, todo, cfg.scoring, cand_file, len(done), n_problems)
    finally:
        # a vLLM engine stopped here, not by the interpreter's exit, where its threads can abort the process
        scorer.close()
    os.replace(partial, final)
    if cut:
        print(
            f"warning: {cut} candidates ({dropped} steps) did not fit prm.max_length={cfg.prm.max_length}: "
            "they are ranked last by every aggregator; raise prm.max_length to score them fully"
        )


def score_into(
    partial: Path,
    scorer: Any,
    todo: Iterable[Any],
    scoring: ScoringConfig,
    cand_file: Path,
    n_done: int,
    n_problems: int,
) -> tuple[int, int]:
    """Score `todo` chunk by chunk, each chunk's rows appended to `partial` before the next, with
    progress and an ETA; returns (steps dropped, candidates cut) by prm.max_length."""
    from mmprm.data import store

    t0, n_scored, n_steps, dropped, cut = time.time(), 0, 0, 0, 0
    with store.open_append(partial) as f:
        for chunk in batched(todo, scoring.chunk_problems):
            rows, stats = score_chunk(scorer, chunk, scoring.share_prefix, cand_file)
            for row in rows:
                store.append_row(f, row)
            n_scored += len(chunk)
            n_steps += stats["steps"]
            dropped += stats["dropped_steps"]
            cut += stats["cut"]
            elapsed, left = time.time() - t0, n_problems - n_done - n_scored
            print(
                f"scored {n_done + n_scored}/{n_problems} problems ({n_steps / max(elapsed, 1e-9):.1f} steps/s, "
                f"ETA {elapsed / n_scored * left:.0f}s)",
                flush=True,
            )
    return dropped, cut


def write_report(cfg: BonRerankConfig, out_dir: Path) -> None:
    """This shard's report settings; with one shard, the merged scores and the report (report.json,
    report.md, bon_curve.png) now, else after `mmprm merge-bon` once every shard is in."""
    from mmprm.rerank.shards import SETTINGS_FILE, merge_scored, report_from_scored

    settings = {**asdict(cfg.report), "extraction": extraction_label(cfg)}
    (out_dir / SETTINGS_FILE).write_text(json.dumps(settings, indent=2) + "\n")
    if cfg.shard.count == 1:
        merged = merge_scored(out_dir, count=1)
        rc = cfg.report
        report = report_from_scored(
            merged,
            out_dir,
            rc.n_subsets,
            rc.resamples,
            rc.seed,
            rc.weighted_by,
            rc.title,
            settings["extraction"],
            rc.edge_rules,
        )
        n = str(report["n_max"])
        summary = {method: round(v[n]["mean"], 4) for method, v in report["methods"].items()}
        print(json.dumps({"n_max": report["n_max"], "accuracy_at_n_max": summary}))
        print(f"wrote {out_dir / 'report.md'} and {out_dir / 'bon_curve.png'}")
    else:
        print(f"wrote shard {cfg.shard.index}; after all {cfg.shard.count} shards: mmprm merge-bon {out_dir}")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ConfigError, DataError, FileNotFoundError, ChatError) as e:  # ChatError: generate.judge's endpoint
        print(f"bon_rerank: {e}", file=sys.stderr)
        sys.exit(2)
