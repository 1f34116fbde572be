"""Best-of-N report: hand-computed curve, agreement with the scalar rules, files and real data."""

import itertools
import json
import math

import numpy as np
import pytest
from real_data import DATA, full_or_subset

from mmprm.data.schema import DataError
from mmprm.rerank.report import (
    METHODS,
    bon_curve,
    cli_bon_report,
    n_values,
    read_candidates,
    summarize,
    write_report,
)
from mmprm.scoring import AGGREGATORS, majority_vote, pick_best, weighted_vote
from mmprm.scoring.stats import paired_bootstrap


def cand(probs, answer, correct):
    return {"step_probs": probs, "answer": answer, "correct": correct}


# P0: the wrong candidate has one p=1 step, which fools max / sum_logodds / mean_odds.
# P1: every aggregator prefers the right candidate.
TOY = [
    [cand([0.9, 0.9], "5", True), cand([1.0, 0.2], "6", False)],
    [cand([0.3], "1", False), cand([0.8], "2", True)],
]


def test_n_values():
    assert n_values(1) == [1]
    assert n_values(8) == [1, 2, 4, 8]
    assert n_values(6) == [1, 2, 4, 6]
    assert n_values(3) == [1, 2, 3]


def test_toy_curve_hand_computed():
    curve = bon_curve(TOY)
    assert curve.n_max == 2 and curve.ns == [1, 2] and curve.num_problems == 2
    acc = {m: curve.per_problem[m][2].tolist() for m in METHODS}
    for m in ("min", "average", "last", "product", "sum_logpr"):
        assert acc[m] == [1.0, 1.0], m
    for m in ("max", "sum_logodds", "mean_odds"):
        assert acc[m] == [0.0, 1.0], m
    assert acc["random"] == [0.5, 0.5]
    assert acc["oracle"] == [1.0, 1.0]
    assert acc["majority"] == [0.5, 0.5]  # one vote each: expected accuracy of a tie
    assert acc["weighted_vote"] == [1.0, 1.0]  # min scores: 0.9 vs 0.2, 0.3 vs 0.8
    # N = 1 enumerates both single candidates: every method is the random baseline.
    for m in METHODS:
        assert curve.per_problem[m][1].tolist() == [0.5, 0.5], m


def test_summary_json_shape_and_cis():
    rep = summarize(bon_curve(TOY), n_resamples=200, seed=0)
    assert rep["num_problems"] == 2 and rep["n_max"] == 2
    assert set(rep["methods"]) == set(METHODS) and len(METHODS) == 12
    for _name, by_n in rep["methods"].items():
        assert list(by_n) == ["1", "2"]
        for cell in by_n.values():
            assert isinstance(cell["mean"], float) and len(cell["ci95"]) == 2
            assert cell["ci95"][0] <= cell["mean"] <= cell["ci95"][1]
    assert rep["methods"]["min"]["2"] == {"mean": 1.0, "ci95": [1.0, 1.0]}
    assert rep["methods"]["max"]["2"]["mean"] == 0.5
    assert rep["best_vs_random"]["method"] == "min"  # first of the tied best aggregators
    assert rep["best_vs_random"]["diff"] == 0.5
    json.dumps(rep)  # plain JSON types only


def _brute_force(problems, n):
    """Scalar rules over every subset of size n, averaged per problem."""
    out = {m: [] for m in METHODS}
    for cands in problems:
        accs = {m: [] for m in METHODS}
        for sub in itertools.combinations(cands, n):
            correct = [c["correct"] for c in sub]
            answers = [c["answer"] for c in sub]
            for name, fn in AGGREGATORS.items():
                accs[name].append(float(correct[pick_best([fn(c["step_probs"]) for c in sub])]))
            accs["random"].append(np.mean(correct))
            accs["oracle"].append(float(any(correct)))
            accs["majority"].append(majority_vote(answers, correct))
            accs["weighted_vote"].append(
                weighted_vote(answers, [AGGREGATORS["min"](c["step_probs"]) for c in sub], correct)
            )
        for m in METHODS:
            out[m].append(np.mean(accs[m]))
    return out


def _random_problems(rng, p, n):
    problems = []
    for _ in range(p):
        cands = []
        for _ in range(n):
            k = int(rng.integers(0, 4))  # 0 steps happens: an empty candidate
            probs = rng.choice([0.0, 0.25, 0.5, 0.75, 1.0], size=k).tolist()  # ties happen
            answer = None if rng.random() < 0.15 else str(int(rng.integers(0, 3)))
            cands.append(cand(probs, answer, answer == "0"))
        problems.append(cands)
    return problems


