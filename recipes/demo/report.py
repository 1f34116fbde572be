"""The demo's report: report.json, report.md and bon_curve.png from `demo.ablation.evaluate`'s
numbers (and search_vs_bon.png, copied from the search stage).

The markdown opens with one summary line per finding, then the reward models against the outcome
model (step metrics and Best-of-N per N), the step AUROC per kind of wrong step, the search
against Best-of-N at equal tokens (when the search ran) and the stage timings.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from demo.ablation import OUTCOME

from mmprm.data.synthetic import AFTER, ERROR_KINDS

# The published runs of `make demo` with seeds 0, 1 and 2 (`headline_numbers` of each report):
# every report says where its own run falls among them.
PUBLISHED_SEEDS = Path(__file__).with_name("published_seeds.json")
NUMBERS = {2: "two", 3: "three"}  # reward models a run reports, in words


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
    policy_eval = _last_policy_eval(out / "policy" / "metrics.jsonl")
    cpu = sum(c for _, _, c, _ in timings if not math.isnan(c))
    summary = _summary(config, task, policy_eval, results, timings, cpu, run_wall)
    (out / "report.json").write_text(json.dumps(summary, indent=2) + "\n")
    _plot(results, out / "bon_curve.png")

    facts = _facts(results, task, policy_eval, cpu, run_wall)
    if PUBLISHED_SEEDS.exists():
        facts.insert(1, spread_fact(headline_numbers(results), json.loads(PUBLISHED_SEEDS.read_text())))
    search_lines, search_fact = search_section(out / "search")
    if search_fact:
        facts.insert(2, search_fact)
    if (out / "search" / "search_vs_bon.png").exists():
        shutil.copyfile(out / "search" / "search_vs_bon.png", out / "search_vs_bon.png")
    lines = _markdown(config, results, facts, search_lines, timings)
    (out / "report.md").write_text("\n".join(lines) + "\n")


def _last_policy_eval(metrics: Path) -> dict | None:
    """The policy SFT's last eval row (greedy format compliance and answer accuracy); None when
    it wrote none."""
    if not metrics.exists():
        return None
    evals = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip() and '"eval"' in x]
    return evals[-1] if evals else None


def _summary(
    config: dict,
    task: dict,
    policy_eval: dict | None,
    results: dict,
    timings: Sequence[tuple[str, float, float, str]],
    cpu: float,
    run_wall: float | None,
) -> dict:
    """report.json: the run's config and task, the policy's eval, every number of `results`, and
    the stage timings."""
    stage_wall = sum(w for _, w, _, _ in timings if not math.isnan(w))
    return {
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


def _facts(results: dict, task: dict, policy_eval: dict | None, cpu: float, run_wall: float | None) -> list[str]:
    """The summary's lines: Best-of-N at the largest N against the baselines, step metrics, the
    policy, the best reward-model row, where the outcome model is ahead, and the run's time (where
    the run falls among the published seeds goes in second, the search's line third)."""
    n = str(results["n_max"])
    st = results["step"]
    rnd, orc = results["baselines"]["random"], results["baselines"]["oracle"]
    wins = _outcome_wins(results)
    return [
        headline_fact(results),
        f"- Step level (test split, {results['test_steps']} steps of {results['test_candidates_with_steps']} "
        f"candidates, {results['test_share_correct_steps']:.1%} right): the soft-label PRM's step AUROC within the same "
        f"problem and step is {st['soft']['auroc_same_problem_step']:.3f} (pooled {st['soft']['auroc_pooled']:.3f}); "
        + (
            f"hard labels {st['hard']['auroc_same_problem_step']:.3f} ({st['hard']['auroc_pooled']:.3f}); "
            if "hard" in st
            else ""
        )
        + f"the outcome model read on each prefix {st[OUTCOME]['auroc_same_problem_step']:.3f} "
        f"({st[OUTCOME]['auroc_pooled']:.3f}); "
        f"an untrained head on the policy {st['untrained']['auroc_same_problem_step']:.3f} "
        f"({st['untrained']['auroc_pooled']:.3f}).",
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


def _markdown(
    config: dict,
    results: dict,
    facts: list[str],
    search_lines: list[str],
    timings: Sequence[tuple[str, float, float, str]],
) -> list[str]:
    """report.md's lines: the setup, the summary, the table against the outcome model and its plot,
    the wrong steps each model catches, the search (when it ran) and the stage timings."""
    n = str(results["n_max"])
    return [
        "# mmprm demo report",
        "",
        f"Seed {config['seed']}. Held-out problems: {results['splits']['dev']} dev (choose the aggregator and the "
        f"first-error threshold) and {results['splits']['test']} test (every number below); {n} candidates per problem "
        f"from the policy, scored by {NUMBERS.get(len(results['models']), len(results['models']))} reward models "
        "trained on the same MCTS rollouts:",
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
        *_bon_table(results),
        "",
        "![Best-of-N accuracy on the test split](bon_curve.png)",
        "",
        *_kind_section(results),
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


def _kind_section(results: dict) -> list[str]:
    """The step AUROC per kind of wrong step: heading, what it shows, and the table."""
    return [
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


def headline_fact(results: dict) -> str:
    """Best-of-N with the soft PRM's dev-chosen aggregator against the baselines a user compares
    with, in this order: a single sample, majority vote (with the PRM-weighted vote beside it), the
    outcome model; every difference with its 95% paired interval."""
    n = str(results["n_max"])
    soft = results["bon"]["soft"]
    agg = soft["best_on_dev"]
    cells = soft["test"][agg]
    ns = [k for k in cells if k != "1"]
    curve = [cells[k]["mean"] for k in ["1", *ns]]
    rising = all(b >= a for a, b in zip(curve, curve[1:]))
    single, ref = cells[n]["vs_single"], cells[n]["vs_outcome"]
    vote = results["weighted_vs_majority"][n]
    at_ns = ", ".join(f"N={k} {cells[k]['vs_single']['diff']:+.3f} {_ci(cells[k]['vs_single']['ci95'])}" for k in ns)
    return (
        f"- Best-of-{n} with the soft-label PRM (`{agg}`, the aggregator chosen on dev): {cells[n]['mean']:.3f} "
        f"against a single sample {single['b']:.3f}: {single['diff']:+.3f}, 95% paired interval {_ci(single['ci95'])} "
        f"(over a single sample at {at_ns}; {'non-decreasing' if rising else 'not monotone'} in N). "
        f"PRM-weighted vote {vote['a']:.3f} against majority vote {vote['b']:.3f}: {vote['diff']:+.3f} "
        f"{_ci(vote['ci95'])}. Against the outcome model {ref['b']:.3f}: {ref['diff']:+.3f} {_ci(ref['ci95'])}."
        + (
            f" Aggregator chosen on dev for the hard PRM: `{results['bon']['hard']['best_on_dev']}`."
            if "hard" in results["bon"]
            else ""
        )
    )


# What `spread_fact` compares, in the headline's order: key -> what it is.
HEADLINE = {
    "single": "one sample",
    "best_of_n": "Best-of-N with the soft PRM's dev aggregator",
    "majority": "majority vote",
    "weighted_vote": "PRM-weighted vote",
    "outcome": "the outcome model",
    "step_auroc": "the soft PRM's step AUROC",
}


def headline_numbers(results: dict) -> dict[str, float]:
    """The headline's numbers at the largest N (test split), the ones seeds are compared on."""
    n = str(results["n_max"])
    soft = results["bon"]["soft"]
    base = results["baselines"]
    return {
        "single": base["random"][n]["mean"],
        "best_of_n": soft["test"][soft["best_on_dev"]][n]["mean"],
        "majority": base["majority"][n]["mean"],
        "weighted_vote": base["weighted_vote"][n]["mean"],
        "outcome": results["bon"][OUTCOME]["test"]["last"][n]["mean"],
        "step_auroc": results["step"]["soft"]["auroc_same_problem_step"],
    }


def spread_fact(run: dict[str, float], published: dict[str, Any]) -> str:
    """Where this run's headline numbers fall among the published seeds' (below, within, above the
    range of `published["runs"]`, a {seed: headline_numbers} mapping), so that a user on another
    machine can tell a different draw from a broken install."""
    runs = published["runs"]

    def place(key: str) -> str:
        values = [r[key] for r in runs.values()]
        # Compared as printed: the published file holds rounded numbers, and a rerun of a published
        # seed must read "within", not "above" by the rounding.
        value, lo, hi = (round(v, 3) for v in (run[key], min(values), max(values)))
        where = "below" if value < lo else "above" if value > hi else "within"
        return f"{HEADLINE[key]} {value:.3f} ({where} {lo:.3f}-{hi:.3f})"

    seeds = ", ".join(sorted(runs))
    return (
        f"- This run against the published runs of seeds {seeds} ({published['where']}): "
        + "; ".join(place(k) for k in HEADLINE)
        + "."
    )


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
        verdict = "behind both: reranking by any of the reward models is worse than a random pick here"
    return (
        f"- Against the baselines at N={n}: the best reward-model row, {results['models'][m]} `{a}`, "
        f"{best:.3f}; random pick {rnd:.3f}, majority vote {maj:.3f} - {verdict}."
    )


def _plot(results: dict, path: Path) -> None:
    """bon_curve.png: test accuracy against N of each reward model and of the baselines."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ns = results["ns"]
    fig = Figure(figsize=(8.5, 5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    _plot_reward_models(ax, results)
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


def _plot_reward_models(ax: Any, results: dict) -> None:
    """One line per process model and aggregator (`min`, `average`, the one chosen on dev), and
    the outcome model's line with its 95% interval shaded."""
    ns = results["ns"]
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
