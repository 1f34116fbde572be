"""PRM-guided search: step-level beam search / diverse verifier tree search / best-first search,
each step scored by the PRM, compared with Best-of-N and majority vote at equal generation budget.

    python recipes/prm_search.py --config recipes/configs/tiny/prm_search.yaml
    # 7B on one GPU with vLLM (one process per GPU; shard the problems across GPUs/nodes):
    python recipes/prm_search.py --config recipes/configs/qwen2_5_vl_7b/prm_search.yaml shard.index=0 shard.count=8
    # (the last shard to finish writes the report; or rerun any shard afterwards: done work is skipped)

Writes to OUTPUT_DIR, per search setting (folder named after it, e.g. `beam_W4xM4/`):
results.shardI-of-C.jsonl, one row per problem - the chosen solution (steps, answer, step
probabilities, score), whether it is correct, the whole search tree, its Think360 width/depth and
its cost (generated tokens, PRM-scored sequences, seconds). With `bon.enabled`, `bon/` holds N
sampled solutions per problem with PRM step scores and token counts. When every shard is done:
report.json, report.md and search_vs_bon.png (accuracy vs generated tokens, 95% bootstrap intervals)
and trees/*.png (the first problems' search trees). Rows are appended and fsync'ed one problem at a
time, so a run killed at any point (kill -9 included) resumes where it stopped when rerun; a run
with another PRM, policy, sampling or problem set on the same OUTPUT_DIR is refused (`check_runs`).
"""

from __future__ import annotations

import itertools
import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from mmprm.config import ConfigError, load_config, parse_cli, require_model_dir
from mmprm.config_sections import ModelLoadConfig, PolicyConfig, PRMScorerConfig, ShardConfig, VLLMConfig
from mmprm.data.schema import DataError
from mmprm.search.core import SearchConfig


@dataclass
class SearchVLLMConfig(VLLMConfig):
    """The policy's vLLM engine, sharing the GPU with the PRM.

    Attributes:
        gpu_memory_utilization: share of GPU memory the engine may take (leave room for the PRM)
    """

    gpu_memory_utilization: float | None = 0.5


@dataclass
class SearchPolicyConfig(PolicyConfig):
    """The policy that proposes steps (and samples Best-of-N's solutions).

    Attributes:
        path: policy model directory (e.g. recipes/policy_sft.py's output) or hub id; required
        batch_size: hf: sequences per generate call (Best-of-N: problems per call = batch_size // max(bon.n);
            vllm sends 8192 sequences per call and schedules them itself)
        sampling: sampling (section); its max_new_tokens caps ONE step of the search (Best-of-N's whole
            solutions: bon.max_new_tokens)
        vllm: backend=vllm: the engine (section)
    """

    vllm: SearchVLLMConfig = field(default_factory=SearchVLLMConfig)


@dataclass
class SearchPRMConfig(PRMScorerConfig):
    """The PRM that scores search paths and Best-of-N solutions.

    Attributes:
        path: PRM directory written by recipes/prm_train.py; required
    """

    batch_size: int = 16


@dataclass
class BonConfig:
    """Best-of-N and majority vote with the same policy and PRM, the search's baselines.

    Attributes:
        enabled: sample max(n) solutions per problem and compare at equal generated tokens
        n: the N values reported (subsets of the max(n) samples)
        max_new_tokens: token cap of one whole solution (a cut-off solution has no answer: wrong)
    """

    enabled: bool = False
    n: list[int] = field(default_factory=lambda: [4, 8, 16])
    max_new_tokens: int = 4096  # MM-PRM's cap, as in annotation and bon_rerank


@dataclass
class ReportConfig:
    """The search vs Best-of-N report.

    Attributes:
        resamples: bootstrap resamples over problems for the 95% intervals
        seed: seed of the resamples
        trees: search trees drawn to trees/*.png (first problems of the first setting)
        title: title of report.md and the plot
    """

    resamples: int = 1000
    seed: int = 0
    trees: int = 2
    title: str = "PRM-guided search vs Best-of-N"


