"""The whole mmprm pipeline on a tiny VLM and a synthetic multimodal task, on a laptop CPU.

    make demo
    python recipes/quickstart.py --config recipes/configs/tiny/quickstart.yaml [key=value ...]

Stages (each one the real recipe, run as a user would run it, with a tiny config):
  1. data      synthetic colour-tile problems: SFT train set, annotation set, held-out test set
  2. model     `mmprm tiny-model`: a random-init Qwen2-VL-architecture model
  3. policy    recipes/policy_sft.py: learn to solve in tagged steps
  4. annotate  recipes/mcts_annotate.py: OmegaPRM MCTS labels the policy's own steps (HF backend)
  5. prm       recipes/prm_train.py: soft-label PRM on the exported labels
  6. bon       recipes/bon_rerank.py: N samples per test problem, PRM reranking, every aggregator
  7. report    OUTPUT_DIR/report.md + report.json + bon_curve.png, with a stage timing table

A finished stage is skipped when rerun (its output is there); `force=true` reruns everything.
The PRM is also judged against ground truth: the synthetic task lets us check every step of every
test candidate exactly (`mmprm.data.synthetic.check_steps`), so step-level AUROC is real.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from mmprm.config import ConfigError, load_config, parse_cli, to_dict

REPO = Path(__file__).resolve().parents[1]


@dataclass
class TaskConfig:
    """The synthetic colour-tile task the demo trains on.

    Attributes:
        train: SFT problems
        annotate: problems MCTS labels
        test: held-out Best-of-N problems
        min_tiles: fewest tiles per image
        max_tiles: most tiles per image
        ops: comma-separated operations the questions use: +, -, *, cmp
        max_ops: most arithmetic/comparison steps per solution
        max_digit: tiles show digits 0..max_digit
    """

    train: int = 3000
    annotate: int = 150
    test: int = 300
    min_tiles: int = 2
    max_tiles: int = 3
    ops: str = "+"
    max_ops: int = 3
    max_digit: int = 9


@dataclass
class ModelConfig:
    """Model loading.

    Attributes:
        attn_implementation: attention kernel of every model the demo loads (passed to each stage): sdpa | flash_attention_2
            (mmprm[flash], CUDA) | eager | auto (flash-attn when installed and a GPU is visible, else sdpa)
    """

    attn_implementation: str = "sdpa"


@dataclass
class Config:
    """quickstart settings: the whole pipeline on a tiny model, stage by stage.

    Attributes:
        seed: seed of every stage
        output_dir: where each stage's output goes (a finished stage is skipped on rerun)
        force: redo every stage even when its output exists
        arch: tiny model architecture (mmprm tiny-model --arch)
        hidden_size: tiny model hidden size
        num_layers: tiny model layers
        task: the synthetic task (section)
        model: model loading, passed to every stage (section)
        n: candidates per test problem
        threads: intra-op threads per stage: tiny models gain nothing from more, and lose to contention
        sft: extra key=value overrides for the policy_sft stage
        annotate: extra key=value overrides for the mcts_annotate stage
        prm: extra key=value overrides for the prm_train stage
        bon: extra key=value overrides for the bon_rerank stage
    """

    seed: int = 0
    output_dir: str = "runs/demo"
    force: bool = False
    arch: str = "qwen2_vl"
    hidden_size: int = 128
    num_layers: int = 2
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    n: int = 8
    threads: int = 1
    sft: list[str] = field(default_factory=list)
    annotate: list[str] = field(default_factory=list)
    prm: list[str] = field(default_factory=list)
    bon: list[str] = field(default_factory=list)


def stage(name: str, done: Path, out: Path, force: bool, timings: list, fn) -> None:
    """Run one stage unless its output exists; time it; one line before and after.

    Each stage's wall time is kept in OUTPUT_DIR/stage_times.json, so a rerun that skips it
    still reports the time it took when it ran.
    """
    times_file = out / "stage_times.json"
    recorded = json.loads(times_file.read_text()) if times_file.exists() else {}
    if done.exists() and not force:
        print(f"==> [{name}] already done ({done}), skipping", flush=True)
        timings.append((name, recorded.get(name, float("nan")), "done in an earlier run"))
        return
    print(f"==> [{name}] ...", flush=True)
    t0 = time.time()
    fn()
    took = time.time() - t0
    timings.append((name, took, "ran"))
    recorded[name] = took
    times_file.write_text(json.dumps(recorded, indent=2) + "\n")
    print(f"==> [{name}] done in {took:.1f}s", flush=True)


def run(*args: str) -> None:
    """A recipe or CLI as a subprocess: its own progress bars show; failure stops the demo."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("OMP_NUM_THREADS", os.environ.get("MMPRM_THREADS", "1"))
    res = subprocess.run([sys.executable, *args], cwd=REPO, env=env)
    if res.returncode != 0:
        raise SystemExit(f"quickstart: stage command failed (exit {res.returncode}): python {' '.join(args)}")


