"""Reasoning-tree evaluation: Think360 width/depth, RPTS and RPTS-filtered accuracy of responses.

Reads responses, turns each into a reasoning tree, scores every reasoning node (a constant, a PRM,
the MC values of annotation trees, or an LLM judge), then writes:

    <output.dir>/report.json    per-item and mean width, depth (hard and soft), RPTS, accuracy
    <output.dir>/trees.jsonl    every scored tree (mmprm.treeval.Tree.to_json), for later plots
    <output.dir>/tree_<id>.png  the chosen item's tree, nodes coloured by score

Launch (CPU is enough; a PRM scorer uses the GPU when there is one):

    python recipes/tree_eval.py --config recipes/configs/tiny/tree_eval.yaml
    python recipes/tree_eval.py --config recipes/configs/tiny/tree_eval.yaml scorer.kind=prm prm.path=runs/prm

Input formats (`data.format`):
    rpts      RPTS-Eval JSON array or JSONL rows {id, reasoning: ["Text0 + Image0 -> ...", ...],
              textual_clue, visual_clue, context, statement, answer (gold), [prediction | correct]}.
              A row without `prediction` is gold reasoning: it reaches the gold answer.
    think360  JSONL {id, question, [images], response: "[NODE:1.1] [PARENT:None] ...", [correct]}
    steps     our step JSONL (mmprm.data.schema), each solution a chain; correctness from meta.correct
    mc_tree   annotation trees JSONL (OpenR math-aps nested trees, or mmprm.annotate flat nodes)
"""

from __future__ import annotations

import itertools
import json
import math
import re
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from mmprm.chat import ChatClient, ChatConfig
from mmprm.config import ConfigError, load_config, parse_cli, require_model_dir, to_dict
from mmprm.config_sections import ModelLoadConfig, PRMScorerConfig
from mmprm.data.readers import UnknownReaderError, get_reader
from mmprm.data.schema import DataError, atomic_write
from mmprm.treeval import (
    JudgeScorer,
    Tree,
    constant_scores,
    filtered_accuracy,
    mc_scores,
    path_scores,
    prm_scores,
    render_tree,
    rpts,
    set_scores,
    think360_depth,
    think360_valid,
    think360_width,
)
from mmprm.treeval.readers import built


@dataclass
class TreeDataConfig:
    """The reasoning trees to read.

    Attributes:
        path: input file in data.format (default: in the repository, data/README.md)
        format: the tree_format reader (mmprm.data.readers): rpts (RPTS-Eval texts) | think360 ([NODE]
            blocks) | steps (our JSONL, a chain) | mc_tree (openr MC trees) | a name you registered
        image_dir: rpts: folder of the visual_clue files; null: <path folder>/images
        response_field: think360: the field holding the node blocks
        limit: first N items only; null takes all
    """

    path: str = "data/rpts_eval/texts_en.json"
    format: str = "rpts"
    image_dir: str | None = None
    response_field: str = "response"
    limit: int | None = None


@dataclass
class JudgeConfig(ChatConfig):
    """An LLM judge scoring each node (scorer.kind=judge); endpoint keys as in mmprm.chat.ChatConfig.

    Attributes:
        mode: binary (yes/no per node) | graded (a score in [0, 1])
        send_images: send the item's images with each question
    """

    mode: Literal["binary", "graded"] = "binary"
    send_images: bool = False


@dataclass
class ScorerConfig:
    """What scores each conclusion node.

    Attributes:
        kind: constant (every node scores scorer.constant) | prm (the `prm` section's PRM) | mc (the
            tree's MC values) | judge
        constant: kind=constant: the score of every node
        use_images: show the PRM/judge the item's images (missing files are dropped)
        judge: kind=judge: the judge (section)
    """

    kind: Literal["constant", "prm", "mc", "judge"] = "constant"
    constant: float = 1.0
    use_images: bool = True
    judge: JudgeConfig = field(default_factory=JudgeConfig)


@dataclass
class MetricConfig:
    """Tree metrics.

    Attributes:
        threshold: a node is correct when its score >= this (Think360 width/depth)
        rpts_lambda: RPTS height decay in (0, 1]
        rpts_h_f: RPTS focus height: nodes up to it weigh 1
        filter_threshold: filtered accuracy counts an item when its answer is right and its RPTS >= this
        path_aggregator: e.g. min: also report the final path's aggregated score; null skips it
    """

    threshold: float = 0.5
    rpts_lambda: float = 0.9
    rpts_h_f: int = 1
    filter_threshold: float = 0.5
    path_aggregator: str | None = None


