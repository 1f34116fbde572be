"""Picking the aggregator on dev and comparing two reward models on the same test problems."""

import json

import numpy as np
import pytest
from recipe_runs import load_demo

from mmprm.rerank.compare import choose_on_dev, compare_at
from mmprm.rerank.report import BonCurve


def _curve(per_method: dict[str, list[float]], n: int = 2) -> BonCurve:
    return BonCurve(
        num_problems=len(next(iter(per_method.values()))),
        n_max=n,
        ns=[1, n],
        per_problem={m: {n: np.asarray(v, dtype=float)} for m, v in per_method.items()},
    )


def test_choose_on_dev_takes_the_highest_dev_mean_and_breaks_ties_by_order():
    dev = _curve({"min": [1, 0, 0, 0], "average": [1, 1, 0, 0], "last": [0, 1, 1, 0]})
    # min 0.25, average 0.5, last 0.5: the tie goes to the one listed first
    assert choose_on_dev(dev, ["min", "average", "last"]) == "average"
    assert choose_on_dev(dev, ["min", "last", "average"]) == "last"
    with pytest.raises(ValueError, match="no N=4"):
        choose_on_dev(dev, ["min"], n=4)


def test_compare_at_is_the_paired_mean_difference_with_its_interval():
    a = _curve({"min": [1, 1, 0, 1]})
    b = _curve({"last": [1, 0, 0, 0]})
    out = compare_at(a, "min", b, "last", n=2, n_resamples=2000, seed=0)
    # per-problem differences 0, 1, 0, 1: mean 0.5; a resample mean is k/4 for k = 0..4
    assert (out["a"], out["b"], out["diff"]) == (0.75, 0.25, 0.5)
    lo, hi = out["ci95"]
    assert 0.0 <= lo <= 0.5 <= hi <= 1.0 and {lo * 4, hi * 4} <= {0.0, 1.0, 2.0, 3.0, 4.0}
    # identical per-problem accuracies: the difference and its interval are exactly zero
    assert compare_at(a, "min", a, "min", n=2)["ci95"] == [0.0, 0.0]
    with pytest.raises(ValueError, match="same candidates"):
        compare_at(a, "min", _curve({"last": [1, 0]}), "last", n=2)


def test_search_section_reads_the_matched_budgets(tmp_path):
    import json

    search_section = load_demo("report").search_section

    assert search_section(tmp_path) == ([], None)  # the search did not run
    report = {
        "num_problems": 3,
        "aggregator": "min",
        "methods": {"majority vote N=4": {"kind": "majority", "mean": 0.5}},
        "matched": [
            {"search": "beam W2xM2", "bon": "Best-of-N (PRM min) N=4", "search_tokens": 100.4, "bon_tokens": 98.0,
             "search_acc": 0.6667, "bon_acc": 0.3333, "diff": 0.3333, "ci95": [0.0, 0.6667]},
            {"search": "beam W4xM4", "bon": "Best-of-N (PRM min) N=16", "search_tokens": 390.0, "bon_tokens": 401.0,
             "search_acc": 1.0, "bon_acc": 0.6667, "diff": 0.3333, "ci95": [0.1, 0.6667]},
        ],
    }  # fmt: skip
    (tmp_path / "report.json").write_text(json.dumps(report))
    lines, summary = search_section(tmp_path)
    assert "| beam W2xM2 | 100 | 0.667 | Best-of-N (PRM min) N=4 | 98 | 0.333 | +0.333 [+0.000, +0.667] |" in lines
    assert lines[-1] == "![Accuracy against generated tokens](search_vs_bon.png)"
    assert "majority vote N=4 0.500" in "\n".join(lines)
    # the summary is about the largest budget, and its interval decides the verdict
    assert summary.startswith("- PRM-guided search at the largest matched budget: beam W4xM4 1.000 vs")
    assert summary.endswith("+0.333, 95% paired interval [+0.100, +0.667] - search is ahead of Best-of-N.")


def test_baseline_fact_says_when_reranking_is_worse_than_a_random_pick():
    baseline_fact = load_demo("report").baseline_fact

    def results(soft_min, outcome_last):
        return {
            "n_max": 8,
            "models": {"soft": "PRM, soft MC labels", "outcome": "outcome model (final answer only)"},
            "bon": {
                "soft": {"test": {"min": {"8": {"mean": soft_min}}, "average": {"8": {"mean": 0.5}}}},
                "outcome": {"test": {"last": {"8": {"mean": outcome_last}}}},
            },
            "baselines": {"random": {"8": {"mean": 0.685}}, "majority": {"8": {"mean": 0.958}}},
        }

    behind = baseline_fact(results(0.550, 0.367))
    assert "PRM, soft MC labels `min`, 0.550" in behind and "random pick 0.685, majority vote 0.958" in behind
    assert "worse than a random pick" in behind
    assert "behind majority vote" in baseline_fact(results(0.700, 0.367))
    between = baseline_fact(results(0.600, 0.960))
    assert "outcome model (final answer only) `last`, 0.960" in between and "ahead of both" in between