def test_vectorised_curve_matches_scalar_rules():
    problems = _random_problems(np.random.default_rng(0), 40, 4)
    curve = bon_curve(problems)  # C(4, 1) = 4 and C(4, 2) = 6 subsets: all enumerated
    for n in (1, 2, 4):
        want = _brute_force(problems, n)
        for m in METHODS:
            np.testing.assert_allclose(curve.per_problem[m][n], want[m], err_msg=f"{m} N={n}")


def test_random_subsets_are_seeded():
    problems = _random_problems(np.random.default_rng(1), 30, 8)  # C(8, 4) = 70 > 32: random
    a, b = bon_curve(problems, seed=3), bon_curve(problems, seed=3)
    c = bon_curve(problems, seed=4)
    for m in METHODS:
        np.testing.assert_array_equal(a.per_problem[m][4], b.per_problem[m][4])
    assert any(not np.array_equal(a.per_problem[m][4], c.per_problem[m][4]) for m in METHODS)
    # More subsets -> the random baseline tends to its exact value, the share correct.
    exact = np.mean([[x["correct"] for x in p] for p in problems], axis=1)
    many = bon_curve(problems, n_subsets=2000, seed=0).per_problem["random"][4]
    assert np.abs(many - exact).max() < 0.05
    assert summarize(a, seed=0) == summarize(b, seed=0)


def test_curve_in_problem_blocks_equals_all_at_once(monkeypatch):
    """bon_curve works in blocks of problems (memory at 100k problems x N=64); the random subset
    draws, and so every number, are those of one pass over all problems."""
    import mmprm.rerank.report as report

    problems = _random_problems(np.random.default_rng(2), 37, 8)  # random subsets at N = 2, 4
    whole = bon_curve(problems, seed=5)
    monkeypatch.setattr(report, "_BLOCK", 5)
    blocked = bon_curve(problems, seed=5)
    for m in METHODS:
        for n in whole.ns:
            np.testing.assert_array_equal(blocked.per_problem[m][n], whole.per_problem[m][n], err_msg=f"{m} N={n}")


def test_resample_means_are_the_plain_bootstrap_in_chunks():
    """Resample b's mean over problems indexed by row b of rng.integers(0, P, (B, P)); several
    rows at once use the same draws (paired), and B need not be a multiple of the chunk."""
    from mmprm.scoring.stats import resample_means

    acc = np.random.default_rng(0).random((3, 50))
    idx = np.random.default_rng(7).integers(0, 50, size=(130, 50))
    want = acc[:, idx].mean(-1).T  # (B, K)
    np.testing.assert_allclose(resample_means(acc, 130, seed=7), want, atol=1e-12)
    np.testing.assert_allclose(resample_means(acc[1], 130, seed=7), want[:, 1], atol=1e-12)
    assert resample_means(np.array([1.0, 0.0]), 4, seed=0).shape == (4,)


def test_paired_bootstrap():
    out = paired_bootstrap(np.array([1, 1, 0, 1.0]), np.array([0, 1, 0, 0.0]), n_resamples=500, seed=0)
    assert out["diff"] == 0.75 - 0.25
    assert 0.0 <= out["ci95"][0] <= 0.5 <= out["ci95"][1] <= 1.0
    assert paired_bootstrap(np.ones(5), np.ones(5))["ci95"] == [0.0, 0.0]
    with pytest.raises(ValueError, match="equal-length"):
        paired_bootstrap(np.ones(3), np.ones(4))


def test_bootstrap_mean():
    """The mean, and the 2.5th/97.5th percentiles of the same resamples `resample_means` draws."""
    from mmprm.scoring.stats import bootstrap_mean, resample_means

    out = bootstrap_mean([1, 1, 0, 0], n_resamples=400, seed=3)
    assert out["mean"] == 0.5
    assert out["ci95"] == list(np.percentile(resample_means(np.array([1, 1, 0, 0.0]), 400, seed=3), [2.5, 97.5]))
    assert bootstrap_mean([0.25] * 7)["ci95"] == [0.25, 0.25]  # no spread, no interval
    with pytest.raises(ValueError, match="non-empty 1-D"):
        bootstrap_mean([])


def test_curve_at_sizes_off_the_powers_of_two():
    problems = [[cand([0.9], "9", False)] + [cand([p], "5", True) for p in (0.5, 0.4, 0.3)]]
    curve = bon_curve(problems, ns=[4, 3])
    assert curve.ns == [3, 4]  # sorted; of the 4 subsets of 3, only the one without the .9 is right
    assert curve.per_problem["min"][3][0] == pytest.approx(0.25) and curve.per_problem["min"][4][0] == 0.0
    assert bon_curve(problems).ns == [1, 2, 4]
    with pytest.raises(ValueError, match=r"sizes \[5\] are outside 1..n_max=4"):
        bon_curve(problems, ns=[2, 5])


