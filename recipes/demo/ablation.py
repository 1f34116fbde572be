"""Reward-model ablation on synthetic Best-of-N candidates, where every step has an exact label.

`recipes/quickstart.py` trains its reward models on the same MCTS rollouts (PRM with soft MC
labels, outcome model, and with `hard_prm` the PRM with hard labels) and scores one set of held-out
candidates with each.
This module reads those scored files into every number of the report (`demo.report` writes it):

* step level, on the test split, against `mmprm.data.synthetic.check_steps`: AUROC within
  (problem, step index) - right vs wrong step at the same point of two candidates for the same
  problem, what reranking relies on - the pooled AUROC, and ProcessBench first-error F1 with the
  threshold chosen on the dev split; and that AUROC again for each kind of first error
  (`mmprm.data.synthetic.step_verdicts`: a miscopied carry, false arithmetic, a misread tile, ...)
  and for the steps after it, which tells what a reward model can check and what it cannot;
* Best-of-N on the test split for `min`, `average`, `last` and the aggregator chosen on dev, each
  against a single sample and against the outcome model with a 95% paired bootstrap interval over
  test problems, and the soft PRM's weighted vote against majority vote on the same samples.

The outcome model reads a whole solution as one step; its per-step scores (for the step metrics)
are its scores of each prefix, read the same way.

Files read under OUTPUT_DIR: data/heldout_problems.jsonl, bon/candidates.jsonl,
{bon dir}/scored.jsonl per model, the outcome model's prefix scores (`PREFIX_SCORES` in its
Best-of-N folder) and the untrained head's step scores (`UNTRAINED_SCORES` in bon/), each written
first when missing.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mmprm.data.synthetic import RIGHT, step_verdicts
from mmprm.rerank.compare import choose_on_dev, compare_at
from mmprm.rerank.report import bon_curve, summarize
from mmprm.scoring.metrics import auroc, best_threshold, first_error, first_error_f1, stratified_auroc

SPLITS = ("dev", "test")
REPORTED = ("min", "average", "last")  # plus each model's dev-chosen aggregator
OUTCOME = "outcome"
PREFIX_SCORES = "prefix_scores.jsonl"  # in the outcome model's Best-of-N folder
UNTRAINED_SCORES = "untrained_step_scores.jsonl"  # in the Best-of-N folder


def _split_of(problem_id: str) -> str | None:
    return next((s for s in SPLITS if problem_id.startswith(f"{s}-")), None)


def _prefix_scores(scorer: Any, rows: Sequence[dict], progress: bool = True) -> dict[tuple[str, int], list[float]]:
    """Outcome-model score of every prefix of every candidate, keyed (problem id, candidate index)."""
    keys, examples = [], []
    for row in rows:
        for j, c in enumerate(row["candidates"]):
            for k in range(len(c["steps"])):
                keys.append((row["id"], j))
                examples.append(
                    {"question": row["question"], "images": row["images"], "steps": [" ".join(c["steps"][: k + 1])]}
                )
    out: dict[tuple[str, int], list[float]] = {}
    for key, probs in zip(keys, scorer.score(examples, share_prefix=True, progress=progress)):
        out.setdefault(key, []).extend(probs)
    return out


def write_outcome_prefix_scores(
    prm_dir: Path, candidates_file: Path, out_file: Path, attn_implementation: str, progress: bool = True
) -> None:
    """Score every prefix of every candidate with the outcome model, into `out_file` (JSONL: id,
    candidate index, one probability per step). `evaluate` reads it; the demo writes it in a lane
    of its own, so the report does not wait for it (the slowest part of the evaluation); there its
    progress bar is off, since it would cut into the other lane's lines."""
    from mmprm.config_sections import PRMScorerConfig
    from mmprm.data.schema import read_jsonl, write_jsonl

    scorer = PRMScorerConfig(path=str(prm_dir), device="cpu", batch_size=32)  # the demo runs on CPU cores
    scores = _prefix_scores(
        scorer.build(attn_implementation),
        read_jsonl(candidates_file),
        progress,
    )
    write_jsonl(out_file, [{"id": i, "candidate": j, "probs": probs} for (i, j), probs in scores.items()])


