"""OmegaPRM search core against a simulated policy whose error probabilities are known."""

from __future__ import annotations

import math
import random

import pytest

from mmprm.annotate.omega import CandidatePool, OmegaConfig, OmegaSearch, Probe, Rollout, drive, q_value, u_value
from mmprm.annotate.simulated import GOLD, SimProblem, SimulatedPolicy, first_wrong_step, random_problems, true_mc
from mmprm.generation.base import RolloutRequest
from mmprm.steps import parse_solution


def answerer(policy: SimulatedPolicy, pid: str):
    """Probe -> verified rollouts, the engine's job done inline for one problem."""

    def answer(probe: Probe) -> list[Rollout]:
        (texts,) = policy.generate([RolloutRequest(pid, "q", [], list(probe.prefix), probe.n)])
        out = []
        for t in texts:
            p = parse_solution(t)
            out.append(Rollout(p.steps, p.answer, p.answer == GOLD))
        return out

    return answer


def run(problem: SimProblem, cfg: OmegaConfig | None = None, seed: int = 0):
    policy = SimulatedPolicy({"p": problem}, seed=seed)
    search = OmegaSearch(cfg or OmegaConfig())
    return search, drive(search, answerer(policy, "p"))


def full_prefix(nodes: list[dict], node_id: int) -> list[str]:
    by_id = {n["id"]: n for n in nodes}
    steps: list[str] = []
    while node_id is not None:
        steps = by_id[node_id]["steps"] + steps
        node_id = by_id[node_id]["parent"]
    return steps


# -- the formulas, by hand ------------------------------------------------------------------------


def test_q_and_u_hand_values():
    # alpha^(1-MC) * beta^(len/L): 0.5^0.25 * 0.9^(1000/2000) = 0.840896 * 0.948683
    assert q_value(0.75, 1000, 0.5, 0.9, 2000) == pytest.approx(0.840896415 * 0.948683298, rel=1e-9)
    assert q_value(1.0, 0.0, 0.5, 0.9, 2000) == 1.0
    # c * sqrt(sum N) / (1 + N): 0.125 * 3 / 3
    assert u_value(9, 2, 0.125) == pytest.approx(0.125)
    assert u_value(0, 0, 0.125) == 0.0


def test_pool_pops_the_exact_argmax_of_q_plus_u_as_visits_change():
    """Incremental pool == brute-force re-scoring of every candidate after every pop."""
    rng = random.Random(3)
    pool = CandidatePool(c_puct=0.9)  # large c so U really reorders states
    live: dict[int, tuple[int, float, int]] = {}  # item -> (state, q, seq)
    visits: dict[int, int] = {}
    seq = 0
    popped = []
    for _ in range(400):
        if rng.random() < 0.55 or not live:
            state = rng.randrange(12)
            q = round(rng.random(), 2)  # coarse values force ties: the tie-break is tested too
            pool.add(state, q, seq)
            live[seq] = (state, q, seq)
            visits.setdefault(state, 0)
            seq += 1
        else:
            total = sum(visits.values())
            expect = max(live.values(), key=lambda c: (c[1] + u_value(total, visits[c[0]], 0.9), -c[2]))
            state, item = pool.pop()
            assert (state, item) == (expect[0], expect[2])
            del live[item]
            visits[state] += 1
            popped.append(item)
        assert len(pool) == len(live)
    assert len(popped) == len(set(popped)) > 100


# -- the search on simulated problems -------------------------------------------------------------


def test_binary_search_finds_the_planted_first_error():
    # Step 6 is wrong half the time and nothing else ever is: every localised error must be step 6.
    problem = SimProblem([0, 0, 0, 0, 0, 0.5, 0, 0, 0, 0])
    search, res = run(problem)
    assert res.status == "annotated"
    assert res.first_errors and all(e["step"] == 6 for e in res.first_errors)
    for e in res.first_errors:
        steps = full_prefix(res.nodes, e["node"])
        assert len(steps) == 6 and first_wrong_step(steps) == 6
    # Probes only ever land on good prefixes before step 6 or bad ones from it on.
    for node in search.nodes:
        if not node.terminal and node.prefix:
            assert node.mc == (0.0 if first_wrong_step(node.prefix) else pytest.approx(node.mc))
            if first_wrong_step(node.prefix):
                assert node.mc == 0.0