def main(argv: list[str]) -> None:
    config_path, overrides = parse_cli(argv, Config)
    cfg = load_config(Config, config_path, overrides)
    from mmprm.models.loading import resolve_attn_implementation

    resolve_attn_implementation(cfg.model.attn_implementation)  # fail before the first stage, not in it
    os.environ.setdefault("MMPRM_THREADS", str(cfg.threads))
    import torch

    torch.set_num_threads(cfg.threads)
    out = Path(cfg.output_dir)
    if not out.is_absolute():
        out = REPO / out
    out.mkdir(parents=True, exist_ok=True)
    data, model_dir, policy, mcts, prm, bon = (
        out / "data",
        out / "tiny_model",
        out / "policy",
        out / "mcts",
        out / "prm",
        out / "bon",
    )
    timings: list[tuple[str, float, str]] = []
    attn = f"model.attn_implementation={cfg.model.attn_implementation}"  # every stage loads with this kernel

    # ---- 1. data ---------------------------------------------------------------------------
    def make_data() -> None:
        from mmprm.data.synthetic import SyntheticConfig, generate, problem_key, text_only_accuracy, write_split

        t = cfg.task
        common = dict(
            min_tiles=t.min_tiles,
            max_tiles=t.max_tiles,
            ops=tuple(t.ops.split(",")),
            max_ops=t.max_ops,
            digits=(0, t.max_digit),
        )
        train = generate(SyntheticConfig(num_problems=t.train, seed=cfg.seed, id_prefix="train", **common))
        seen = {problem_key(p.meta["template"], p.meta["cells"]) for p in train}
        annotate = generate(
            SyntheticConfig(num_problems=t.annotate, seed=cfg.seed + 1, id_prefix="ann", **common), exclude=seen
        )
        seen |= {problem_key(p.meta["template"], p.meta["cells"]) for p in annotate}
        test = generate(
            SyntheticConfig(num_problems=t.test, seed=cfg.seed + 2, id_prefix="test", **common), exclude=seen
        )
        for name, split in (("train", train), ("annotate", annotate), ("test", test)):
            write_split(split, data, name)
        (data / "task.json").write_text(
            json.dumps({"text_only_accuracy": text_only_accuracy(train, test), **to_dict(cfg.task)}, indent=2)
        )

    stage("data", data / "task.json", out, cfg.force, timings, make_data)

    # ---- 2. tiny model ---------------------------------------------------------------------
    stage(
        "model",
        model_dir / "config.json",
        out,
        cfg.force,
        timings,
        lambda: run(
            "-m",
            "mmprm.cli",
            "tiny-model",
            "--arch",
            cfg.arch,
            "--out",
            str(model_dir),
            "--seed",
            str(cfg.seed),
            "--hidden-size",
            str(cfg.hidden_size),
            "--layers",
            str(cfg.num_layers),
        ),
    )

    # ---- 3. policy SFT ---------------------------------------------------------------------
    stage(
        "policy",
        policy / "model.safetensors",
        out,
        cfg.force,
        timings,
        lambda: run(
            "recipes/policy_sft.py",
            "--config",
            "recipes/configs/tiny/policy_sft.yaml",
            f"model.name_or_path={model_dir}",
            f"data.train_file={data / 'train_sft.jsonl'}",
            f"data.eval_file={data / 'test_sft.jsonl'}",
            f"output_dir={policy}",
            f"train.seed={cfg.seed}",
            "train.report_to=none",
            attn,
            *cfg.sft,
        ),
    )

    # ---- 4. MCTS annotation ----------------------------------------------------------------
    stage(
        "annotate",
        mcts / "prm_data.jsonl",
        out,
        cfg.force,
        timings,
        lambda: run(
            "recipes/mcts_annotate.py",
            "--config",
            "recipes/configs/tiny/mcts_annotate.yaml",
            f"model.name_or_path={policy}",
            f"data.problems_file={data / 'annotate_problems.jsonl'}",
            f"output_dir={mcts}",
            f"sampling.seed={cfg.seed}",
            attn,
            *cfg.annotate,
        ),
    )

    # ---- 5. PRM training (initialised from the policy, as MM-PRM does from its base) ---------
    stage(
        "prm",
        prm / "mmprm_prm.json",
        out,
        cfg.force,
        timings,
        lambda: run(
            "recipes/prm_train.py",
            "--config",
            "recipes/configs/tiny/prm_train.yaml",
            f"model.name_or_path={policy}",
            f"data.train_file={mcts / 'prm_data.jsonl'}",
            "data.eval_file=null",
            f"output_dir={prm}",
            f"train.seed={cfg.seed}",
            "train.report_to=none",
            attn,
            *cfg.prm,
        ),
    )

    # ---- 6. Best-of-N on held-out problems -------------------------------------------------
    stage(
        "bon",
        bon / "report.json",
        out,
        cfg.force,
        timings,
        lambda: run(
            "recipes/bon_rerank.py",
            "--config",
            "recipes/configs/tiny/bon_rerank.yaml",
            f"prm={prm}",
            "candidates_file=null",
            "generate.enabled=true",
            f"generate.policy={policy}",
            f"generate.problems_file={data / 'test_problems.jsonl'}",
            f"generate.n={cfg.n}",
            f"generate.sampling.seed={cfg.seed}",
            f"output_dir={bon}",
            f"report.seed={cfg.seed}",
            attn,
            *cfg.bon,
        ),
    )

    # ---- 7. ground-truth step evaluation and the report -------------------------------------
    print("==> [report] ...", flush=True)
    t0 = time.time()
    step_eval = evaluate_steps(data, bon, prm, policy, cfg.model.attn_implementation)
    timings.append(("step eval", time.time() - t0, "ran"))
    write_demo_report(
        out, cfg, data, policy, mcts, bon, step_eval, timings, sum(t for _, t, _ in timings if t == t)
    )  # NaN-safe sum of stage times
    print(f"==> [report] {out / 'report.md'}", flush=True)


