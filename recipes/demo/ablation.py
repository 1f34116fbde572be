"""Reward-model ablation on synthetic Best-of-N candidates, where every step has an exact label.

`recipes/quickstart.py` trains three reward models on the same MCTS rollouts (PRM with soft MC
labels, PRM with hard labels, outcome model) and scores one set of held-out candidates with each.
This module turns those scored files into the report:

* step level, on the test split, against `mmprm.data.synthetic.check_steps`: AUROC within
  (problem, step index) - right vs wrong step at the same point of two candidates for the same
  problem, what reranking relies on - the pooled AUROC, and ProcessBench first-error F1 with the
  threshold chosen on the dev split; and that AUROC again for each kind of first error
  (`mmprm.data.synthetic.step_verdicts`: a miscopied carry, false arithmetic, a misread tile, ...)
  and for the steps after it, which tells what a reward model can check and what it cannot;
* Best-of-N on the test split for `min`, `average`, `last` and the aggregator chosen on dev, each
  against the outcome model with a 95% paired bootstrap interval over test problems.

The outcome model reads a whole solution as one step; its per-step scores (for the step metrics)
are its scores of each prefix, read the same way.

Files read under OUTPUT_DIR: data/heldout_problems.jsonl, bon/candidates.jsonl,
{bon dir}/scored.jsonl per model and the outcome model's prefix scores (`PREFIX_SCORES` in its
Best-of-N folder, written first when missing). Files written: report.json, report.md and bon_curve.png
(and search_vs_bon.png, copied from the search stage).
"""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mmprm.data.synthetic import AFTER, ERROR_KINDS, RIGHT, step_verdicts
from mmprm.rerank.compare import choose_on_dev, compare_at
from mmprm.rerank.report import bon_curve, summarize
from mmprm.scoring.metrics import auroc, best_threshold, first_error, first_error_f1, stratified_auroc

SPLITS = ("dev", "test")
REPORTED = ("min", "average", "last")  # plus each model's dev-chosen aggregator
OUTCOME = "outcome"
PREFIX_SCORES = "prefix_scores.jsonl"  # in the outcome model's Best-of-N folder


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
    from mmprm.data.schema import read_jsonl, write_jsonl
    from mmprm.models.prm import load_prm

    scores = _prefix_scores(
        load_prm(prm_dir, batch_size=32, attn_implementation=attn_implementation),
        read_jsonl(candidates_file),
        progress,
    )
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
    import torch

    from mmprm.data.schema import read_jsonl
    from mmprm.models.loading import load_backbone
    from mmprm.models.prm import PRMScorer, PRMSpec, build_prm

    problems = {r["id"]: r for r in read_jsonl(data / "heldout_problems.jsonl")}
    rows = read_jsonl(out / "bon" / "candidates.jsonl")
    scored = {
        m: {r["id"]: r for r in read_jsonl(out / bon_dir / "scored.jsonl")} for m, (_, bon_dir, _) in models.items()
    }
    ids = {s: [r["id"] for r in rows if _split_of(r["id"]) == s] for s in SPLITS}

    # Why each step of every candidate with steps is right or wrong, its exact labels; keys per split.
    verdicts: dict[tuple[str, int], list[str]] = {}
    for r in rows:
        p = problems[r["id"]]
        for j, c in enumerate(r["candidates"]):
            if c["steps"]:
                verdicts[(r["id"], j)] = step_verdicts(p["meta"]["tiles"], c["steps"], c["answer"], p["answer"])
    labels = {k: [1.0 if v == RIGHT else 0.0 for v in vs] for k, vs in verdicts.items()}
    keys = {s: [k for k in labels if _split_of(k[0]) == s] for s in SPLITS}

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
            for k in keys["test"]
        ]
    )
    untrained_scores = dict(zip(keys["test"], probs))

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

    # Best-of-N: one curve per model and split; aggregators chosen on dev, read on test.
    curves = {
        m: {s: bon_curve([scored[m][i]["candidates"] for i in ids[s]], seed=seed) for s in SPLITS} for m in models
    }
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
                    }
                    for n in ns
                }
                for a in aggs
            },
        }
    baselines = summarize(curves["soft"]["test"], n_resamples, seed)["methods"]
    return {
        "splits": {s: len(ids[s]) for s in SPLITS},
        "n_max": curves[OUTCOME]["test"].n_max,
        "ns": ns,
        "test_steps": len(flat_test),
        "test_share_correct_steps": sum(flat_test) / max(1, len(flat_test)),
        "test_candidates_with_steps": len(keys["test"]),
        "models": {m: name for m, (_, _, name) in models.items()},
        "step": step,
        "step_by_kind": by_kind,
        "bon": bon,
        "baselines": {b: baselines[b] for b in ("random", "majority", "weighted_vote", "oracle")},
        "bootstrap": {"resamples": n_resamples, "seed": seed},
    }