@dataclass
class PRMSearchConfig:
    """prm_search settings.

    Attributes:
        prm: the PRM (section); prm.path required
        problems_file: JSONL of {id, images, question, answer, choices?}; required
        limit: first N problems only (before sharding); null takes all
        searches: search settings, each run on every problem: a list of {method: beam | dvts | best_first,
            width, expansions, max_steps, aggregator, max_expansions, distinct} (mmprm.search.SearchConfig)
        batch_problems: problems searched in lockstep (one generate call per round for all of them)
        output_dir: where per-setting results, bon/, report.json/.md, search_vs_bon.png and trees/ go
        model: model loading (section)
        policy: the policy (section)
        bon: Best-of-N baseline (section)
        report: report (section)
        shard: sharding (section)
    """

    prm: SearchPRMConfig = field(default_factory=SearchPRMConfig)
    problems_file: str = ""
    limit: int | None = None
    searches: list[SearchConfig] = field(default_factory=lambda: [SearchConfig()])
    batch_problems: int = 8
    output_dir: str = "runs/prm_search"
    model: ModelLoadConfig = field(default_factory=ModelLoadConfig)
    policy: SearchPolicyConfig = field(default_factory=SearchPolicyConfig)
    bon: BonConfig = field(default_factory=BonConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    shard: ShardConfig = field(default_factory=ShardConfig)

    # Keys read under their old names for one release (mmprm.config), with a warning.
    RENAMED_KEYS: ClassVar[dict[str, str]] = {
        "prm": "prm.path",
        **{f"scoring.{k}": f"prm.{k}" for k in ("batch_size", "max_length", "device", "backend", "convention")},
        "scoring.vllm_kwargs": "prm.vllm.kwargs",
        "policy.gpu_memory_utilization": "policy.vllm.gpu_memory_utilization",
        "policy.max_model_len": "policy.vllm.max_model_len",
        "policy.vllm_kwargs": "policy.vllm.kwargs",
    }

    def validate(self) -> None:
        if not (self.policy.path and self.prm.path and self.problems_file):
            raise ValueError("policy.path, prm.path and problems_file: all required")
        from mmprm.models.loading import resolve_attn_implementation

        resolve_attn_implementation(self.model.attn_implementation)  # before any weight loads
        if not self.searches:
            raise ValueError("searches: give at least one search setting")
        labels = [s.label() for s in self.searches]
        if len(set(labels)) != len(labels):
            raise ValueError(f"searches: two settings are the same ({labels}): drop one")
        if self.bon.enabled and (not self.bon.n or min(self.bon.n) < 1):
            raise ValueError("bon.n: a list of sizes >= 1, e.g. [4, 8, 16]")
        if self.batch_problems < 1:
            raise ValueError("batch_problems: must be >= 1")


def slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", label).strip("_")


def check_runs(cfg: PRMSearchConfig, out: Path, n_problems: int) -> None:
    """Refuse rows and `.done` markers that another run wrote into output_dir, before any model loads.

    Each shard records what its rows depend on beside them (`<rows>.run.json`) and compares it with
    what it and the other shards of the run recorded there: another PRM, policy, sampling or problem
    set stops with a ConfigError naming the setting, instead of resuming, or merging, two runs as one.
    """
    from dataclasses import asdict

    from mmprm.data import store

    where = lambda p: str(Path(p).resolve()) if Path(p).exists() else p  # noqa: E731 - a hub id stays as it is
    run = {
        "policy": where(cfg.policy.path),
        "step_mode": cfg.policy.step_mode,
        "system_prompt": cfg.policy.system_prompt,
        "dtype": cfg.policy.dtype,
        "sampling": asdict(cfg.policy.sampling),
        "prm": where(cfg.prm.path),
        "convention": cfg.prm.convention,
        "max_length": cfg.prm.max_length,
        "problems_file": where(cfg.problems_file),
        "problems": n_problems,
    }
    runs = [(slug(s.label()), "results", {**run, "search": asdict(s)}) for s in cfg.searches]
    if cfg.bon.enabled:
        runs.append(("bon", "candidates", {**run, "n": max(cfg.bon.n), "max_new_tokens": cfg.bon.max_new_tokens}))
    sh = cfg.shard
    for folder, stem, settings in runs:
        for i in [sh.index, *(j for j in range(sh.count) if j != sh.index)]:
            rows = store.shard_file(out / folder, stem, i, sh.count)
            done = rows.with_suffix(".done")
            store.check_same_run(rows.with_name(rows.name + ".run.json"), settings, rows, done, record=i == sh.index)


def progress(what: str, done: int, total: int, t0: float, already: int) -> None:
    rate = (done - already) / max(time.time() - t0, 1e-9)
    eta = (total - done) / rate if rate > 0 else float("nan")
    print(f"{what}: {done}/{total} problems, {time.time() - t0:.0f}s (ETA {eta:.0f}s)", flush=True)


def run_searches(cfg: PRMSearchConfig, problems: list[Any], proposer: Any, scorer: Any, out: Path) -> None:
    """Each search setting over this shard's problems, in lockstep batches: one row per finished
    problem, appended as it finishes, so a rerun resumes where this one stopped."""
    from mmprm.answers import answers_match
    from mmprm.data import store
    from mmprm.search.core import run_search
    from mmprm.treeval import think360_depth, think360_width

    sh = cfg.shard
    for search in cfg.searches:
        path = store.shard_file(out / slug(search.label()), "results", sh.index, sh.count)
        done = store.resume(path)
        todo = [p for p in problems if p.id not in done]
        print(f"[{search.label()}] {len(done)} problems already done, {len(todo)} to search", flush=True)
        t0 = time.time()
        with store.open_append(path) as f:
            for lo in range(0, len(todo), cfg.batch_problems):
                chunk = todo[lo : lo + cfg.batch_problems]
                for p, tree in zip(chunk, run_search(chunk, proposer, scorer, search)):
                    node = tree.nodes[tree.chosen]
                    tv = tree.to_treeval() if len(tree.nodes) > 1 else None
                    store.append_row(
                        f,
                        {
                            "id": p.id,
                            "answer": node.answer,
                            "gold": p.answer,
                            "complete": node.status == "finished",
                            "correct": bool(
                                node.status == "finished" and answers_match(node.answer, p.answer, p.choices)
                            ),
                            "steps": tree.steps(node),
                            "step_probs": node.probs,
                            "score": node.score,
                            "think360": {
                                "width": think360_width(tv) if tv else None,
                                "depth": think360_depth(tv) if tv else None,
                            },
                            "stats": tree.stats,
                            "tree": tree.to_json(),
                        },
                    )
                progress(f"[{search.label()}]", len(done) + lo + len(chunk), len(problems), t0, len(done))
        store.mark_done(path)


def run_best_of_n(
    cfg: PRMSearchConfig, problems: list[Any], backend: Any, step_mode: str, scorer: Any, out: Path
) -> None:
    """Best-of-N at the largest budget with the same policy and PRM: whole solutions sampled,
    every step scored, one row of candidates per problem."""
    from mmprm.answers import answers_match
    from mmprm.data import store
    from mmprm.generation.base import problems_per_call
    from mmprm.search.policy import sample_solutions

    sh = cfg.shard
    path = store.shard_file(out / "bon", "candidates", sh.index, sh.count)
    done = store.resume(path)
    todo = [p for p in problems if p.id not in done]
    n_max = max(cfg.bon.n)
    print(f"[Best-of-N] {len(done)} problems already done, {len(todo)} to sample x {n_max}", flush=True)
    backend.sampling.max_new_tokens = cfg.bon.max_new_tokens  # whole solutions now, not one step
    t0 = time.time()
    per_call = problems_per_call(backend, n_max, cfg.policy.batch_size)
    with store.open_append(path) as f:
        for lo in range(0, len(todo), per_call):
            chunk = todo[lo : lo + per_call]
            cands = sample_solutions(backend, chunk, n_max, step_mode, cfg.policy.batch_size)
            examples = [
                {"question": p.question, "images": p.images, "steps": c["steps"]}
                for p, cs in zip(chunk, cands)
                for c in cs
                if c["steps"]
            ]
            probs = iter(scorer.score(examples))
            for p, cs in zip(chunk, cands):
                rows = []
                for c in cs:
                    step_probs = next(probs) if c["steps"] else []
                    kept = [q for q in step_probs if not math.isnan(q)]  # NaN: past prm.max_length
                    rows.append(
                        {
                            "steps": c["steps"],
                            "step_probs": kept,
                            "truncated": len(kept) < len(step_probs),
                            "answer": c["answer"],
                            "correct": answers_match(c["answer"], p.answer, p.choices),
                            "tokens": c["tokens"],
                            "complete": c["complete"],
                        }
                    )
                store.append_row(f, {"id": p.id, "candidates": rows})
            progress("[Best-of-N]", len(done) + lo + len(chunk), len(problems), t0, len(done))
    store.mark_done(path)


def write_report(cfg: PRMSearchConfig, out: Path) -> None:
    """The search-vs-Best-of-N report, once every shard of every setting is in."""
    from mmprm.data import store
    from mmprm.search.core import SearchTree
    from mmprm.search.report import search_report, write_search_report
    from mmprm.treeval import render_tree

    sh = cfg.shard
    ready = all(store.all_done(out / slug(s.label()), "results", sh.count) for s in cfg.searches)
    if not ready or (cfg.bon.enabled and not store.all_done(out / "bon", "candidates", sh.count)):
        print(f"shard {sh.index} done; the report is written when all {sh.count} shards are (rerun any shard then)")
        return
    # Only what the report reads: each row's search tree (hundreds of KB) stays on disk.
    fields = ("id", "answer", "correct", "complete", "stats")
    runs = {s.label(): store.merge_shards(out / slug(s.label()), "results", sh.count, fields) for s in cfg.searches}
    bon_rows = None
    if cfg.bon.enabled:  # each candidate's step texts are the bulk of these rows: the report reads none
        bon_rows = [
            {**r, "candidates": [{k: v for k, v in c.items() if k != "steps"} for c in r["candidates"]]}
            for r in store.iter_merged(out / "bon", "candidates", sh.count)
        ]
    report = search_report(
        runs, bon_rows, sorted(cfg.bon.n), cfg.searches[0].aggregator, cfg.report.resamples, cfg.report.seed
    )
    first = cfg.searches[0].label()
    for row in itertools.islice(store.iter_merged(out / slug(first), "results", sh.count), cfg.report.trees):
        tree = SearchTree.from_json(row["tree"])
        if len(tree.nodes) > 1:
            render_tree(
                tree.to_treeval(),
                out / "trees" / f"{slug(str(row['id']))}.png",
                title=f"{first} on {row['id']}: {'right' if row['correct'] else 'wrong'} answer {row['answer']}",
            )
    md = write_search_report(report, out, cfg.report.title)
    for m in report["matched"]:
        print(
            f"{m['search']} ({m['search_tokens']:.0f} tok) vs {m['bon']} ({m['bon_tokens']:.0f} tok): "
            f"{m['search_acc']:.3f} vs {m['bon_acc']:.3f}, diff {m['diff']:+.3f} [{m['ci95'][0]:+.3f}, {m['ci95'][1]:+.3f}]"
        )
    print(f"wrote {md} and {out / 'search_vs_bon.png'}")


def main(argv: list[str]) -> None:
    config_path, overrides = parse_cli(argv, PRMSearchConfig)
    cfg = load_config(PRMSearchConfig, config_path, overrides)
    # The search runs for hours: a typo in either path must fail now, before anything is written.
    require_model_dir(cfg, "policy.path")
    require_model_dir(cfg, "prm.path", hub=False)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    sh = cfg.shard

    # ---- problems of this shard ------------------------------------------------------------
    from mmprm.rerank.candidates import count_rows, load_problems_for_generation
    from mmprm.rerank.shards import shard_bounds

    n = count_rows(cfg.problems_file)
    n = n if cfg.limit is None else min(cfg.limit, n)
    lo, hi = shard_bounds(n, sh.index, sh.count)  # only this shard's images are opened to check them
    in_block = lambda i: lo <= i < hi  # noqa: E731
    problems = load_problems_for_generation(
        cfg.problems_file, check_rows=in_block, keep_rows=in_block
    )  # every row checked
    print(f"shard {sh.index}/{sh.count}: {len(problems)} problems")
    check_runs(cfg, out, n)

    # ---- models: the policy behind a rollout backend, the PRM scorer -------------------------
    from mmprm.search.policy import BackendProposer

    scorer = cfg.prm.build(cfg.model.attn_implementation)
    # Each shard samples its own stream; a rerun of the same shard samples the same steps. The
    # sampling is a copy: Best-of-N raises its max_new_tokens to a whole solution later.
    backend = cfg.policy.build(cfg.model.attn_implementation, sampling=cfg.policy.sampling_for(cfg.shard.index))
    try:
        step_mode = backend.step_mode  # as resolved from the config and the policy's saved spec
        run_searches(cfg, problems, BackendProposer(backend, step_mode), scorer, out)
        if cfg.bon.enabled:
            run_best_of_n(cfg, problems, backend, step_mode, scorer, out)
    finally:
        # vLLM engines stop here, not in the interpreter's exit, where their threads can abort the process
        backend.close()
        scorer.close()
    write_report(cfg, out)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ConfigError, DataError, FileNotFoundError) as e:
        print(f"prm_search: {e}", file=sys.stderr)
        sys.exit(2)
