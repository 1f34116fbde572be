r"""Step-level evaluation of a trained PRM: first-error F1, step F1, AUROC, calibration.

Scores every step of a labelled set with `mmprm.load_prm`, then writes:

    <output.dir>/report.json   metrics overall and per category, the threshold and where it came from
    <output.dir>/report.md     the same as tables a person reads
    <output.dir>/scores.jsonl  per example: id, split, category, scores, labels, true/predicted first error

Launch (CPU is enough for tiny models; the scorer uses the GPU when there is one):

    python recipes/prm_eval.py --config recipes/configs/tiny/prm_eval.yaml
    python recipes/prm_eval.py --config recipes/configs/tiny/prm_eval.yaml data.format=reasoneval \
        data.path=PATH/mr-math_invalid_errors.json prm.path=runs/tiny/prm   # github:GAIR-NLP/ReasonEval

Input formats (`data.format`):
    steps               our step-labelled JSONL (mmprm.data.schema), images included
    prmbench            PRMBench rows (prmbench/target_data.jsonl); per-category breakdown by `classification`
    reasoneval          ReasonEval MR-MATH (invalid or redundant errors file)
    processbench        ProcessBench (a subset's <subset>.json, or the folder of all four); per subset
    visualprocessbench  VisualProcessBench test.jsonl (images beside it); per data_source, neutral
                        steps left out of the step metrics as the benchmark does

Threshold: with `data.dev_file` or `data.dev_fraction > 0`, the threshold is the one that maximises
`metrics.objective` on the dev split (first-error F1, `best_threshold`; or step macro F1,
`best_step_threshold`, VisualProcessBench's metric), and metrics are reported on the rest only;
otherwise `metrics.threshold` is used. The report names the split (`threshold_split`). Dev/test are
split by source problem, so PRMBench's repeated `idx` never lands on both sides.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from mmprm.config import ConfigError, load_config, parse_cli, require_model_dir, to_dict
from mmprm.config_sections import ModelLoadConfig, PRMScorerConfig
from mmprm.data.readers import UnknownReaderError, get_reader
from mmprm.data.schema import DataError, StepExample, write_jsonl
from mmprm.scoring.metrics import (
    auroc,
    bce,
    best_step_threshold,
    best_threshold,
    brier,
    first_error,
    first_error_f1,
    predicted_first_error,
    step_accuracy,
    step_f1,
)


@dataclass
class StepDataConfig:
    """The labelled steps to evaluate on.

    Attributes:
        path: input file in data.format; required
        format: the step_benchmark reader (mmprm.data.readers): steps (our JSONL) | prmbench
            (target_data.jsonl) | reasoneval (MR-MATH file) | processbench (<subset>.json or their
            folder) | visualprocessbench (test.jsonl) | a name you registered
        limit: first N examples only (after reading, before the dev split); null takes all
        per_category: first N examples of each meta.category (PRMBench is sorted by it); null takes all
        dev_file: a separate dev set (same format) to choose the threshold on
        dev_fraction: else: this share of source problems becomes the dev split (0: use metrics.threshold)
        seed: seed of the dev split
    """

    path: str = ""
    format: str = "steps"
    limit: int | None = None
    per_category: int | None = None
    dev_file: str | None = None
    dev_fraction: float = 0.0
    seed: int = 0


@dataclass
class EvalPRMConfig(PRMScorerConfig):
    """The PRM under evaluation (mmprm.config_sections.PRMScorerConfig).

    Attributes:
        path: PRM directory written by recipes/prm_train.py; required
        batch_size: examples per forward
        max_length: tokens per example; steps cut by truncation are not scored: their examples stay in the
            first-error metrics (a miss unless the scored steps decide them), not in the step metrics
    """


@dataclass
class ScorerConfig:
    """How the PRM scores the examples.

    Attributes:
        use_images: show the PRM each example's images
        chunk_examples: examples scored, then saved to output.dir/score_cache.jsonl, at a time: a
            killed run resumes after the last chunk saved, and a rerun with other data or metrics
            settings scores only examples the cache does not hold
    """

    use_images: bool = True
    chunk_examples: int = 256

    def validate(self) -> None:
        if self.chunk_examples < 1:
            raise ValueError(f"scorer.chunk_examples: {self.chunk_examples} must be >= 1")


@dataclass
class MetricConfig:
    """How scores become predictions.

    Attributes:
        threshold: a step is predicted correct when its score >= this (used when there is no dev split)
        objective: what the dev split's threshold maximises: first_error_f1 (ProcessBench's F1) |
            macro_f1 (step macro F1, VisualProcessBench's) | auto (macro_f1 for visualprocessbench,
            else first_error_f1)
    """

    threshold: float = 0.5
    objective: Literal["auto", "first_error_f1", "macro_f1"] = "auto"


@dataclass
class OutputConfig:
    """Where results go.

    Attributes:
        dir: output folder: scores.jsonl, report.json, report.md
    """

    dir: str = "runs/prm_eval"


@dataclass
class PRMEvalConfig:
    """prm_eval settings.

    Attributes:
        data: the data
        prm: the PRM under evaluation (section); prm.path required
        scorer: how it scores (section)
        model: model loading (section)
        metrics: thresholding
        output: outputs
    """

    data: StepDataConfig = field(default_factory=StepDataConfig)
    prm: EvalPRMConfig = field(default_factory=EvalPRMConfig)
    scorer: ScorerConfig = field(default_factory=ScorerConfig)
    model: ModelLoadConfig = field(default_factory=ModelLoadConfig)
    metrics: MetricConfig = field(default_factory=MetricConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    # Keys read under their old names for one release (mmprm.config), with a warning.
    RENAMED_KEYS: ClassVar[dict[str, str]] = {
        "scorer.prm_path": "prm.path",
        **{f"scorer.{k}": f"prm.{k}" for k in ("batch_size", "max_length", "device", "backend", "convention")},
        "scorer.vllm_kwargs": "prm.vllm.kwargs",
    }

    def validate(self) -> None:
        if not self.data.path:
            raise ValueError("data.path: required (step-labelled JSONL, or a PRMBench / ReasonEval file)")
        if not self.prm.path:
            raise ValueError("prm.path: required (a PRM directory from recipes/prm_train.py)")
        try:
            get_reader("step_benchmark", self.data.format)
        except UnknownReaderError as e:
            raise ValueError(f"data.format: {e}") from None
        from mmprm.models.loading import resolve_attn_implementation

        resolve_attn_implementation(self.model.attn_implementation)  # before any weight loads
        if not 0.0 <= self.data.dev_fraction < 1.0:
            raise ValueError(f"data.dev_fraction: {self.data.dev_fraction} must be in [0, 1)")
        if self.data.dev_file and self.data.dev_fraction > 0:
            raise ValueError("data.dev_file and data.dev_fraction: set one of them, not both")
        if not 0.0 <= self.metrics.threshold <= 1.0:
            raise ValueError(f"metrics.threshold: {self.metrics.threshold} is outside [0, 1]")


def read_examples(path: str, fmt: str, check_images: bool = True) -> list[StepExample]:
    """Labelled examples of one file, read by the step_benchmark reader `fmt` (`mmprm.data.readers`);
    benchmark rows keep their category and first error in `meta`."""
    if not Path(path).exists():
        raise FileNotFoundError(f"{path}: input not found (set data.path / data.dev_file)")
    return get_reader("step_benchmark", fmt)(path, check_images=check_images)


def true_first_error(ex: StepExample) -> int | None:
    # Benchmark readers know the first error even where the labels alone are ambiguous (PRMBench
    # keeps later steps at 1); our own files derive it from the labels.
    return ex.meta["first_error"] if "first_error" in ex.meta else first_error(ex.labels)


def split_dev(examples: list[StepExample], fraction: float, seed: int) -> tuple[list[StepExample], list[StepExample]]:
    """(dev, test): `fraction` of the source problems (meta.source_id, else id) go to dev.

    Problems with an error-free solution and those without are split separately, so the dev split
    holds both kinds whenever the data does (`best_threshold` needs both).
    """
    groups: dict[str, list[StepExample]] = {}
    for ex in examples:
        groups.setdefault(str(ex.meta.get("source_id", ex.id)), []).append(ex)
    rng = random.Random(seed)
    dev_keys: set[str] = set()
    for has_clean in (False, True):
        keys = sorted(k for k, g in groups.items() if any(true_first_error(ex) is None for ex in g) == has_clean)
        rng.shuffle(keys)
        dev_keys.update(keys[: max(1, round(fraction * len(keys)))] if keys else [])
    dev = [ex for ex in examples if str(ex.meta.get("source_id", ex.id)) in dev_keys]
    test = [ex for ex in examples if str(ex.meta.get("source_id", ex.id)) not in dev_keys]
    return dev, test


def counted_steps(rows: list[dict[str, Any]]) -> tuple[list[list[float]], list[list[float]]]:
    """(scores, labels) of the steps the step metrics count: all but a row's `neutral_steps`."""
    scores, labels = [], []
    for r in rows:
        keep = [i for i in range(len(r["scores"])) if i not in set(r.get("neutral_steps", []))]
        scores.append([r["scores"][i] for i in keep])
        labels.append([r["labels"][i] for i in keep])
    return scores, labels