def _ci(lo_hi: Sequence[float]) -> str:
    return f"[{lo_hi[0]:+.3f}, {lo_hi[1]:+.3f}]"


def _outcome_wins(results: dict) -> list[str]:
    """Every (model, aggregator, N) where the outcome model is ahead; significant when the CI is below 0."""
    out = []
    for m, b in results["bon"].items():
        if m == OUTCOME:
            continue
        for a, by_n in b["test"].items():
            for n, cell in by_n.items():
                v = cell["vs_outcome"]
                if round(v["diff"], 3) < 0:  # -0.000 is a tie at the precision shown
                    sig = "significant" if v["ci95"][1] < 0 else "within noise"
                    out.append(f"{results['models'][m]} `{a}` at N={n}: {v['diff']:+.3f} {_ci(v['ci95'])} ({sig})")
    return out


def baseline_fact(results: dict) -> str:
    """The best reward-model row at the largest N against random picks and majority vote.

    A reward model can judge steps well and still pick worse than chance: the policy writes its
    right answer many times over with one score, while each distinct wrong candidate is one more
    chance to outscore it. The report says so when it happens.
    """
    n = str(results["n_max"])
    rows = [(cell[n]["mean"], m, a) for m, b in results["bon"].items() for a, cell in b["test"].items() if n in cell]
    best, m, a = max(rows)
    rnd, maj = results["baselines"]["random"][n]["mean"], results["baselines"]["majority"][n]["mean"]
    if best >= maj:
        verdict = "ahead of both"
    elif best >= rnd:
        verdict = "ahead of random picks, behind majority vote"
    else:
        verdict = "behind both: reranking by any of the three reward models is worse than a random pick here"
    return (
        f"- Against the baselines at N={n}: the best reward-model row, {results['models'][m]} `{a}`, "
        f"{best:.3f}; random pick {rnd:.3f}, majority vote {maj:.3f} - {verdict}."
    )


