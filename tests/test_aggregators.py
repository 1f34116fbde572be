"""Aggregators: hand-computed values, p in {0, 1}, empty candidates and the tie rule."""

import math
import random

import pytest

from mmprm.scoring import AGGREGATORS, EPS, aggregate, pick_best

NAMES = ["min", "average", "max", "last", "product", "sum_logpr", "sum_logodds", "mean_odds"]


def test_names_are_the_contract():
    assert list(AGGREGATORS) == NAMES


def test_hand_computed_values():
    p = [0.5, 0.8, 0.2]
    assert AGGREGATORS["min"](p) == pytest.approx(0.2)
    assert AGGREGATORS["average"](p) == pytest.approx(0.5)
    assert AGGREGATORS["max"](p) == pytest.approx(0.8)
    assert AGGREGATORS["last"](p) == pytest.approx(0.2)
    assert AGGREGATORS["product"](p) == pytest.approx(0.08)
    assert AGGREGATORS["sum_logpr"](p) == pytest.approx(math.log(0.08))
    # log-odds: log 1 + log 4 + log 1/4 = 0
    assert AGGREGATORS["sum_logodds"](p) == pytest.approx(0.0, abs=1e-12)
    # odds: 1, 4, 0.25 -> mean 1.75
    assert AGGREGATORS["mean_odds"](p) == pytest.approx(1.75)


def test_p_zero_is_clamped_not_a_crash():
    assert EPS == 1e-6
    assert AGGREGATORS["min"]([0.0]) == pytest.approx(1e-6)
    assert AGGREGATORS["product"]([0.0, 0.5]) == pytest.approx(0.5e-6)
    assert AGGREGATORS["sum_logpr"]([0.0]) == pytest.approx(-13.815510557964274)
    assert AGGREGATORS["sum_logodds"]([0.0]) == pytest.approx(math.log(1e-6 / (1 - 1e-6)))
    assert AGGREGATORS["mean_odds"]([0.0]) == pytest.approx(1e-6 / (1 - 1e-6))


def test_p_one_is_clamped_and_finite():
    assert AGGREGATORS["max"]([1.0]) == pytest.approx(1 - 1e-6)
    assert AGGREGATORS["sum_logpr"]([1.0]) == pytest.approx(math.log1p(-1e-6))
    assert AGGREGATORS["sum_logodds"]([1.0]) == pytest.approx(13.815509557963774)
    assert AGGREGATORS["mean_odds"]([1.0]) == pytest.approx(999999.0)
    # Clamping is symmetric: a certain-good and a certain-bad step cancel in log-odds.
    assert AGGREGATORS["sum_logodds"]([0.0, 1.0]) == pytest.approx(0.0, abs=1e-9)
    for name in NAMES:
        assert math.isfinite(AGGREGATORS[name]([0.0, 1.0, 0.0]))


def test_empty_candidate_values_and_it_ranks_last():
    expected = {
        "min": 0.0,
        "average": 0.0,
        "max": 0.0,
        "last": 0.0,
        "product": 0.0,
        "sum_logpr": -math.inf,
        "sum_logodds": -math.inf,
        "mean_odds": 0.0,
    }
    for name, value in expected.items():
        assert AGGREGATORS[name]([]) == value
        # Even the worst possible one-step candidate beats an empty one.
        assert AGGREGATORS[name]([0.0]) > AGGREGATORS[name]([])
        assert pick_best([AGGREGATORS[name]([]), AGGREGATORS[name]([0.0, 0.0])]) == 1


def test_ties_go_to_lowest_index():
    cands = [[0.9, 0.3], [0.3, 0.8], [0.1]]
    scores = [AGGREGATORS["min"](c) for c in cands]
    assert scores[0] == scores[1] == 0.3
    assert pick_best(scores) == 0
    # Two candidates pinned at p = 1 tie after clamping; the first wins.
    assert pick_best([AGGREGATORS["max"](c) for c in ([0.2], [1.0, 0.5], [1.0])]) == 1


def test_product_and_sum_logpr_rank_alike():
    rng = random.Random(0)
    cands = [[rng.random() for _ in range(rng.randint(1, 6))] for _ in range(50)]
    by_prod = pick_best([AGGREGATORS["product"](c) for c in cands])
    by_log = pick_best([AGGREGATORS["sum_logpr"](c) for c in cands])
    assert by_prod == by_log


@pytest.mark.parametrize("bad", [1.5, -0.1, float("nan")])
def test_out_of_range_probability_is_a_clear_error(bad):
    with pytest.raises(ValueError, match=r"step 1: probability .* outside \[0, 1\]"):
        AGGREGATORS["average"]([0.5, bad])


def test_aggregate_by_name():
    assert aggregate("last", [0.1, 0.7]) == pytest.approx(0.7)
    with pytest.raises(ValueError, match="unknown aggregator 'median'"):
        aggregate("median", [0.5])


# MM-PRM's edge rules: github:ModalMinds/MM-PRM@b914fd66c8efb3d6667610fba1f8fd1e55cde095:
# eval/prm/extract_calculate.py (`x else 0`, `math.log(a) if a != 0 else -9999`, `... if a != 1 else 9999`).


def test_mm_prm_rules_score_an_empty_candidate_zero_everywhere():
    from mmprm.scoring.aggregators import MM_PRM_AGGREGATORS

    assert list(MM_PRM_AGGREGATORS) == NAMES
    assert all(aggregate(name, [], rules="mm_prm") == 0.0 for name in NAMES)
    # so an empty candidate beats one whose log-scale score is negative, as in MM-PRM's picks
    assert aggregate("sum_logpr", [0.5], rules="mm_prm") == pytest.approx(math.log(0.5))
    assert math.log(0.5) < aggregate("sum_logpr", [], rules="mm_prm")
    assert aggregate("sum_logpr", [], rules="mmprm") == -math.inf


def test_mm_prm_rules_use_sentinels_not_clamping():
    assert aggregate("sum_logpr", [0.0, 0.5], rules="mm_prm") == pytest.approx(-9999 + math.log(0.5))
    assert aggregate("sum_logodds", [1.0, 0.8], rules="mm_prm") == pytest.approx(9999 + math.log(4))
    assert aggregate("sum_logodds", [0.0, 0.5], rules="mm_prm") == -9999.0
    assert aggregate("mean_odds", [1.0, 0.5], rules="mm_prm") == pytest.approx((9999 + 1) / 2)
    assert aggregate("min", [0.0, 0.5], rules="mm_prm") == 0.0  # not EPS
    assert aggregate("product", [0.0, 0.5], rules="mm_prm") == 0.0
    assert aggregate("last", [0.5, 1.0], rules="mm_prm") == 1.0  # not 1 - EPS
    assert aggregate("average", [0.0, 1.0], rules="mm_prm") == 0.5
    assert aggregate("max", [0.2, 0.7], rules="mm_prm") == 0.7


def test_mm_prm_rules_agree_with_mmprm_away_from_the_edges():
    p = [0.5, 0.8, 0.2]
    for name in NAMES:
        assert aggregate(name, p, rules="mm_prm") == pytest.approx(aggregate(name, p))


def test_mm_prm_rules_refuse_what_mmprm_refuses():
    with pytest.raises(ValueError, match="outside"):
        aggregate("min", [1.5], rules="mm_prm")
    with pytest.raises(ValueError, match="edge rules"):
        aggregate("min", [0.5], rules="paper")