def metrics_of(rows: list[dict[str, Any]], threshold: float, soft: bool) -> dict[str, float | int]:
    """Step metrics of scored rows; BCE/Brier only when the labels are soft (they need a target).

    First-error metrics see every step of every row: a row cut by truncation stays in their
    denominators, a miss unless its scored steps decide the prediction (ProcessBench counts an
    example it got no prediction for as a miss). Step metrics see the fully scored rows only and
    leave out neutral steps (`counted_steps`).
    """
    full = complete(rows)
    out: dict[str, float | int] = {"examples": len(rows), "steps": sum(len(r["scores"]) for r in full)}
    if len(full) < len(rows):
        out["truncated"] = len(rows) - len(full)
    neutral = sum(len(r.get("neutral_steps", [])) for r in full)
    if neutral:
        out["neutral_steps"] = neutral  # scored, but in no step metric
    # The reader's first error is the truth: PRMBench labels alone do not mark steps after an error.
    fe = first_error_f1([r["scores"] for r in rows], [r["first_error"] for r in rows], threshold)
    out.update({f"first_error_{k}": v for k, v in fe.items()})
    scores, labels = counted_steps(full)
    out.update(step_f1(scores, labels, threshold))
    out["auroc"] = auroc(scores, labels)
    out["step_accuracy"] = step_accuracy(scores, labels, threshold)
    if soft:
        out["bce"], out["brier"] = bce(scores, labels), brier(scores, labels)
    return out