def test_input_errors():
    with pytest.raises(ValueError, match="problem 1 has 1 candidates, need at least n_max=2"):
        bon_curve([TOY[0], TOY[1][:1]], n_max=2)
    with pytest.raises(ValueError, match=r"problem 0 candidate 1: step_probs\[0\]: 3.5 is not a probability"):
        bon_curve([[cand([0.5], "1", True), cand([3.5], "1", True)]])
    with pytest.raises(ValueError, match="problem 0 candidate 0: correct: must be true or false"):
        bon_curve([[cand([0.5], "1", 1)]])
    with pytest.raises(ValueError, match="weighted_by='sum_logpr' gives negative scores"):
        bon_curve(TOY, weighted_by="sum_logpr")
    # Extra candidates beyond n_max are left out, and the report says how many problems.
    curve = bon_curve([TOY[0] + [cand([0.1], "9", False)], TOY[1]])
    assert curve.n_max == 2 and curve.settings["truncated_problems"] == 1


def test_write_report_files(tmp_path):
    problems = _random_problems(np.random.default_rng(2), 25, 8)
    rep = write_report(bon_curve(problems), tmp_path, title="Toy Best-of-N", n_resamples=200)
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk == rep and list(on_disk["methods"]["oracle"]) == ["1", "2", "4", "8"]
    md = (tmp_path / "report.md").read_text()
    assert "| method | N=1 | N=2 | N=4 | N=8 |" in md
    assert all(f"| {m}" in md for m in METHODS)
    png = (tmp_path / "bon_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def _write_candidates(path, problems):
    path.write_text("".join(json.dumps({"id": f"p{i}", "candidates": c}) + "\n" for i, c in enumerate(problems)))


def test_cli_and_reader(tmp_path, capsys):
    good = tmp_path / "cands.jsonl"
    _write_candidates(good, TOY)
    assert read_candidates(good) == TOY
    assert cli_bon_report(["--candidates", str(good), "--out", str(tmp_path / "rep"), "--resamples", "100"]) == 0
    assert (tmp_path / "rep" / "report.json").exists() and (tmp_path / "rep" / "bon_curve.png").exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"id": "p0", "candidates": TOY[0]})
        + "\n"
        + json.dumps({"id": "p1", "candidates": [{"step_probs": [2], "answer": 3, "correct": True}]})
        + "\n"
    )
    with pytest.raises(DataError) as e:
        read_candidates(bad)
    assert f"{bad}:2: id=p1: candidates[0].step_probs[0]: 2 is not a probability" in e.value.problems[0]
    assert f"{bad}:2: id=p1: candidates[0].answer:" in e.value.problems[1]
    assert cli_bon_report(["--candidates", str(bad), "--out", str(tmp_path / "x")]) == 2
    assert "bad.jsonl:2: id=p1" in capsys.readouterr().err


def test_uneven_candidate_counts_are_said_in_the_report_and_named(tmp_path, capsys):
    """One problem with 2 candidates caps N at 2 for all: the report says so, and the run names
    the short problem rather than quietly dropping the others' extra candidates."""
    from mmprm.rerank.shards import report_from_scored

    problems = _random_problems(np.random.default_rng(4), 4, 4)
    problems[2] = problems[2][:2]
    scored = tmp_path / "scored.jsonl"
    _write_candidates(scored, problems)
    report = report_from_scored(scored, tmp_path / "rep", resamples=50)
    assert report["n_max"] == 2 and report["settings"]["truncated_problems"] == 3
    assert "N goes up to the smallest, 2 (id=p2), and 3 problems use only their first 2" in capsys.readouterr().err
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "**Candidate counts differ:** N goes up to 2; the 3 problems with more use their first 2 only." in md
    write_report(bon_curve(_random_problems(np.random.default_rng(4), 4, 4)), tmp_path / "even", n_resamples=50)
    assert "Candidate counts differ" not in (tmp_path / "even" / "report.md").read_text()