def test_headline_fact_reads_against_a_single_sample_then_majority_vote_then_the_outcome_model():
    headline_fact = load_demo("report").headline_fact

    def cell(mean, single, lo):
        return {"mean": mean, "vs_single": {"b": single, "diff": mean - single, "ci95": [lo, 0.2]}}

    def results(means):
        cells = {n: cell(m, 0.625, 0.01) for n, m in zip(["1", "2", "4", "8"], means)}
        cells["8"]["vs_outcome"] = {"b": 0.4, "diff": means[-1] - 0.4, "ci95": [0.2, 0.4]}
        return {
            "n_max": 8,
            "bon": {"soft": {"best_on_dev": "max", "test": {"max": cells}}, "hard": {"best_on_dev": "min"}},
            "weighted_vs_majority": {"8": {"a": 0.95, "b": 0.9, "diff": 0.05, "ci95": [0.02, 0.08]}},
        }

    text = headline_fact(results([0.625, 0.7, 0.7, 0.75]))
    assert text.startswith("- Best-of-8 with the soft-label PRM (`max`, the aggregator chosen on dev): 0.750 ")
    assert "against a single sample 0.625: +0.125, 95% paired interval [+0.010, +0.200]" in text
    assert "N=2 +0.075 [+0.010, +0.200], N=4 +0.075" in text and "non-decreasing in N" in text
    assert "PRM-weighted vote 0.950 against majority vote 0.900: +0.050 [+0.020, +0.080]" in text
    assert text.index("single sample") < text.index("majority vote") < text.index("outcome model 0.400: +0.350")
    assert "not monotone in N" in headline_fact(results([0.625, 0.7, 0.69, 0.75]))


def test_spread_fact_places_each_headline_number_against_the_published_seeds():
    report = load_demo("report")
    keys = list(report.HEADLINE)
    published = {
        "where": "2-core CPU",
        "runs": {"0": dict.fromkeys(keys, 0.6), "1": dict.fromkeys(keys, 0.7), "2": dict.fromkeys(keys, 0.65)},
    }
    run = {**dict.fromkeys(keys, 0.65), "single": 0.55, "step_auroc": 0.75}
    text = report.spread_fact(run, published)
    assert text.startswith("- This run against the published runs of seeds 0, 1, 2 (2-core CPU): one sample 0.550 ")
    assert "one sample 0.550 (below 0.600-0.700)" in text and "majority vote 0.650 (within 0.600-0.700)" in text
    assert text.endswith("the soft PRM's step AUROC 0.750 (above 0.600-0.700).")
    # a rerun of a published seed sits on the range's edge up to the file's rounding: within
    edge = {**dict.fromkeys(keys, 0.65), "single": 0.56375, "step_auroc": 0.87866}
    ends = {"0": {**dict.fromkeys(keys, 0.6), "single": 0.5637, "step_auroc": 0.8787}, "1": dict.fromkeys(keys, 0.9)}
    text = report.spread_fact(edge, {"where": "2-core CPU", "runs": ends})
    assert "one sample 0.564 (within 0.564-0.900)" in text and "AUROC 0.879 (within 0.879-0.900)" in text
    # the published file holds what headline_numbers reads from a report
    published = json.loads(report.PUBLISHED_SEEDS.read_text())
    assert set(published["runs"]) == {"0", "1", "2"} and all(set(r) == set(keys) for r in published["runs"].values())


def test_auroc_by_kind_compares_right_steps_with_one_kind_of_wrong_step_at_a_time():
    _auroc_by_kind = load_demo("ablation")._auroc_by_kind

    # four candidates of problem p, one of q (which holds only wrong steps)
    verdicts = {
        ("p", 0): ["right", "right"],
        ("p", 1): ["right", "after"],
        ("p", 2): ["carry", "after"],
        ("p", 3): ["right", "arithmetic"],
        ("q", 0): ["misread", "after"],
    }
    scores = {
        ("p", 0): [0.9, 0.8],
        ("p", 1): [0.5, 0.2],
        ("p", 2): [0.6, 0.1],
        ("p", 3): [0.7, 0.8],
        ("q", 0): [0.3, 0.3],
    }
    out = _auroc_by_kind(scores, verdicts, list(verdicts))
    assert list(out) == ["after", "carry", "arithmetic", "misread"]  # most frequent first
    assert [k["wrong_steps"] for k in out.values()] == [3, 1, 1, 1]
    # carry at step 0 of p: right steps 0.9, 0.5, 0.7 against 0.6 -> 2 of 3
    assert out["carry"]["auroc_same_problem_step"] == 2 / 3
    # after at step 1 of p: right 0.8 against 0.2 and 0.1 -> 1
    assert out["after"]["auroc_same_problem_step"] == 1.0
    # arithmetic at step 1 of p: right 0.8 against 0.8 -> a tie
    assert out["arithmetic"]["auroc_same_problem_step"] == 0.5
    # no right step shares a stratum with q's misread: no value, not a guess
    assert out["misread"]["auroc_same_problem_step"] is None