def _plot(results: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ns = results["ns"]
    fig = Figure(figsize=(8.5, 5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    lines = [
        (m, a) for m in results["bon"] if m != OUTCOME for a in ("min", "average", results["bon"][m]["best_on_dev"])
    ]
    styles = {"soft": "tab:blue", "hard": "tab:orange"}
    for m, a in dict.fromkeys(lines):
        cells = results["bon"][m]["test"][a]
        ax.plot(
            ns,
            [cells[str(n)]["mean"] for n in ns],
            marker="o",
            ms=4,
            lw=1.6,
            color=styles.get(m, "tab:green"),
            ls={"min": "-", "average": ":"}.get(a, "-."),
            label=f"{results['models'][m]}: {a}",
        )
    ref = results["bon"][OUTCOME]["test"]["last"]
    ax.plot(
        ns, [ref[str(n)]["mean"] for n in ns], marker="s", ms=4, lw=2, color="tab:red", label=results["models"][OUTCOME]
    )
    ax.fill_between(
        ns,
        [ref[str(n)]["ci95"][0] for n in ns],
        [ref[str(n)]["ci95"][1] for n in ns],
        color="tab:red",
        alpha=0.12,
        lw=0,
    )
    for b, color in (("random", "0.5"), ("majority", "tab:purple"), ("oracle", "black")):
        ax.plot(
            ns,
            [results["baselines"][b][str(n)]["mean"] for n in ns],
            ls="--",
            marker="s",
            ms=3,
            lw=1.2,
            color=color,
            label=f"{b} (baseline)",
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns)
    ax.set_xticklabels([str(n) for n in ns])
    ax.set_xlabel("N (candidates per problem)")
    ax.set_ylabel("accuracy on the test split")
    ax.set_title(
        f"Best-of-N, {results['splits']['test']} held-out test problems (aggregators chosen on dev)\n"
        "shaded: 95% CI of the outcome model",
        fontsize=10,
    )
    ax.grid(True, alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")


def _kind_table(results: dict) -> list[str]:
    """Step AUROC (same problem and step) per kind of wrong step, one column per model."""
    by_kind = results["step_by_kind"]
    columns = [*results["models"], "untrained"]
    names = {**results["models"], "untrained": "untrained head"}
    kinds = list(by_kind["soft"])
    lines = [
        "| wrong step | steps | " + " | ".join(names[m] for m in columns) + " |",
        "| --- | --- |" + " --- |" * len(columns),
    ]
    for kind in kinds:
        what = "any step after the first error" if kind == AFTER else f"first error: {ERROR_KINDS[kind]}"
        values = [by_kind[m][kind]["auroc_same_problem_step"] for m in columns]  # every model has every kind
        cells = ["" if value is None else f"{value:.3f}" for value in values]
        lines.append(f"| `{kind}`: {what} | {by_kind['soft'][kind]['wrong_steps']} | " + " | ".join(cells) + " |")
    return lines


def _bon_table(results: dict) -> list[str]:
    ns = results["ns"]
    lines = [
        "| model | aggregator | step AUROC (same problem, step) | pooled step AUROC | first-error F1 | "
        + " | ".join(f"N={n}" for n in ns)
        + " |",
        "| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in ns) + " |",
    ]
    for m, b in results["bon"].items():
        st = results["step"][m]
        for i, (a, by_n) in enumerate(b["test"].items()):
            head = (
                f"{st['auroc_same_problem_step']:.3f} | {st['auroc_pooled']:.3f} | {st['first_error_f1']:.3f}"
                if i == 0
                else " | | "
            )
            tag = " (chosen on dev)" if a == b["best_on_dev"] and m != OUTCOME else ""
            cells = []
            for n in ns:
                c = by_n[str(n)]
                if m == OUTCOME:
                    cells.append(f"{c['mean']:.3f} [{c['ci95'][0]:.3f}, {c['ci95'][1]:.3f}]")
                else:
                    v = c["vs_outcome"]
                    cells.append(f"{c['mean']:.3f} ({v['diff']:+.3f} {_ci(v['ci95'])})")
            lines.append(
                f"| {results['models'][m] if i == 0 else ''} | `{a}`{tag} | {head} | " + " | ".join(cells) + " |"
            )
    for b in ("random", "majority", "oracle"):
        lines.append(
            f"| {b} (baseline) | | | | | "
            + " | ".join(f"{results['baselines'][b][str(n)]['mean']:.3f}" for n in ns)
            + " |"
        )
    return lines


def search_section(search_dir: Path) -> tuple[list[str], str | None]:
    """Markdown of `recipes/prm_search.py`'s equal-budget comparison (its report.json), and one
    summary line on the largest matched budget; ([], None) when the search did not run."""
    path = search_dir / "report.json"
    if not path.exists():
        return [], None
    rep = json.loads(path.read_text())
    methods, matched = rep["methods"], rep["matched"]
    lines = [
        f"PRM-guided search with the soft-label PRM (`{rep['aggregator']}` of the step scores ranks beams) against "
        f"Best-of-N with the same PRM and policy on the first {rep['num_problems']} test problems; each search "
        "setting is paired with the Best-of-N whose generated tokens per problem are closest "
        "(95% paired bootstrap interval of the difference over problems).",
        "",
        "| search | tokens / problem | accuracy | Best-of-N at that budget | tokens / problem | accuracy | "
        "search - Best-of-N |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m in matched:
        lines.append(
            f"| {m['search']} | {m['search_tokens']:.0f} | {m['search_acc']:.3f} | {m['bon']} | {m['bon_tokens']:.0f} "
            f"| {m['bon_acc']:.3f} | {m['diff']:+.3f} {_ci(m['ci95'])} |"
        )
    votes = [(k, v) for k, v in methods.items() if v.get("kind") == "majority"]
    if votes:
        lines += [
            "",
            "Majority vote over the same samples: " + "; ".join(f"{k} {v['mean']:.3f}" for k, v in votes) + ".",
        ]
    lines += ["", "![Accuracy against generated tokens](search_vs_bon.png)"]
    summary = None
    if matched:
        top = max(matched, key=lambda m: (m["bon_tokens"], m["search_tokens"]))  # the costliest search on a tie
        verdict = "ahead of" if top["ci95"][0] > 0 else "behind" if top["ci95"][1] < 0 else "level with"
        summary = (
            f"- PRM-guided search at the largest matched budget: {top['search']} {top['search_acc']:.3f} vs "
            f"{top['bon']} {top['bon_acc']:.3f} ({top['search_tokens']:.0f} vs {top['bon_tokens']:.0f} tokens per "
            f"problem): {top['diff']:+.3f}, 95% paired interval {_ci(top['ci95'])} - search is {verdict} Best-of-N."
        )
    return lines, summary


def write_report(
    out: Path,
    config: dict,
    results: dict,
    timings: Sequence[tuple[str, float, float, str]],
    run_wall: float | None = None,
) -> None:
    """report.json, report.md and bon_curve.png in `out`.

    `run_wall`: seconds from the first stage to the report of the run that made every output
    (stages overlap in lanes, so it is less than the sum of stage wall times); None when unknown.
    """
    task = json.loads((out / "data" / "task.json").read_text())
    policy_eval = None
    metrics = out / "policy" / "metrics.jsonl"
    if metrics.exists():
        evals = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip() and '"eval"' in x]
        policy_eval = evals[-1] if evals else None
    cpu = sum(c for _, _, c, _ in timings if not math.isnan(c))
    stage_wall = sum(w for _, w, _, _ in timings if not math.isnan(w))
    summary = {
        "config": config,
        "task": task,
        "policy_eval": policy_eval,
        **results,
        "stages": [
            {"stage": s, "wall_seconds": round(w, 1), "cpu_seconds": round(c, 1), "status": st}
            for s, w, c, st in timings
        ],
        "cpu_seconds": round(cpu, 1),
        "stage_wall_seconds": round(stage_wall, 1),
        "run_wall_seconds": None if run_wall is None else round(run_wall, 1),
    }
    (out / "report.json").write_text(json.dumps(summary, indent=2) + "\n")
    _plot(results, out / "bon_curve.png")

    n = str(results["n_max"])
    soft, ref = results["bon"]["soft"], results["bon"][OUTCOME]["test"]["last"][n]
    st = results["step"]
    rnd, orc = results["baselines"]["random"], results["baselines"]["oracle"]
    wins = _outcome_wins(results)
    best_soft = max(("min", "average"), key=lambda a: soft["test"][a][n]["mean"])
    key = soft["test"][best_soft][n]["vs_outcome"]
    facts = [
        f"- Step level (test split, {results['test_steps']} steps of {results['test_candidates_with_steps']} "
        f"candidates, {results['test_share_correct_steps']:.1%} right): the soft-label PRM's step AUROC within the same "
        f"problem and step is {st['soft']['auroc_same_problem_step']:.3f} (pooled {st['soft']['auroc_pooled']:.3f}); "
        f"hard labels {st['hard']['auroc_same_problem_step']:.3f} ({st['hard']['auroc_pooled']:.3f}); the outcome "
        f"model read on each prefix {st[OUTCOME]['auroc_same_problem_step']:.3f} ({st[OUTCOME]['auroc_pooled']:.3f}); "
        f"an untrained head on the policy {st['untrained']['auroc_same_problem_step']:.3f} "
        f"({st['untrained']['auroc_pooled']:.3f}).",
        f"- Best-of-{n}: soft-label PRM `{best_soft}` {soft['test'][best_soft][n]['mean']:.3f} vs outcome model "
        f"{ref['mean']:.3f}: {key['diff']:+.3f}, 95% paired interval {_ci(key['ci95'])}. Aggregator chosen on dev "
        f"for the soft PRM: `{soft['best_on_dev']}`; for the hard PRM: `{results['bon']['hard']['best_on_dev']}`.",
        f"- The policy is imperfect: one sample is right {rnd['1']['mean']:.1%} of the time; "
        f"some of {n} is right (oracle) {orc[n]['mean']:.1%}. A text-only model can reach "
        f"{task['text_only_accuracy']:.1%}."
        + (
            f" Greedy, after SFT: format compliance {policy_eval.get('format_compliance', 0):.1%}, answer accuracy "
            f"{policy_eval.get('answer_accuracy', 0):.1%}."
            if policy_eval
            else ""
        ),
        baseline_fact(results),
        ("- Where the outcome model is ahead of a process model: " + "; ".join(wins) + ".")
        if wins
        else "- The outcome model is ahead of no process-model row at any N.",
        (
            f"- Wall time of the whole run {run_wall / 60:.1f} min on 2 cores (stages after annotation run in two lanes); "
            if run_wall is not None
            else "- "
        )
        + f"CPU time of all stages {cpu / 60:.1f} min (user + system; each stage runs one thread).",
    ]
    search_lines, search_fact = search_section(out / "search")
    if search_fact:
        facts.insert(2, search_fact)
    if (out / "search" / "search_vs_bon.png").exists():
        shutil.copyfile(out / "search" / "search_vs_bon.png", out / "search_vs_bon.png")
    table = _bon_table(results)
    kinds = [
        "### Which wrong steps each model catches",
        "",
        "Step AUROC within the same problem and step, right steps against one kind of wrong step at a time "
        "(`mmprm.data.synthetic.step_verdicts`): the kind of a solution's first error, then every step after it. "
        "A miscopied carry is visible from the line before: checking it is easier than not making it. To catch "
        "false arithmetic or a misread tile, a reward model that starts from the policy must add or read better "
        "than the policy did when it sampled the error.",
        "",
        *_kind_table(results),
    ]
    lines = [
        "# mmprm demo report",
        "",
        f"Seed {config['seed']}. Held-out problems: {results['splits']['dev']} dev (choose the aggregator and the "
        f"first-error threshold) and {results['splits']['test']} test (every number below); {n} candidates per problem "
        "from the policy, scored by three reward models trained on the same MCTS rollouts:",
        "",
        *(f"- **{name}**" for name in results["models"].values()),
        "",
        "## Summary",
        "",
        *facts,
        "",
        "## Reward models against the outcome model (test split)",
        "",
        "Step metrics are against exact step labels (`mmprm.data.synthetic.check_steps`): step AUROC counts right vs "
        "wrong steps at the same step of two candidates for the same problem; the pooled AUROC mixes all steps; "
        "first-error F1 is ProcessBench's, with the threshold chosen on dev. Best-of-N cells: accuracy, then the "
        f"difference to the outcome model with its 95% paired bootstrap interval over test problems "
        f"({results['bootstrap']['resamples']} resamples); N < {n} averages over candidate subsets.",
        "",
        *table,
        "",
        "![Best-of-N accuracy on the test split](bon_curve.png)",
        "",
        *kinds,
        "",
        *(
            ["## PRM-guided search vs Best-of-N at equal generated tokens", "", *search_lines, ""]
            if search_lines
            else []
        ),
        "## Stage timings",
        "",
        "| stage | wall s | CPU s | |",
        "| --- | --- | --- | --- |",
        *(f"| {s} | {w:.1f} | {c:.1f} | {status} |" for s, w, c, status in timings),
        "",
    ]
    (out / "report.md").write_text("\n".join(lines) + "\n")