def write_untrained_step_scores(policy: Path, candidates_file: Path, out_file: Path, attn_implementation: str) -> None:
    """The untrained head's step scores of the test candidates (`_untrained_step_scores`) into
    `out_file` (JSONL: id, candidate index, one probability per step). `evaluate` reads it; the demo
    writes it in a lane, so the report does not wait for it."""
    from mmprm.data.schema import read_jsonl, write_jsonl

    rows = read_jsonl(candidates_file)
    scores = _untrained_step_scores(policy, rows, _keys_with_steps(rows, "test"), attn_implementation)
    write_jsonl(out_file, [{"id": i, "candidate": j, "probs": probs} for (i, j), probs in scores.items()])


def _auroc_by_kind(scores: dict, verdicts: dict, keys: list) -> dict[str, dict[str, Any]]:
    """Same-step AUROC of the right steps against each kind of wrong step (`step_verdicts`), most
    frequent kind first; None where no (problem, step) holds both a right step and that kind."""
    kinds = Counter(v for k in keys for v in verdicts[k] if v != RIGHT)
    out = {}
    for kind, count in kinds.most_common():
        picked = [
            (scores[k][i], v == RIGHT, (k[0], i)) for k in keys for i, v in enumerate(verdicts[k]) if v in (RIGHT, kind)
        ]
        value = stratified_auroc([x for x, _, _ in picked], [float(y) for _, y, _ in picked], [z for _, _, z in picked])
        out[kind] = {"wrong_steps": count, "auroc_same_problem_step": None if math.isnan(value) else value}
    return out


def _step_metrics(scores: dict, labels: dict, dev_keys: list, test_keys: list) -> dict[str, float]:
    """AUROC (same problem and step; pooled) and first-error F1 on test, threshold picked on dev."""
    test_scores = [scores[k] for k in test_keys]
    test_labels = [labels[k] for k in test_keys]
    strata = [(k[0], i) for k in test_keys for i in range(len(labels[k]))]
    flat_s = [x for s in test_scores for x in s]
    flat_y = [y for ys in test_labels for y in ys]
    try:
        threshold = best_threshold([scores[k] for k in dev_keys], [first_error(labels[k]) for k in dev_keys])
    except ValueError:  # dev holds only right or only wrong solutions
        threshold = 0.5
    f1 = first_error_f1(test_scores, [first_error(y) for y in test_labels], threshold)
    return {
        "auroc_same_problem_step": stratified_auroc(flat_s, flat_y, strata),
        "auroc_pooled": auroc(test_scores, test_labels),
        "first_error_f1": f1["f1"],
        "first_error_threshold": threshold,
        "first_error_acc_erroneous": f1["error_acc"],
        "first_error_acc_correct": f1["correct_acc"],
    }