def test_the_searched_wrong_rollout_is_kept_below_its_first_error():
    # Step 6 is the only error: each binary search ends at a step-6 node, and the whole wrong
    # rollout it ran on hangs below that node as a 0.0 leaf with its (wrong) answer.
    def answered_leaves_below(nodes: list[dict], node_id: int) -> list[dict]:
        error = full_prefix(nodes, node_id)
        return [n for n in nodes if "answer" in n and full_prefix(nodes, n["id"])[: len(error)] == error]

    problem = SimProblem([0, 0, 0, 0, 0, 0.5, 0, 0, 0, 0])
    _, res = run(problem)
    for e in res.first_errors:
        below = answered_leaves_below(res.nodes, e["node"])
        assert below, f"no kept rollout below first error node {e['node']}"
        for leaf in below:
            assert leaf["mc"] == 0.0 and leaf["answer"] != GOLD and len(full_prefix(res.nodes, leaf["id"])) == 10
    _, plain = run(problem, OmegaConfig(keep_failed_rollouts=False))
    # MM-PRM's tree: the same search (no rollout is spent on a kept leaf), without those leaves
    assert plain.rollouts == res.rollouts and plain.first_errors and len(plain.nodes) < len(res.nodes)
    assert not any(answered_leaves_below(plain.nodes, e["node"]) for e in plain.first_errors)


def test_localised_errors_match_the_true_first_error_on_random_problems():
    found = exact = 0
    for pid, problem in random_problems(12, seed=5).items():
        _, res = run(problem, seed=hash(pid) % 1000)
        for e in res.first_errors:
            steps = full_prefix(res.nodes, e["node"])
            found += 1
            exact += first_wrong_step(steps) == e["step"] == len(steps)
    # A miss needs all k=16 rollouts of a good prefix to fail; with these problems that is rare.
    assert found > 200 and exact / found > 0.97


def test_mc_estimates_converge_to_true_values():
    problem = SimProblem([0.05, 0.1, 0.2, 0.0, 0.15, 0.1, 0.05, 0.1])
    # k = 4000 at the root: standard error ~0.008
    search, _ = run(problem, OmegaConfig(rollouts_per_estimate=4000, max_rollouts=4000, max_searches=0))
    assert search.nodes[0].mc == pytest.approx(true_mc(problem, []), abs=0.035)
    # Over every probe of a normal search, estimates are unbiased around the exact values.
    diffs = []
    for seed in range(6):
        s, _ = run(problem, seed=seed)
        diffs += [n.mc - true_mc(problem, n.prefix) for n in s.nodes if not n.terminal]
    assert len(diffs) > 50
    assert abs(sum(diffs) / len(diffs)) < 0.03
    assert max(abs(d) for d in diffs) < 0.5


@pytest.mark.parametrize("max_rollouts,max_searches", [(16, 200), (50, 200), (100, 200), (1000, 3), (333, 7)])
def test_budgets_hold_also_inside_a_binary_search(max_rollouts, max_searches):
    cfg = OmegaConfig(max_rollouts=max_rollouts, max_searches=max_searches)
    for _pid, problem in random_problems(6, seed=max_rollouts).items():
        search, res = run(problem, cfg)
        assert res.rollouts <= max_rollouts
        assert res.searches <= max_searches
        assert res.rollouts == 16 * res.probes == sum(n["n"] for n in res.nodes)


def test_no_rollout_is_selected_twice_and_popped_ones_are_gone():
    for _pid, problem in random_problems(5, seed=11).items():
        search, res = run(problem, OmegaConfig(max_searches=10_000, max_rollouts=3000))
        assert len(res.selected) == len(set(res.selected)) == res.searches
        # the search ran until its pool was empty or the rollout budget stopped it
        assert len(search.pool) == 0 or res.rollouts + 16 > 3000


def test_screening_and_no_steps():
    assert run(SimProblem([0.0] * 5))[1].status == "screened_all_correct"
    assert run(SimProblem([1.0] + [0.0] * 4))[1].status == "screened_all_wrong"
    policy = SimulatedPolicy({"p": SimProblem([0.3] * 5)}, unparsable=["p"])
    res = drive(OmegaSearch(OmegaConfig()), answerer(policy, "p"))
    assert res.status == "no_steps" and res.unparsed_rollouts == 16 and res.nodes[0]["n"] == 16


def test_tree_is_a_prefix_trie():
    """Each node hangs under its longest prefix node: a probe inside an edge splits the edge."""
    _, res = run(random_problems(1, seed=2)["sim-0"])
    prefixes = {n["id"]: tuple(full_prefix(res.nodes, n["id"])) for n in res.nodes}
    inner = {p for i, p in prefixes.items() if "answer" not in res.nodes[i]}
    for n in res.nodes:
        if n["parent"] is None:
            assert n["id"] == 0 and prefixes[0] == ()
            continue
        mine, parent = prefixes[n["id"]], prefixes[n["parent"]]
        assert mine[: len(parent)] == parent
        assert not any(len(parent) < len(p) < len(mine) and mine[: len(p)] == p for p in inner)
        if "answer" not in n:
            assert n["steps"], "an inner edge always adds steps"