def report_metrics(rows: list[dict[str, Any]], threshold: float, soft: bool, mean_f1: bool = False) -> dict[str, Any]:
    """{"metrics": over all rows, "by_category": per category (subset, source) when there are several}.

    With `mean_f1` (ProcessBench), `metrics.first_error_f1` is the mean of the categories' F1, the
    average the paper reports; the F1 of all rows pooled stays as `first_error_f1_pooled`.
    """
    cats = sorted({r["category"] for r in rows if r["category"] is not None})
    by_category = {}
    if len(cats) > 1:
        by_category = {c: metrics_of([r for r in rows if r["category"] == c], threshold, soft) for c in cats}
    metrics = metrics_of(rows, threshold, soft)
    if mean_f1 and by_category:
        metrics["first_error_f1_pooled"] = metrics["first_error_f1"]
        metrics["first_error_f1"] = float(sum(m["first_error_f1"] for m in by_category.values()) / len(by_category))
    return {"metrics": metrics, "by_category": by_category}


def choose_threshold(dev_rows: list[dict[str, Any]], objective: str) -> float:
    """The threshold that maximises `objective` (first_error_f1 | macro_f1) on scored dev rows."""
    if objective == "macro_f1":
        return best_step_threshold(*counted_steps(dev_rows))
    return best_threshold([r["scores"] for r in dev_rows], [r["first_error"] for r in dev_rows])