def test_qwen_math_reference_numbers():
    """The data README's reference numbers: RM best-of-8 94/100, pass@8 96, 728/800 responses correct.

    The repo subset keeps the 14 problems with a wrong response (the other 86 are all correct), so
    there: best-of-8 94 - 86 = 8 of 14, pass@8 96 - 86 = 10, 728 - 688 = 40 of 112 correct.
    """
    rows = [json.loads(line) for line in (DATA / "qwen_math_bon" / "math_cot_100.jsonl").open()]
    sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731  # RM logits -> probabilities, order kept
    problems = [[cand([sigmoid(s[0])], p, c) for s, p, c in zip(r["pred_score"], r["pred"], r["score"])] for r in rows]
    curve = bon_curve(problems)
    rep = summarize(curve)
    n = full_or_subset(full=100, subset=14)
    assert rep["num_problems"] == n and rep["n_max"] == 8
    for m in AGGREGATORS:  # one step each: every aggregator ranks by the RM score
        assert rep["methods"][m]["8"]["mean"] == pytest.approx(full_or_subset(94, 8) / n)
    assert rep["methods"]["oracle"]["8"]["mean"] == pytest.approx(full_or_subset(96, 10) / n)
    assert rep["methods"]["random"]["8"]["mean"] == pytest.approx(full_or_subset(728, 40) / (8 * n))
    # Majority over exact strings: 93 with first-seen ties; our tie rule takes the expectation.
    want = np.mean([majority_vote(r["pred"], r["score"]) for r in rows])
    assert rep["methods"]["majority"]["8"]["mean"] == pytest.approx(want)
    assert full_or_subset(92, 6) <= want * n <= full_or_subset(93, 7)
    diff = (full_or_subset(94, 8) - full_or_subset(728, 40) / 8) / n
    assert rep["best_vs_random"]["diff"] == pytest.approx(diff) and rep["best_vs_random"]["ci95"][0] > 0


def test_a_truncated_candidate_never_wins_on_its_partial_score(tmp_path):
    # Candidate 0 was cut at prm.max_length: its two scored steps look great, but its
    # unscored tail is wrong. Read on the prefix, every aggregator would pick it.
    cut = {**cand([0.95, 0.9], "7", False), "truncated": True}
    problems = [
        [cut, cand([0.7, 0.6, 0.8], "5", True)],
        [{**cand([0.9], "1", True), "truncated": True}, {**cand([0.8], "2", True), "truncated": True}],
    ]
    curve = bon_curve(problems)
    for m in AGGREGATORS:
        # ranked last: the complete candidate wins P0; P1 has only truncated ones -> lowest index
        assert curve.per_problem[m][2].tolist() == [1.0, 1.0], m
    # a truncated candidate keeps its vote in majority but weighs nothing in the weighted vote
    assert curve.per_problem["weighted_vote"][2].tolist() == [1.0, 1.0]
    assert curve.per_problem["majority"][2].tolist() == [0.5, 1.0]
    rep = write_report(curve, tmp_path, n_resamples=50)
    assert rep["truncated_candidates"] == 3 and rep["settings"]["truncated_rule"].startswith("ranked last")
    assert "3 of 4 candidates were truncated" in (tmp_path / "report.md").read_text()
    with pytest.raises(ValueError, match="truncated: must be true or false"):
        bon_curve([[{**cand([0.5], "1", True), "truncated": "yes"}]])


def test_a_truncated_candidate_ranks_below_an_empty_one_under_every_aggregator():
    # A truncated candidate first, an empty one (no steps) second; the flags tell which was picked.
    # Log-scale aggregators score the empty one -inf: a plain argmax tie would pick index 0.
    problems = [[{**cand([0.9, 0.8], "7", False), "truncated": True}, cand([], None, True)]]
    curve = bon_curve(problems)
    for m in AGGREGATORS:
        assert curve.per_problem[m][2].tolist() == [1.0], m