def evaluate(
    out: Path,
    data: Path,
    policy: Path,
    models: Mapping[str, tuple[str, str, str]],
    n_resamples: int = 1000,
    seed: int = 0,
    attn_implementation: str = "sdpa",
) -> dict[str, Any]:
    """Every number of the report, as a JSON-ready dict.

    Args:
        out: the demo's output folder.
        data: its data folder (heldout_problems.jsonl with dev-* and test-* ids).
        policy: the policy checkpoint (the untrained-head PRM is built on it).
        models: report key -> (training folder, Best-of-N folder, display name); the key
            "outcome" is the reference every other model is compared with.
        n_resamples, seed: paired bootstrap settings.
        attn_implementation: attention kernel of the models loaded here (the demo's `model.attn_implementation`).
    """
    from mmprm.data.schema import read_jsonl

    problems = {r["id"]: r for r in read_jsonl(data / "heldout_problems.jsonl")}
    rows = read_jsonl(out / "bon" / "candidates.jsonl")
    scored = {
        m: {r["id"]: r for r in read_jsonl(out / bon_dir / "scored.jsonl")} for m, (_, bon_dir, _) in models.items()
    }
    ids = {s: [r["id"] for r in rows if _split_of(r["id"]) == s] for s in SPLITS}
    verdicts, labels, keys = _exact_labels(problems, rows)
    step_scores = _model_step_scores(out, models, scored, labels, attn_implementation)
    untrained_file, candidates_file = out / "bon" / UNTRAINED_SCORES, out / "bon" / "candidates.jsonl"
    if not untrained_file.exists() or untrained_file.stat().st_mtime < candidates_file.stat().st_mtime:
        write_untrained_step_scores(policy, candidates_file, untrained_file, attn_implementation)
    untrained_scores = {(r["id"], r["candidate"]): r["probs"] for r in read_jsonl(untrained_file)}
    step, by_kind = _step_results(models, step_scores, untrained_scores, verdicts, labels, keys)

    # Best-of-N: one curve per model and split; aggregators chosen on dev, read on test.
    curves = {
        m: {s: bon_curve([scored[m][i]["candidates"] for i in ids[s]], seed=seed) for s in SPLITS} for m in models
    }
    bon = _bon_results(curves, models, n_resamples, seed)
    soft_test = curves["soft"]["test"]
    baselines = summarize(soft_test, n_resamples, seed)["methods"]
    flat_test = [y for k in keys["test"] for y in labels[k]]
    return {
        "splits": {s: len(ids[s]) for s in SPLITS},
        "n_max": curves[OUTCOME]["test"].n_max,
        "ns": curves[OUTCOME]["test"].ns,
        "test_steps": len(flat_test),
        "test_share_correct_steps": sum(flat_test) / max(1, len(flat_test)),
        "test_candidates_with_steps": len(keys["test"]),
        "models": {m: name for m, (_, _, name) in models.items()},
        "step": step,
        "step_by_kind": by_kind,
        "bon": bon,
        "baselines": {b: baselines[b] for b in ("random", "majority", "weighted_vote", "oracle")},
        # the soft PRM's weights in the vote against the plain count, on the same samples
        "weighted_vs_majority": {
            str(n): compare_at(soft_test, "weighted_vote", soft_test, "majority", n, n_resamples, seed)
            for n in curves[OUTCOME]["test"].ns
        },
        "bootstrap": {"resamples": n_resamples, "seed": seed},
    }


def _exact_labels(problems: Mapping[str, dict], rows: Sequence[dict]) -> tuple[dict, dict, dict[str, list]]:
    """Why each step of every candidate with steps is right or wrong (`step_verdicts`), its exact
    0/1 labels, and the candidates of each split; all keyed (problem id, candidate index)."""
    verdicts: dict[tuple[str, int], list[str]] = {}
    for r in rows:
        p = problems[r["id"]]
        for j, c in enumerate(r["candidates"]):
            if c["steps"]:
                verdicts[(r["id"], j)] = step_verdicts(p["meta"]["tiles"], c["steps"], c["answer"], p["answer"])
    labels = {k: [1.0 if v == RIGHT else 0.0 for v in vs] for k, vs in verdicts.items()}
    return verdicts, labels, {s: _keys_with_steps(rows, s) for s in SPLITS}


def _keys_with_steps(rows: Sequence[dict], split: str) -> list[tuple[str, int]]:
    """(problem id, candidate index) of SPLIT's candidates with steps, in file order: the ones
    with exact labels."""
    return [
        (r["id"], j) for r in rows if _split_of(r["id"]) == split for j, c in enumerate(r["candidates"]) if c["steps"]
    ]


def _model_step_scores(
    out: Path, models: Mapping[str, tuple[str, str, str]], scored: dict, labels: dict, attn_implementation: str
) -> dict[str, dict[tuple[str, int], list[float]]]:
    """Each model's score of every labelled step: the PRMs' from their Best-of-N scoring, the
    outcome model's from its prefix scores (written first when its lane did not)."""
    from mmprm.data.schema import read_jsonl

    step_scores: dict[str, dict[tuple[str, int], list[float]]] = {}
    for m in models:
        if m == OUTCOME:
            prefix_file = out / models[m][1] / PREFIX_SCORES
            if not prefix_file.exists():
                write_outcome_prefix_scores(
                    out / models[m][0], out / "bon" / "candidates.jsonl", prefix_file, attn_implementation
                )
            step_scores[m] = {(r["id"], r["candidate"]): r["probs"] for r in read_jsonl(prefix_file)}
        else:
            step_scores[m] = {k: scored[m][k[0]]["candidates"][k[1]]["step_probs"] for k in labels}
    return step_scores