@dataclass
class OutputConfig:
    """Where results go.

    Attributes:
        dir: output folder: trees.jsonl, report.json, report.md and the tree plot
        plot_item: id of the item to draw; null draws the first item
    """

    dir: str = "runs/tree_eval"
    plot_item: str | None = None


@dataclass
class TreeEvalConfig:
    """tree_eval settings.

    Attributes:
        data: the trees
        scorer: node scores
        prm: scorer.kind=prm: the PRM (section); batch_size: node paths per forward
        model: model loading (section)
        metrics: metrics
        output: outputs
    """

    data: TreeDataConfig = field(default_factory=TreeDataConfig)
    scorer: ScorerConfig = field(default_factory=ScorerConfig)
    prm: PRMScorerConfig = field(default_factory=PRMScorerConfig)
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
        try:
            get_reader("tree_format", self.data.format)
        except UnknownReaderError as e:
            raise ValueError(f"data.format: {e}") from None
        if self.scorer.kind == "prm" and not self.prm.path:
            raise ValueError("prm.path: set it to a PRM directory when scorer.kind=prm")
        if self.scorer.kind == "prm":
            from mmprm.models.loading import resolve_attn_implementation

            resolve_attn_implementation(self.model.attn_implementation)  # before any weight loads
        if self.scorer.kind == "judge" and not self.scorer.judge.model:
            raise ValueError("scorer.judge.model: set the judge's model name when scorer.kind=judge")
        if self.scorer.kind == "mc" and self.data.format != "mc_tree":
            raise ValueError("scorer.kind=mc needs data.format=mc_tree (MC values come from annotation trees)")
        if not 0.0 <= self.scorer.constant <= 1.0:
            raise ValueError(f"scorer.constant: {self.scorer.constant} is outside [0, 1]")
        if not 0.0 < self.metrics.rpts_lambda <= 1.0:
            raise ValueError(f"metrics.rpts_lambda: {self.metrics.rpts_lambda} must be in (0, 1]")


def iter_items(cfg: TreeDataConfig) -> Iterator[dict[str, Any]]:
    """Each item, read one at a time up to data.limit: {"id", "tree", "correct": bool | None,
    "reference": gold answer or None, "where": its file, line and id for messages}."""
    path = Path(cfg.path)
    if not path.exists():
        hint = (
            "" if path.is_absolute() else f"; relative paths are read from {Path.cwd()}, run from the repository root"
        )
        raise SystemExit(f"data.path: {path} not found (set data.path{hint})")
    read = get_reader("tree_format", cfg.format)
    return itertools.islice(read(path, image_dir=cfg.image_dir, response_field=cfg.response_field), cfg.limit)


def mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def score_trees(
    items: Iterable[dict[str, Any]],
    n_items: int,
    scorer_cfg: ScorerConfig,
    metrics: MetricConfig,
    prm: Any,
    judge: JudgeScorer | None,
    aggregate: Any,
) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(item, row) for each item, its tree scored by the configured scorer, the row its metrics (an
    item the judge could not fully score gets a row that says so, and no metrics)."""
    start, rpts_sum, n_rpts = time.time(), 0.0, 0
    for done, it in enumerate(items, start=1):
        tree = it["tree"]
        if scorer_cfg.kind == "constant":
            scores = constant_scores(tree, scorer_cfg.constant)
        elif scorer_cfg.kind == "mc":
            scores = built(it["where"], mc_scores, tree)  # a node without its MC value, named
        elif scorer_cfg.kind == "prm":
            scores = prm_scores(tree, prm)
        else:
            judged = judge.judge(tree, reference=it["reference"])
            scores = judged.scores
            if judged.unparsed:  # not fully scored: reported, kept out of every average
                row = {
                    "id": it["id"],
                    "nodes": len(tree.conclusions()),
                    "unjudged_nodes": judged.unparsed,
                    "correct": it["correct"],
                    "warnings": tree.warnings,
                }
                yield it, row
                continue
        set_scores(tree, scores)
        row = tree_row(it, metrics, aggregate)
        rpts_sum, n_rpts = rpts_sum + row["rpts"], n_rpts + 1
        yield it, row
        if done % 50 == 0 or done == n_items:
            eta = (time.time() - start) / done * (n_items - done)
            print(f"  {done}/{n_items} scored, mean RPTS {rpts_sum / max(n_rpts, 1):.4f}, ETA {eta:.0f}s")


def tree_row(it: dict[str, Any], metrics: MetricConfig, aggregate: Any) -> dict[str, Any]:
    """The report row of an item whose tree is scored: RPTS, RPTS-filtered correctness, Think360
    width/depth, and the final path's aggregated score when metrics.path_aggregator is set."""
    tree = it["tree"]
    score_rpts = rpts(tree, lam=metrics.rpts_lambda, h_f=metrics.rpts_h_f)
    passed = None if it["correct"] is None else bool(it["correct"]) and score_rpts >= metrics.filter_threshold
    # As the Think360 reference: a tree with an invalid structure gets no width/depth.
    valid, why = think360_valid(tree)
    row = {
        "id": it["id"],
        "nodes": len(tree.conclusions()),
        "width": think360_width(tree, metrics.threshold) if valid else None,
        "depth": think360_depth(tree, metrics.threshold) if valid else None,
        "width_soft": think360_width(tree, soft=True) if valid else None,
        "depth_soft": think360_depth(tree, soft=True) if valid else None,
        "rpts": score_rpts,
        "correct": it["correct"],
        "filtered_correct": passed,
        "warnings": tree.warnings,
    }
    if not valid:
        row["invalid_structure"] = why
    if aggregate is not None:
        row["path_score"] = mean(list(path_scores(tree, aggregate).values()))
    return row