def evaluate_steps(data: Path, bon: Path, prm: Path, policy: Path, attn_implementation: str = "sdpa") -> dict:
    """Step-level AUROC on the test candidates against exact labels: trained PRM vs untrained."""
    import torch

    from mmprm.data.schema import read_jsonl
    from mmprm.data.synthetic import check_steps
    from mmprm.models.loading import load_backbone
    from mmprm.models.prm import PRMScorer, PRMSpec, build_prm
    from mmprm.scoring.metrics import auroc, stratified_auroc

    problems = {r["id"]: r for r in read_jsonl(data / "test_problems.jsonl")}
    scored = {r["id"]: r for r in read_jsonl(bon / "scored.jsonl")}
    cands = {r["id"]: r for r in read_jsonl(bon / "candidates.jsonl")}
    examples, truth, trained, strata = [], [], [], []
    for pid, row in cands.items():
        tiles = problems[pid]["meta"]["tiles"]
        for c, s in zip(row["candidates"], scored[pid]["candidates"]):
            if not c["steps"]:
                continue
            examples.append({"question": row["question"], "images": row["images"], "steps": c["steps"]})
            gold = problems[pid]["answer"]
            truth.append([1.0 if ok else 0.0 for ok in check_steps(tiles, c["steps"], c["answer"], gold)])
            trained.append(s["step_probs"])
            strata.extend((pid, k) for k in range(len(c["steps"])))
    backbone, processor = load_backbone(policy, attn_implementation=attn_implementation)
    torch.manual_seed(0)
    untrained = PRMScorer(build_prm(backbone, processor, PRMSpec()), processor, batch_size=16).score(examples)
    flat = [x for t in truth for x in t]

    def within(scores: list[list[float]]) -> float:
        return stratified_auroc([x for s in scores for x in s], flat, strata)

    return {
        "candidates": len(examples),
        "steps": len(flat),
        "share_correct_steps": sum(flat) / max(1, len(flat)),
        "auroc_trained": within(trained),
        "auroc_untrained": within(untrained),
        "pooled_auroc_trained": auroc(trained, truth),
        "pooled_auroc_untrained": auroc(untrained, truth),
    }