def test_search_rejects_bad_config_and_wrong_rollout_counts():
    with pytest.raises(ValueError, match="max_rollouts"):
        OmegaSearch(OmegaConfig(max_rollouts=8))
    gen = OmegaSearch(OmegaConfig()).run()
    assert next(gen) == Probe((), 16)
    with pytest.raises(ValueError, match="asked for 16 rollouts"):
        gen.send([Rollout(["a"], "1", True)])


def test_search_is_deterministic():
    problem = random_problems(1, seed=9)["sim-0"]
    a, b = run(problem, seed=4)[1], run(problem, seed=4)[1]
    assert a.nodes == b.nodes and a.first_errors == b.first_errors and a.selected == b.selected
    assert math.isclose(a.nodes[0]["mc"], b.nodes[0]["mc"])


# -- unfinished rollouts (cut at max_new_tokens, or no answer written) ----------------------------


def scripted(replies: dict[tuple[str, ...], list[Rollout]]):
    """Probe -> the rollouts scripted for its prefix (every probe must be scripted)."""

    def answer(probe: Probe) -> list[Rollout]:
        return replies[probe.prefix]

    return answer


def test_an_unfinished_rollout_never_becomes_an_error_label():
    # Root: one correct solution, one cut off mid-solution (answer None). Before the fix the cut
    # one entered the pool; the probe of ("a",) has MC > 0, so the search ended at the full length
    # and valued the unfinished ("a", "b") at 0.0 - blaming step "b" of a solution that may be right.
    replies = {
        (): [Rollout(["a", "b", "c"], GOLD, True), Rollout(["a", "b"], None, False)],
        ("a",): [Rollout(["b", "c"], GOLD, True), Rollout(["b", "c"], GOLD, True)],
    }
    search = OmegaSearch(OmegaConfig(rollouts_per_estimate=2, max_rollouts=100))
    res = drive(search, scripted(replies))
    assert res.status == "annotated"
    assert res.first_errors == [] and res.selected == []
    assert all(n["mc"] > 0 for n in res.nodes)
    assert res.stats()["truncated_rollouts"] == 1


def test_a_probe_whose_rollouts_all_stop_unfinished_is_not_called_bad():
    # The wrong rollout ("a", "x") is searched; the probe of ("a",) gets only cut-off rollouts:
    # no evidence either way, so the search stops there instead of labelling ("a",) MC = 0.
    replies = {
        (): [Rollout(["a", "b"], GOLD, True), Rollout(["a", "x", "y"], "-1", False)],
        ("a",): [Rollout(["b"], None, False), Rollout(["x"], None, False)],
    }
    res = drive(OmegaSearch(OmegaConfig(rollouts_per_estimate=2, max_rollouts=100)), scripted(replies))
    assert res.status == "annotated" and res.searches == 1
    assert res.first_errors == [] and res.incomplete_searches == 1
    assert res.stats()["truncated_rollouts"] == 2


def test_a_root_with_no_finished_rollout_is_no_answer_not_all_wrong():
    replies = {(): [Rollout(["a", "b"], None, False), Rollout(["a"], None, False)]}
    res = drive(OmegaSearch(OmegaConfig(rollouts_per_estimate=2, max_rollouts=100)), scripted(replies))
    assert res.status == "no_answer" and res.stats()["truncated_rollouts"] == 2


def test_request_seeds_are_spaced_n_apart_so_no_two_samples_share_a_seed():
    from mmprm.generation.base import request_seeds

    # vLLM seeds sample j of a request with seed + j. Seeds s, s + 1 for two requests of n = 4
    # would share 3 samples' seeds; spaced n apart they share none.
    assert request_seeds(7, 0, [4, 4, 2]) == [7, 11, 15]
    assert request_seeds(0, 2, [16]) == [2_000_006]
    used = [
        s + j
        for call in range(3)
        for s, n in zip(request_seeds(5, call, [16, 3, 16, 1]), [16, 3, 16, 1])
        for j in range(n)
    ]
    assert len(used) == len(set(used)) == 3 * 36


def test_worker_seed_streams_never_overlap():
    from mmprm.generation.base import request_seeds, worker_seed

    # Before: shard i sampled with seed + i, so shard 1's request seeds were shard 0's shifted by one.
    def used(worker):
        base = worker_seed(0, worker)
        return {s + j for call in range(50) for s in request_seeds(base, call, [16] * 64) for j in range(16)}

    a, b = used(0), used(1)
    assert len(a) == 50 * 64 * 16 and not a & b