def main(argv: list[str]) -> int:
    """Read the trees, score every node, write report.json, trees.jsonl and one tree's picture."""
    # ---- config
    try:
        config_path, overrides = parse_cli(argv, TreeEvalConfig)
        cfg = load_config(TreeEvalConfig, config_path, overrides)
        if cfg.scorer.kind == "prm":
            require_model_dir(cfg, "prm.path", hub=False)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    out_dir = Path(cfg.output.dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    # ---- data: read once to check it all before a model loads; trees are built again as scored
    n_items, pick, n_warn, missing_images = read_items(cfg)

    # ---- scorer
    aggregate = path_aggregator(cfg.metrics)  # a bad name stops the run before a model loads
    prm, judge = make_scorer(cfg, out_dir)

    # ---- score every tree and compute its metrics; each tree is written out, then let go
    rows, drawn = [], None
    items = (keep_images(it, cfg.scorer.use_images)[0] for it in iter_items(cfg.data))
    try:
        with atomic_write(out_dir / "trees.jsonl") as trees_file:
            for k, (it, row) in enumerate(score_trees(items, n_items, cfg.scorer, cfg.metrics, prm, judge, aggregate)):
                rows.append(row)
                trees_file.write(json.dumps({"id": it["id"], **it["tree"].to_json()}, ensure_ascii=False) + "\n")
                if k == pick:
                    drawn = row, it["tree"]
    finally:
        if prm is not None:  # a vLLM engine stops now, not in the interpreter's exit (its threads can abort there)
            prm.close()

    # ---- report, and a picture of one tree
    summary = summarize(rows, cfg.metrics, n_warn, missing_images, aggregate, judge)
    report = {"config": to_dict(cfg), "summary": summary, "items": rows}
    (out_dir / "report.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    png = draw_tree(*drawn, cfg, out_dir)
    print(json.dumps(summary, indent=2))
    print(f"wrote {out_dir / 'report.json'}, {out_dir / 'trees.jsonl'} and {png}")
    return 0


def read_items(cfg: TreeEvalConfig) -> tuple[int, int, int, int]:
    """(items, index of the item to draw, data quirks tolerated while reading, images missing): every
    item is read and checked, keeping only these counts; a missing output.plot_item stops the run
    here, before any scoring work."""
    n_items = n_warn = missing_images = 0
    pick, first_ids = None, []
    for it in iter_items(cfg.data):
        missing_images += keep_images(it, cfg.scorer.use_images)[1]
        n_warn += len(it["tree"].warnings)
        if pick is None and cfg.output.plot_item and it["id"] == cfg.output.plot_item:
            pick = n_items
        first_ids += [it["id"]] if n_items < 5 else []
        n_items += 1
    if not n_items:
        raise SystemExit(f"{cfg.data.path}: no items to evaluate")
    if pick is None and cfg.output.plot_item:
        raise SystemExit(
            f"output.plot_item: no item with id {cfg.output.plot_item!r} in {cfg.data.path} (first ids: "
            f"{', '.join(first_ids)}); set output.plot_item=null to draw the first item"
        )
    print(f"{n_items} items from {cfg.data.path} ({cfg.data.format}); {n_warn} tolerated data quirks")
    return n_items, pick or 0, n_warn, missing_images


def keep_images(item: dict[str, Any], use_images: bool) -> tuple[dict[str, Any], int]:
    """(the item, how many of its images were missing): its tree keeps no images
    (scorer.use_images=false) or only those on disk. RPTS-Eval ships only some of its images: those
    items are scored text-only."""
    tree: Tree = item["tree"]
    if not use_images:
        tree.images = []
        return item, 0
    kept = [p for p in tree.images if Path(p).exists()]
    missing = len(tree.images) - len(kept)
    tree.images = kept
    return item, missing


def make_scorer(cfg: TreeEvalConfig, out_dir: Path) -> tuple[Any, JudgeScorer | None]:
    """(the PRM, the LLM judge): the one scorer.kind needs, the other None (both for constant and mc)."""
    scorer_cfg = cfg.scorer
    prm = judge = None
    if scorer_cfg.kind == "prm":
        from mmprm.data.score_cache import CachedScorer

        # each tree's paths are saved once scored: a killed run resumes, a rerun scores nothing twice
        prm = CachedScorer(
            out_dir / "score_cache.jsonl",
            lambda: cfg.prm.build(cfg.model.attn_implementation),
            prm=cfg.prm.path,
            convention=cfg.prm.convention,
            max_length=cfg.prm.max_length,
        )
    elif scorer_cfg.kind == "judge":
        judge_cfg = scorer_cfg.judge
        client = ChatClient(judge_cfg, config_key="scorer.judge", cache_path=out_dir / "judge_cache.jsonl")
        judge = JudgeScorer(client, mode=judge_cfg.mode, send_images=judge_cfg.send_images)
    return prm, judge


def path_aggregator(metrics: MetricConfig) -> Any:
    """The aggregator metrics.path_aggregator names (`mmprm.scoring.aggregators`), or None."""
    if not metrics.path_aggregator:
        return None
    from mmprm.scoring.aggregators import AGGREGATORS

    if metrics.path_aggregator not in AGGREGATORS:
        raise SystemExit(f"metrics.path_aggregator: {metrics.path_aggregator!r} is not one of {', '.join(AGGREGATORS)}")
    return AGGREGATORS[metrics.path_aggregator]


def summarize(
    all_rows: list[dict[str, Any]],
    metrics: MetricConfig,
    n_warn: int,
    missing_images: int,
    aggregate: Any,
    judge: JudgeScorer | None,
) -> dict[str, Any]:
    """The report's summary: means over the fully scored items (those the judge could not fully
    score are counted, not averaged); accuracies over the items with an answer check."""
    unjudged = [r["id"] for r in all_rows if "unjudged_nodes" in r]
    invalid = [r["id"] for r in all_rows if "invalid_structure" in r]
    rows = [r for r in all_rows if "unjudged_nodes" not in r]
    judged = [r for r in rows if r["correct"] is not None]
    summary = {
        "items": len(all_rows),
        "items_scored": len(rows),
        "items_unjudged": len(unjudged),
        "invalid_trees": len(invalid),
        "width": mean([r["width"] for r in rows]),
        "depth": mean([r["depth"] for r in rows]),
        "width_soft": mean([r["width_soft"] for r in rows]),
        "depth_soft": mean([r["depth_soft"] for r in rows]),
        "rpts": mean([r["rpts"] for r in rows]),
        "accuracy": mean([float(bool(r["correct"])) for r in judged]),
        "filtered_accuracy": filtered_accuracy(
            [bool(r["correct"]) for r in judged], [r["rpts"] for r in judged], metrics.filter_threshold
        )
        if judged
        else None,
        "items_with_answer_check": len(judged),
        "data_warnings": n_warn,
        "images_missing": missing_images,
    }
    if aggregate is not None:
        summary["path_score"] = mean([r["path_score"] for r in rows])
    if judge is not None:
        summary["judge"] = judge.client.stats.to_json()
    return summary


def draw_tree(row: dict[str, Any], tree: Tree, cfg: TreeEvalConfig, out_dir: Path) -> Path:
    """tree_<id>.png: the chosen item's tree, nodes coloured by score, its metrics in the title."""
    fmt = lambda v: "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3f}"  # noqa: E731
    title = (
        f"item {row['id']} - scorer {cfg.scorer.kind} - RPTS {fmt(row.get('rpts'))}, width {fmt(row.get('width'))}, "
        f"depth {fmt(row.get('depth'))}"
    )
    name = re.sub(r"[^\w.-]", "_", row["id"])  # ids like "a/b#3" make no good file names
    return render_tree(tree, out_dir / f"tree_{name}.png", title=title, threshold=cfg.metrics.threshold)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except DataError as e:
        print(f"tree_eval: {e}", file=sys.stderr)
        sys.exit(2)