def write_demo_report(
    out: Path, cfg: Config, data: Path, policy: Path, mcts: Path, bon: Path, step_eval: dict, timings: list, wall: float
) -> None:
    from mmprm.data.schema import read_jsonl
    from mmprm.rerank.report import BASELINES

    bon_report = json.loads((bon / "report.json").read_text())
    task = json.loads((data / "task.json").read_text())
    sft_evals = [r for r in read_jsonl(policy / "metrics.jsonl") if r["split"] == "eval"]
    export = json.loads((mcts / "export_report.json").read_text()) if (mcts / "export_report.json").exists() else {}
    n_max = str(bon_report["n_max"])
    methods = bon_report["methods"]
    aggs = [m for m in methods if m not in BASELINES]
    best = max(aggs, key=lambda m: methods[m][n_max]["mean"])
    shutil.copyfile(bon / "bon_curve.png", out / "bon_curve.png")
    summary = {
        "seed": cfg.seed,
        "wall_seconds": round(wall, 1),
        "task": task,
        "policy_eval": sft_evals[-1] if sft_evals else None,
        "policy_single_sample_accuracy": methods["random"]["1"]["mean"],
        "best_aggregator": best,
        "best_vs_random": bon_report.get("best_vs_random"),
        "bon": bon_report,
        "step_eval": step_eval,
        "annotation_export": export,
        "stages": [{"stage": s, "seconds": round(t, 1), "status": st} for s, t, st in timings],
    }
    (out / "report.json").write_text(json.dumps(summary, indent=2) + "\n")

    ns = sorted(methods["random"], key=int)
    lines = [
        "# mmprm demo report",
        "",
        f"Seed {cfg.seed}; {bon_report['num_problems']} held-out problems; N up to {n_max}; "
        f"sum of stage wall times {wall / 60:.1f} min.",
        "",
        "## Best-of-N accuracy (mean, 95% bootstrap interval)",
        "",
        "| method | " + " | ".join(f"N={n}" for n in ns) + " |",
        "| --- | " + " | ".join("---" for _ in ns) + " |",
    ]
    for m in list(aggs) + list(BASELINES):
        cells = [
            f"{methods[m][n]['mean']:.3f} [{methods[m][n]['ci95'][0]:.3f}, {methods[m][n]['ci95'][1]:.3f}]" for n in ns
        ]
        lines.append(f"| {m}{' (best PRM)' if m == best else ''} | " + " | ".join(cells) + " |")
    bvr = bon_report.get("best_vs_random") or {}
    lines += [
        "",
        f"Best PRM aggregator `{best}` minus random pick at N={n_max}: "
        f"{bvr.get('diff', float('nan')):+.3f}, 95% CI {bvr.get('ci95')}.",
        "",
        "![Best-of-N curve](bon_curve.png)",
        "",
        "## Step-level check against exact labels",
        "",
        f"Every step of every test candidate is checked against the image's true digits "
        f"({step_eval['steps']} steps, {step_eval['share_correct_steps']:.1%} correct).",
        "",
        "Step AUROC compares a right step with a wrong one at the same step of another candidate for the "
        "same problem - the comparison a reranker makes. The pooled AUROC over all steps is shown beside "
        "it: it mixes positions (later steps are wrong more often, and an MC label rises toward the end "
        "of a right solution) and problems, so it can sit below 0.5 for a PRM that ranks well.",
        "",
        "| PRM | step AUROC (same problem, same step) | pooled AUROC |",
        "| --- | --- | --- |",
        f"| trained (MCTS labels) | {step_eval['auroc_trained']:.3f} | {step_eval['pooled_auroc_trained']:.3f} |",
        f"| untrained (same backbone, fresh head) | {step_eval['auroc_untrained']:.3f} | "
        f"{step_eval['pooled_auroc_untrained']:.3f} |",
        "",
        "## Policy",
        "",
    ]
    if sft_evals:
        first, last = sft_evals[0], sft_evals[-1]
        lines += [
            f"Greedy format compliance {first.get('format_compliance', 0):.1%} -> {last.get('format_compliance', 0):.1%}, "
            f"answer accuracy {first.get('answer_accuracy', 0):.1%} -> {last.get('answer_accuracy', 0):.1%} "
            f"(eval split, before -> after SFT). Sampled single-candidate accuracy on the test set: "
            f"{methods['random']['1']['mean']:.1%}. A text-only model can reach {task['text_only_accuracy']:.1%}.",
            "",
        ]
    lines += ["## Stage timings", "", "| stage | seconds | |", "| --- | --- | --- |"]
    lines += [f"| {s} | {t:.1f} | {st} |" for s, t, st in timings]
    (out / "report.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ConfigError as e:
        print(f"quickstart: {e}", file=sys.stderr)
        sys.exit(2)