def fmt(v: Any) -> str:
    """A metric as table text: 4 decimals, n/a for NaN."""
    if isinstance(v, float):
        return "n/a" if math.isnan(v) else f"{v:.4f}"
    return str(v)


def markdown(report: dict[str, Any]) -> str:
    """report.md: the overall metrics, then one row per category."""
    keys = [
        "examples",
        "truncated",
        "steps",
        "neutral_steps",
        "first_error_f1",
        "first_error_f1_pooled",
        "first_error_error_acc",
        "first_error_correct_acc",
        "macro_f1",
        "f1_correct",
        "f1_error",
        "auroc",
        "step_accuracy",
        "bce",
        "brier",
    ]
    m = report["metrics"]
    lines = [
        f"# PRM step-level evaluation: {report['data']}",
        "",
        f"PRM `{report['prm']}`, threshold {report['threshold']:.4f} ({report['threshold_source']}; "
        f"chosen on: {report['threshold_split']}); {report['truncated']} examples cut by truncation (kept in "
        "the first-error metrics, a miss unless their scored steps decide them; left out of the step metrics).",
        "",
        "| metric | value |",
        "| --- | --- |",
    ]
    lines += [f"| {k} | {fmt(m[k])} |" for k in keys if k in m]
    if report["by_category"]:
        cols = [k for k in keys if any(k in cm for cm in report["by_category"].values())]
        lines += [
            "",
            "## Per category",
            "",
            "| category | " + " | ".join(cols) + " |",
            "| --- |" + " --- |" * len(cols),
        ]
        for cat, cm in report["by_category"].items():
            lines.append(f"| {cat} | " + " | ".join(fmt(cm.get(k, 0)) for k in cols) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    """Read and check the data, score it with the PRM, choose the threshold, write the report."""
    # ---- config
    config_path, overrides = parse_cli(argv, PRMEvalConfig)
    cfg = load_config(PRMEvalConfig, config_path, overrides)

    # ---- data (every file is read and validated before the model loads)
    objective = resolve_objective(cfg)
    dev, examples, label_kind = load_data(cfg, objective)

    # ---- score; truncated steps come back NaN (their examples leave the step metrics only)
    require_model_dir(cfg, "prm.path", hub=False)  # named here, not in a traceback from the loader
    scores = score_examples(cfg, dev + examples)
    dev_rows, test_rows = score_rows("dev", dev, scores[: len(dev)]), score_rows("test", examples, scores[len(dev) :])
    truncated = len(dev_rows) + len(test_rows) - len(complete(dev_rows)) - len(complete(test_rows))

    # ---- threshold, metrics, report
    threshold, source, split = threshold_of(cfg, dev_rows, objective)
    print(f"threshold {threshold:.4f} ({source}; chosen on: {split})")
    report = make_report(cfg, dev_rows, test_rows, (threshold, source, split), label_kind, truncated)
    write_report(Path(cfg.output.dir), report, dev_rows + test_rows)
    return 0


def resolve_objective(cfg: PRMEvalConfig) -> str:
    """metrics.objective with auto resolved: step macro F1 for VisualProcessBench (its metric), else
    first-error F1."""
    if cfg.metrics.objective == "auto":
        return "macro_f1" if cfg.data.format == "visualprocessbench" else "first_error_f1"
    return cfg.metrics.objective


def load_data(cfg: PRMEvalConfig, objective: str) -> tuple[list[StepExample], list[StepExample], str]:
    """(dev examples, test examples, their label kind), read and checked: a dev split that cannot
    choose a threshold, an empty test split or mixed label kinds stop the run here."""
    use_images = cfg.scorer.use_images
    examples = read_examples(cfg.data.path, cfg.data.format, check_images=use_images)
    if cfg.data.per_category is not None:
        taken: dict[Any, list[StepExample]] = {}
        for ex in examples:
            taken.setdefault(ex.meta.get("category"), []).append(ex)
        examples = [ex for group in taken.values() for ex in group[: cfg.data.per_category]]
    if cfg.data.limit is not None:
        examples = examples[: cfg.data.limit]
    dev: list[StepExample] = []
    if cfg.data.dev_file:
        dev = read_examples(cfg.data.dev_file, cfg.data.format, check_images=use_images)
    elif cfg.data.dev_fraction > 0:
        dev, examples = split_dev(examples, cfg.data.dev_fraction, cfg.data.seed)
    check_dev(dev, objective)
    if not examples:
        raise SystemExit(f"{cfg.data.path}: no examples left to evaluate (check data.limit / data.dev_fraction)")
    if not use_images:
        for ex in dev + examples:
            ex.images = []
    kinds = {ex.meta.get("label_kind", "validity") for ex in examples}
    if len(kinds) > 1:
        raise SystemExit(
            f"{cfg.data.path}: mixes label kinds {sorted(kinds)}; a 0 means different things in "
            "each, evaluate them separately"
        )
    print(
        f"{len(examples)} examples from {cfg.data.path} ({cfg.data.format})"
        + (f", {len(dev)} dev examples for the threshold" if dev else "")
    )
    return dev, examples, kinds.pop()


def check_dev(dev: list[StepExample], objective: str) -> None:
    """Stop unless the dev split (when there is one) holds both kinds its objective tells apart."""
    if objective == "macro_f1":
        neutral = lambda ex: ex.meta.get("neutral_steps", [])  # noqa: E731
        dev_kinds = {y >= 0.5 for ex in dev for i, y in enumerate(ex.labels) if i not in neutral(ex)}
        need = "correct and erroneous steps"
    else:
        dev_kinds, need = {true_first_error(ex) is None for ex in dev}, "fully correct and erroneous solutions"
    if dev and len(dev_kinds) < 2:
        raise SystemExit(
            f"dev split ({len(dev)} examples): needs both {need} to choose a threshold; raise "
            "data.dev_fraction or data.per_category, or set dev_fraction=0"
        )


def load_scorer(cfg: PRMEvalConfig) -> Any:
    """The PRM under evaluation behind `mmprm.load_prm` (HF in this process, or a vLLM engine)."""
    return cfg.prm.build(cfg.model.attn_implementation)


def score_examples(cfg: PRMEvalConfig, exs: list[StepExample]) -> list[list[float]]:
    """The step scores of `exs`, through output.dir/score_cache.jsonl (`CachedScorer`).

    The examples the cache lacks are scored scorer.chunk_examples at a time, each chunk saved before
    the next: a killed run resumes after the last chunk, and a rerun that changes only the slice, the
    dev split or the metrics scores nothing it has scored (without loading the PRM, when that is all).
    """
    from mmprm.data.score_cache import CachedScorer

    scorer = CachedScorer(
        Path(cfg.output.dir) / "score_cache.jsonl",
        lambda: load_scorer(cfg),
        prm=cfg.prm.path,
        convention=cfg.prm.convention,
        max_length=cfg.prm.max_length,
    )
    from mmprm.data.schema import ImageDecodeError
    from mmprm.steps import StepTokenError

    try:
        todo, size = scorer.missing(exs), cfg.scorer.chunk_examples
        if len(todo) < len(exs):
            print(f"{scorer.path}: {len(exs) - len(todo)} of {len(exs)} examples already scored")
        start, n_steps = time.time(), 0
        for lo in range(0, len(todo), size):
            chunk = todo[lo : lo + size]
            n_steps += sum(len(s) for s in scorer.score(chunk, progress=True))
            print(
                f"scored {lo + len(chunk)}/{len(todo)} examples, {n_steps} steps in {time.time() - start:.1f}s "
                f"(saved to {scorer.path})"
            )
        return scorer.score(exs)
    except StepTokenError as e:  # text this PRM's tokenizer reads as structure; the scorer names the example
        raise DataError([f"{cfg.data.path}: {e}"]) from None
    except ImageDecodeError as e:  # an image that does not decode; the message names it
        raise DataError([f"{cfg.data.path}: {e}"]) from None
    except ValueError as e:  # e.g. a prompt longer than prm.max_length, the example named
        raise ConfigError(f"scorer: {e}") from None
    finally:
        scorer.close()


def score_rows(split: str, exs: list[StepExample], scores: list[list[float]]) -> list[dict[str, Any]]:
    """One row per example of `split`: its step scores (NaN past prm.max_length) beside its labels."""
    return [
        {
            "id": ex.id,
            "split": split,
            "category": ex.meta.get("category"),
            "scores": s,
            "labels": [float(x) for x in ex.labels],
            "first_error": true_first_error(ex),
            "neutral_steps": ex.meta.get("neutral_steps", []),
        }
        for ex, s in zip(exs, scores)
    ]


def complete(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows every step of which was scored (none cut by truncation)."""
    return [r for r in rows if not any(math.isnan(s) for s in r["scores"])]


def threshold_of(cfg: PRMEvalConfig, dev_rows: list[dict[str, Any]], objective: str) -> tuple[float, str, str]:
    """(threshold, where it came from, the split it was chosen on): chosen on dev (never on the
    reported rows), or metrics.threshold when there is no dev split."""
    threshold, source, split = cfg.metrics.threshold, "metrics.threshold", "none (given)"
    if dev_rows:
        usable = complete(dev_rows)
        try:
            threshold = choose_threshold(usable, objective)
        except ValueError as e:  # truncation can remove the last example of one kind
            raise SystemExit(f"dev split ({len(usable)} scored examples): {e}; raise prm.max_length") from None
        source = "best first-error F1 on dev" if objective == "first_error_f1" else "best step macro F1 on dev"
        if cfg.data.dev_file:
            split = f"data.dev_file {cfg.data.dev_file} ({len(usable)} examples)"
        else:
            split = (
                f"data.dev_fraction={cfg.data.dev_fraction} of {cfg.data.path}'s source problems, seed "
                f"{cfg.data.seed} ({len(usable)} examples, none of them in the reported metrics)"
            )
    return threshold, source, split


def make_report(
    cfg: PRMEvalConfig,
    dev_rows: list[dict[str, Any]],
    test_rows: list[dict[str, Any]],
    chosen: tuple[float, str, str],
    label_kind: str,
    truncated: int,
) -> dict[str, Any]:
    """report.json's content: metrics over the test rows, overall and per category, and the dev
    split's at the same threshold (`chosen`: threshold, source, split)."""
    threshold, source, split = chosen
    if not complete(test_rows):
        raise SystemExit("every example was truncated: raise prm.max_length")
    soft = any(0.0 < y < 1.0 for r in test_rows for y in r["labels"])
    return {
        "data": cfg.data.path,
        "format": cfg.data.format,
        "prm": cfg.prm.path,
        "threshold": threshold,
        "threshold_source": source,
        "threshold_split": split,
        "labels_soft": soft,
        "label_kind": label_kind,
        "truncated": truncated,
        **report_metrics(test_rows, threshold, soft, mean_f1=cfg.data.format == "processbench"),
        "dev": metrics_of(dev_rows, threshold, soft) if dev_rows else None,
        "config": to_dict(cfg),
    }


def write_report(out_dir: Path, report: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """scores.jsonl (every scored row with its predicted first error), report.json and report.md;
    prints the headline metrics."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for r in rows:
        r["predicted_first_error"] = predicted_first_error(r["scores"], report["threshold"])
        # null on a row cut by truncation: no step below the threshold before the cut (a miss)
        r["truncated"] = any(math.isnan(s) for s in r["scores"])
    write_jsonl(out_dir / "scores.jsonl", rows)
    # NaN is not JSON: write null so any JSON reader opens the report
    clean = json.loads(json.dumps(report), parse_constant=lambda c: None)
    (out_dir / "report.json").write_text(json.dumps(clean, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (out_dir / "report.md").write_text(markdown(report), encoding="utf-8")
    m = report["metrics"]
    print(" ".join(f"{k}={fmt(m[k])}" for k in ("first_error_f1", "macro_f1", "auroc", "step_accuracy")))
    print(f"wrote {out_dir / 'report.json'}, {out_dir / 'report.md'} and {out_dir / 'scores.jsonl'}")


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except (ConfigError, DataError, FileNotFoundError) as e:
        print(f"prm_eval: {e}", file=sys.stderr)
        sys.exit(2)