def _untrained_step_scores(
    policy: Path, rows: Sequence[dict], test_keys: list, attn_implementation: str
) -> dict[tuple[str, int], list[float]]:
    """Step scores of the test candidates by a PRM head left at its seeded random init on the
    policy: the floor a trained reward model must clear."""
    import torch

    from mmprm.models.loading import load_backbone
    from mmprm.models.prm import PRMScorer, PRMSpec, build_prm

    backbone, processor = load_backbone(policy, attn_implementation=attn_implementation)
    torch.manual_seed(0)
    untrained = PRMScorer(build_prm(backbone, processor, PRMSpec()), processor, batch_size=32)
    test_rows = {r["id"]: r for r in rows}
    probs = untrained.score(
        [
            {
                "question": test_rows[k[0]]["question"],
                "images": test_rows[k[0]]["images"],
                "steps": test_rows[k[0]]["candidates"][k[1]]["steps"],
            }
            for k in test_keys
        ]
    )
    return dict(zip(test_keys, probs))


def _step_results(
    models: Mapping[str, Any], step_scores: dict, untrained_scores: dict, verdicts: dict, labels: dict, keys: dict
) -> tuple[dict[str, dict], dict[str, dict]]:
    """Step metrics of every model and of the untrained head (AUROCs only: it has no dev
    threshold), and each one's AUROC per kind of wrong step, all on the test split."""
    step = {m: _step_metrics(step_scores[m], labels, keys["dev"], keys["test"]) for m in models}
    flat_test = [y for k in keys["test"] for y in labels[k]]
    strata = [(k[0], i) for k in keys["test"] for i in range(len(labels[k]))]
    step["untrained"] = {
        "auroc_same_problem_step": stratified_auroc(
            [x for k in keys["test"] for x in untrained_scores[k]], flat_test, strata
        ),
        "auroc_pooled": auroc([untrained_scores[k] for k in keys["test"]], [labels[k] for k in keys["test"]]),
    }
    by_kind = {m: _auroc_by_kind(step_scores[m], verdicts, keys["test"]) for m in models}
    by_kind["untrained"] = _auroc_by_kind(untrained_scores, verdicts, keys["test"])
    return step, by_kind


def _bon_results(curves: dict, models: Mapping[str, Any], n_resamples: int, seed: int) -> dict[str, Any]:
    """Per model: the aggregator chosen on dev, dev accuracies at the largest N, and test accuracy
    per aggregator and N against the outcome model's `last` and against a single sample (paired
    bootstrap)."""
    ns = curves[OUTCOME]["test"].ns
    bon: dict[str, Any] = {}
    for m in models:
        test = summarize(curves[m]["test"], n_resamples, seed)["methods"]
        best = choose_on_dev(curves[m]["dev"])
        aggs = ["last"] if m == OUTCOME else list(dict.fromkeys([*REPORTED, best]))
        bon[m] = {
            "best_on_dev": best,
            "dev_accuracy_at_n_max": {
                a: float(curves[m]["dev"].per_problem[a][curves[m]["dev"].n_max].mean()) for a in aggs
            },
            "test": {
                a: {
                    str(n): {
                        **test[a][str(n)],
                        "vs_outcome": compare_at(
                            curves[m]["test"], a, curves[OUTCOME]["test"], "last", n, n_resamples, seed
                        ),
                        "vs_single": compare_at(
                            curves[m]["test"], a, curves[m]["test"], "random", n, n_resamples, seed
                        ),
                    }
                    for n in ns
                }
                for a in aggs
            },
        }
    return bon