# Four problems, N=2, each candidate's correctness telling which one was picked.
# A: an empty candidate (right) against one step at 0.4: mmprm scores the empty one lowest; MM-PRM
#    scores it 0, above log(0.4) and log(0.4/0.6) (so sum_logpr and sum_logodds pick it).
# B: steps [1.0, 1e-4] (right) against [0.999]: clamped, p = 1 gives log-odds log(999999) = 13.8 and
#    the sum is 4.6 < log(999) = 6.9; MM-PRM's +9999 makes it 9989.8, and its odds 9999 (mean
#    4999.5, still above 999). max and mean_odds pick the right one under both rules.
# C: [0.0] (wrong) against [1e-7] (right): clamped, both read 1e-6 and tie (lowest index, wrong);
#    unclamped, 1e-7 > 0 everywhere and log(1e-7) = -16.1 > -9999.
# D: a truncated candidate with p = 1 (wrong) before an empty one (right): the cut one ranks last
#    under both rules.
EDGE_CASES = [
    [cand([], None, True), cand([0.4], "2", False)],
    [cand([1.0, 1e-4], "1", True), cand([0.999], "2", False)],
    [cand([0.0], "3", False), cand([1e-7], "4", True)],
    [{**cand([1.0], "5", False), "truncated": True}, cand([], None, True)],
]
EDGE_PICKS = {  # aggregator -> accuracy per problem A, B, C, D
    "mmprm": {
        "min": [0, 0, 0, 1],
        "average": [0, 0, 0, 1],
        "max": [0, 1, 0, 1],
        "last": [0, 0, 0, 1],
        "product": [0, 0, 0, 1],
        "sum_logpr": [0, 0, 0, 1],
        "sum_logodds": [0, 0, 0, 1],
        "mean_odds": [0, 1, 0, 1],
    },
    "mm_prm": {
        "min": [0, 0, 1, 1],
        "average": [0, 0, 1, 1],
        "max": [0, 1, 1, 1],
        "last": [0, 0, 1, 1],
        "product": [0, 0, 1, 1],
        "sum_logpr": [1, 0, 1, 1],
        "sum_logodds": [1, 1, 1, 1],
        "mean_odds": [0, 1, 1, 1],
    },
}


@pytest.mark.parametrize("rules", ["mmprm", "mm_prm"])
def test_edge_rules_pick_by_hand_and_are_stated_in_the_report(rules, tmp_path):
    curve = bon_curve(EDGE_CASES, edge_rules=rules)
    for m in AGGREGATORS:
        assert curve.per_problem[m][2].tolist() == EDGE_PICKS[rules][m], m
    rep = write_report(curve, tmp_path, n_resamples=20)
    assert rep["settings"]["edge_rules"] == json.loads((tmp_path / "report.json").read_text())["settings"]["edge_rules"]
    assert rep["settings"]["edge_rules"] == rules
    md = (tmp_path / "report.md").read_text()
    assert f"Edge rules of every aggregator: `{rules}`" in md
    assert ("an empty candidate scores 0" in md) == (rules == "mm_prm")


def test_edge_rules_default_to_mmprm_and_refuse_other_names(tmp_path, capsys):
    assert bon_curve(EDGE_CASES).settings["edge_rules"] == "mmprm"
    with pytest.raises(ValueError, match="edge rules 'mm-prm': choose mmprm or mm_prm"):
        bon_curve(EDGE_CASES, edge_rules="mm-prm")
    path = tmp_path / "c.jsonl"
    _write_candidates(path, EDGE_CASES)
    assert cli_bon_report(["--candidates", str(path), "--out", str(tmp_path), "--edge-rules", "mm_prm"]) == 0
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["settings"]["edge_rules"] == "mm_prm" and rep["methods"]["sum_logodds"]["2"]["mean"] == 1.0


def test_percentile_interval_by_hand():
    """The 2.5th and 97.5th percentiles, numpy's linear interpolation: 0..100 -> [2.5, 97.5]."""
    from mmprm.scoring.stats import percentile_interval

    assert percentile_interval(np.arange(101.0)) == [2.5, 97.5]
    assert percentile_interval(np.array([3.0, 3.0, 3.0])) == [3.0, 3.0]


def test_category_breakdown_by_hand():
    """Three problems, N=2. MathVerse-style single column and a MathVista-style list column (a
    problem counts under each of its skills)."""
    import numpy as np

    from mmprm.rerank.report import BonCurve, category_breakdown

    per_problem = {
        "oracle": {1: np.array([0.5, 1.0, 0.0]), 2: np.array([1.0, 1.0, 0.0])},
        "random": {1: np.array([0.5, 0.5, 0.0]), 2: np.array([0.5, 0.5, 0.0])},
    }
    curve = BonCurve(num_problems=3, n_max=2, ns=[1, 2], per_problem=per_problem)
    metas = [
        {"breakdown": ["version", "skills"], "version": "Vision Only", "skills": ["algebra", "geometry"]},
        {"breakdown": ["version", "skills"], "version": "Text Lite", "skills": ["geometry"]},
        {"breakdown": ["version", "skills"], "version": "Vision Only", "skills": []},
    ]
    got = category_breakdown(curve, metas)
    assert got["version"] == {
        "Text Lite": {"problems": 1, "oracle": 1.0, "random": 0.5},
        "Vision Only": {"problems": 2, "oracle": 0.5, "random": 0.25},
    }
    assert got["skills"] == {
        "algebra": {"problems": 1, "oracle": 1.0, "random": 0.5},
        "geometry": {"problems": 2, "oracle": 1.0, "random": 0.5},
    }
    assert category_breakdown(curve, [{}, {}, {}]) == {}
