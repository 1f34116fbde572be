"""PRM-guided search against a scripted policy and a scripted PRM, with hand-computed picks."""

from __future__ import annotations

import pytest

from mmprm.search.core import SearchConfig, SearchTree, StepProposal, run_search
from mmprm.treeval import render_tree, rpts, think360_depth, think360_width

PROBLEM = {"id": "p1", "question": "Add the tiles.", "images": []}


class ScriptedPolicy:
    """prefix (tuple of steps) -> proposals, first `n` returned; unknown prefixes get none."""

    def __init__(self, script: dict[tuple[str, ...], list[tuple[str, str | None]]], tokens: int = 3):
        self.script, self.tokens = script, tokens
        self.calls: list[list[tuple[tuple[str, ...], int]]] = []

    def propose(self, requests):
        self.calls.append([(tuple(r.prefix_steps), r.n) for r in requests])
        return [
            [StepProposal(step, answer, self.tokens) for step, answer in self.script.get(tuple(r.prefix_steps), [])][
                : r.n
            ]
            for r in requests
        ]


class ScriptedPRM:
    """Probability of a step looked up by its text (answer attached where there is one)."""

    def __init__(self, table: dict[str, float], default: float = 0.5):
        self.table, self.default = table, default
        self.calls = 0

    def score(self, examples):
        self.calls += 1
        return [[self.table.get(s, self.default) for s in ex["steps"]] for ex in examples]


def ans(step: str, answer: str) -> str:
    return f"{step}\n<answer>{answer}</answer>"


BEAM_SCRIPT = {
    (): [("A", None), ("B", None), ("C", None), ("D", None)],
    ("A",): [("A1", None), ("", "5")],  # the second finishes right after A
    ("C",): [("C1", None), ("C2", None)],
    ("C", "C1"): [("", "7"), ("", None)],  # an answer, and a dead continuation
}
BEAM_PROBS = {
    "A": 0.9,
    "B": 0.6,
    "C": 0.8,
    "D": 0.8,
    "A1": 0.7,
    ans("A", "5"): 0.95,
    "C1": 0.85,
    "C2": 0.3,
    ans("C1", "7"): 0.9,
}


def test_beam_search_hand_computed():
    policy, prm = ScriptedPolicy(BEAM_SCRIPT), ScriptedPRM(BEAM_PROBS)
    [tree] = run_search([PROBLEM], policy, prm, SearchConfig("beam", width=2, expansions=2, aggregator="min"))
    by_step = {(n.step, n.answer): n for n in tree.nodes[1:]}
    # Round 0: A 0.9 > C 0.8 = D 0.8 (tie -> C, created first) > B 0.6; keep A, C.
    assert [n.kept for n in tree.nodes[1:5]] == [True, False, True, False]
    # Round 1: A1 min(.9,.7)=.7, answer after A .95 (A's own step replaced by "A + answer"),
    # C1 min(.8,.85)=.8, C2 .3 -> keep the finished A-answer (done early) and C1 (expanded alone).
    assert by_step[("", "5")].score == pytest.approx(0.95) and by_step[("", "5")].status == "finished"
    assert by_step[("C1", None)].score == pytest.approx(0.8)
    assert policy.calls[1] == [(("A",), 2), (("C",), 2)]
    assert policy.calls[2] == [(("C", "C1"), 2)]  # only the unfinished kept beam goes on
    # Round 2: C1's answer min(.8, .9) = .8, the dead continuation is never scored.
    dead = by_step[("", None)]
    assert dead.status == "dead" and dead.score is None
    assert len(policy.calls) == 3 and prm.calls == 3
    chosen = tree.nodes[tree.chosen]
    assert chosen.answer == "5" and tree.steps(chosen) == ["A"] and chosen.probs == [0.95]
    assert tree.stats["generated_tokens"] == 3 * (4 + 4 + 2)
    assert tree.stats["prm_sequences"] == 4 + 4 + 1


def test_beam_aggregator_changes_the_pick():
    probs = {**BEAM_PROBS, ans("A", "5"): 0.85, ans("C1", "7"): 1.0}
    picks = {}
    for agg in ("min", "last"):
        [t] = run_search(
            [PROBLEM],
            ScriptedPolicy(BEAM_SCRIPT),
            ScriptedPRM(probs),
            SearchConfig("beam", width=2, expansions=2, aggregator=agg),
        )
        picks[agg] = t.nodes[t.chosen]
    # min: "5" scores .85, "7" min(.8 [C], 1.0) = .8 -> "5"; last: .85 vs 1.0 -> "7".
    assert picks["min"].answer == "5" and picks["min"].score == pytest.approx(0.85)
    assert picks["last"].answer == "7" and picks["last"].score == pytest.approx(1.0 - 1e-6)  # clamped at 1 - EPS


def test_step_limit_cuts_and_falls_back_to_the_best_unfinished_node():
    script = {(): [("s1", None)], ("s1",): [("s2", None)], ("s1", "s2"): [("s3", None)]}
    policy = ScriptedPolicy(script)
    [tree] = run_search(
        [PROBLEM], policy, ScriptedPRM({"s1": 0.9, "s2": 0.8}), SearchConfig("beam", width=1, expansions=1, max_steps=2)
    )
    assert [n.step for n in tree.nodes[1:]] == ["s1", "s2"]  # s2 sits at the limit: never expanded
    assert len(policy.calls) == 2
    chosen = tree.nodes[tree.chosen]
    assert chosen.answer is None and chosen.step == "s1"  # min: s1 .9 beats s1+s2 .8; nothing finished


def test_empty_expansions_end_the_search():
    policy = ScriptedPolicy({(): [("A", None), ("B", None)]})  # nothing follows A or B
    [tree] = run_search(
        [PROBLEM], policy, ScriptedPRM({"A": 0.4, "B": 0.7}), SearchConfig("beam", width=2, expansions=1)
    )
    assert len(policy.calls) == 2 and len(tree.nodes) == 3
    assert tree.nodes[tree.chosen].step == "B"
    # An empty root expansion: only the root, nothing scored, nothing chosen but the root.
    [empty] = run_search([PROBLEM], ScriptedPolicy({}), ScriptedPRM({}), SearchConfig("beam", width=2, expansions=2))
    assert len(empty.nodes) == 1 and empty.chosen == 0 and empty.stats["prm_sequences"] == 0


def test_dvts_keeps_one_node_per_subtree():
    script = {
        (): [("A", None), ("B", None), ("C", None), ("D", None)],  # subtree 0: A, B; subtree 1: C, D
        ("B",): [("", "3"), ("B1", None)],
        ("C",): [("", "4"), ("", "9")],
    }
    probs = {
        "A": 0.5,
        "B": 0.6,
        "C": 0.9,
        "D": 0.1,
        ans("B", "3"): 0.7,
        "B1": 0.9,
        ans("C", "4"): 0.2,
        ans("C", "9"): 0.3,
    }
    policy = ScriptedPolicy(script)
    [tree] = run_search([PROBLEM], policy, ScriptedPRM(probs), SearchConfig("dvts", width=2, expansions=2))
    # Round 0: subtree 0 keeps B (.6 > .5), subtree 1 keeps C (.9 > .1).
    # Round 1: subtree 0: B's answer .7 > B1 min(.6, .9) = .6 -> finishes with "3";
    # subtree 1: "9" .3 > "4" .2 -> finishes with "9". Best finished: "3" (.7).
    assert policy.calls[1] == [(("B",), 2), (("C",), 2)]
    assert len(policy.calls) == 2
    assert {n.meta["subtree"] for n in tree.nodes[1:3]} == {0} and {n.meta["subtree"] for n in tree.nodes[3:5]} == {1}
    assert tree.nodes[tree.chosen].answer == "3"


def test_best_first_expands_the_best_frontier_node_and_stops_at_a_finished_top():
    script = {
        (): [("A", None), ("B", None)],
        ("A",): [("A1", None), ("", "2")],
        ("B",): [("", "8")],
        ("A", "A1"): [("", "6")],
    }
    probs = {"A": 0.9, "B": 0.7, "A1": 0.4, ans("A", "2"): 0.3, ans("B", "8"): 0.65}
    policy = ScriptedPolicy(script)
    [tree] = run_search(
        [PROBLEM], policy, ScriptedPRM(probs), SearchConfig("best_first", width=1, expansions=2, aggregator="min")
    )
    # Frontier after root: A .9, B .7 -> expand A: A1 .4, "2" .3 -> frontier B .7, A1 .4, "2" .3
    # -> expand B: "8" .65 on top and finished -> stop. A1 is never expanded.
    assert policy.calls == [[((), 2)], [(("A",), 2)], [(("B",), 2)]]
    assert tree.nodes[tree.chosen].answer == "8"


def test_best_first_respects_its_expansion_budget():
    script = {(): [("a", None)], ("a",): [("b", None)], ("a", "b"): [("c", None)], ("a", "b", "c"): [("", "1")]}
    policy = ScriptedPolicy(script)
    [tree] = run_search(
        [PROBLEM], policy, ScriptedPRM({}), SearchConfig("best_first", width=1, expansions=1, max_expansions=2)
    )
    assert len(policy.calls) == 2 and tree.nodes[tree.chosen].answer is None


def test_problems_share_every_round():
    problems = [PROBLEM, {"id": "p2", "question": "Again.", "images": []}]
    policy, prm = ScriptedPolicy(BEAM_SCRIPT), ScriptedPRM(BEAM_PROBS)
    trees = run_search(problems, policy, prm, SearchConfig("beam", width=2, expansions=2))
    assert [len(c) for c in policy.calls] == [2, 4, 2] and prm.calls == 3  # one call per round, both problems
    assert [t.nodes[t.chosen].answer for t in trees] == ["5", "5"]


def test_tree_round_trip_and_treeval(tmp_path):
    [tree] = run_search(
        [PROBLEM], ScriptedPolicy(BEAM_SCRIPT), ScriptedPRM(BEAM_PROBS), SearchConfig("beam", width=2, expansions=2)
    )
    again = SearchTree.from_json(tree.to_json())
    assert again.to_json() == tree.to_json()
    tv = tree.to_treeval()
    assert len(tv) == len(tree.nodes) - 2  # no root, no dead node
    assert tv.root == f"n{tree.chosen}" and tv.meta["dead_nodes"] == 1
    assert tv.nodes["n1"].score == pytest.approx(0.9) and tv.nodes["n1"].parents == []
    assert tv.nodes[f"n{tree.chosen}"].text == "<answer>5</answer>"
    # Think360 width: sibling groups under A {A1 .7, ans .95} -> 1/2 (A1 .7 >= .5: 2/2), under C
    # {C1 .85, C2 .3} -> 1/2, under C1 {ans .9} -> 1 ; groups of roots don't count.
    assert think360_width(tv) == pytest.approx((1.0 + 0.5 + 1.0) / 3)
    assert 0.0 <= think360_depth(tv) <= 1.0
    # RPTS under the chosen answer n6 (height 2, .95) over its premise A (height 1, .9); h_f = 1, lam = .9:
    # weights 1 for A and .9 for n6 -> (.9 + .9 * .95) / 1.9
    assert rpts(tv) == pytest.approx((0.9 + 0.9 * 0.95) / 1.9)
    png = render_tree(tv, tmp_path / "tree.png", title="beam search")
    assert png.stat().st_size > 1000


def test_config_errors_are_clear():
    with pytest.raises(ValueError, match="aggregator"):
        SearchConfig(aggregator="mean").validate()
    with pytest.raises(ValueError, match="method"):
        SearchConfig(method="mcts").validate()  # type: ignore[arg-type]
    assert SearchConfig("beam", 4, 2).label() == "beam W4xM2"


def test_beam_keeps_distinct_paths_only():
    policy = ScriptedPolicy({(): [("A", None), ("A", None), ("A", None), ("B", None)]})
    [tree] = run_search(
        [PROBLEM], policy, ScriptedPRM({"A": 0.9, "B": 0.2}), SearchConfig("beam", width=2, expansions=2)
    )
    assert [n.kept for n in tree.nodes[1:]] == [True, False, False, True]  # the copies of A give way to B
    [dup] = run_search(
        [PROBLEM],
        ScriptedPolicy(policy.script),
        ScriptedPRM({"A": 0.9, "B": 0.2}),
        SearchConfig("beam", width=2, expansions=2, distinct=False),
    )
    assert [n.kept for n in dup.nodes[1:]] == [True, True, False, False]


def test_equal_budget_report_by_hand(tmp_path):
    from mmprm.search.report import search_report, write_search_report

    search = [
        {
            "id": "p1",
            "correct": True,
            "complete": True,
            "stats": {"generated_tokens": 10, "prm_sequences": 4, "seconds": 1.0},
        },
        {
            "id": "p2",
            "correct": False,
            "complete": True,
            "stats": {"generated_tokens": 20, "prm_sequences": 6, "seconds": 3.0},
        },
    ]
    bon = [
        {
            "id": "p2",
            "candidates": [
                {"step_probs": [0.1], "answer": "3", "correct": False, "tokens": 4},
                {"step_probs": [0.8], "answer": "4", "correct": True, "tokens": 6},
            ],
        },
        {
            "id": "p1",
            "candidates": [
                {"step_probs": [0.9], "answer": "1", "correct": True, "tokens": 5},
                {"step_probs": [0.2], "answer": "2", "correct": False, "tokens": 7},
            ],
        },
    ]
    r = search_report({"beam W1xM2": search}, bon, bon_ns=(1, 2), aggregator="min", n_resamples=200)
    m = r["methods"]
    assert m["beam W1xM2"]["mean"] == 0.5 and m["beam W1xM2"]["tokens_per_problem"] == 15.0
    # N=2: min picks .9 (right) for p1 and .8 (right) for p2; tokens 2 x mean per candidate = 12 and 10
    assert m["Best-of-N (PRM min) N=2"]["mean"] == 1.0 and m["Best-of-N (PRM min) N=2"]["tokens_per_problem"] == 11.0
    # N=1: each candidate alone, half right per problem; majority of two different answers: a coin flip
    assert m["Best-of-N (PRM min) N=1"]["mean"] == 0.5 and m["majority vote N=2"]["mean"] == 0.5
    assert m["one sample"]["mean"] == 0.5 and m["one sample"]["tokens_per_problem"] == 5.5
    [match] = r["matched"]  # 15 tokens: log-closest to N=2 (11), not N=1 (5.5)
    assert match["bon"] == "Best-of-N (PRM min) N=2" and match["diff"] == pytest.approx(-0.5)
    md = write_search_report(r, tmp_path, "t")
    assert "| beam W1xM2 | 15 |" in md.read_text() and (tmp_path / "search_vs_bon.png").exists()
    with pytest.raises(ValueError, match="other problems"):
        search_report({"a": search, "b": search[:1]})


def test_store_resume_streams_ids_and_cuts_a_torn_tail_in_place(tmp_path, capsys):
    """prm_search's results files: resume returns the written ids, truncates a torn last row where
    it lies (no rewrite of a file that may be gigabytes), and refuses damage before the last line."""
    import json
    import os

    from mmprm.data import store

    path = tmp_path / "results.shard0-of-1.jsonl"
    assert store.resume(path) == set()
    good = "".join(json.dumps({"id": f"p{i}", "tree": {"n": i}}) + "\n" for i in range(3))
    path.write_text(good + '{"id": "p3", "tr')
    inode = os.stat(path).st_ino
    assert store.resume(path) == {"p0", "p1", "p2"}
    assert path.read_text() == good and os.stat(path).st_ino == inode
    assert "dropping a torn last row" in capsys.readouterr().err
    with store.open_append(path) as f:
        store.append_row(f, {"id": "p3"})
    assert [r["id"] for r in store.read_rows(path)] == ["p0", "p1", "p2", "p3"]
    assert store.read_rows(path, fields=("id",))[0] == {"id": "p0"}

    path.write_text(good + '{"id": "p3"}')  # whole row, but its newline never reached the disk
    assert store.resume(path) == {"p0", "p1", "p2"} and path.read_text() == good
    path.write_text('{"id": "p0"}\n{"id": "p1", "tr\n{"id": "p2"}\n')
    with pytest.raises(ValueError, match=r"results.shard0-of-1.jsonl:2: id=\?: line: not a JSON row"):
        store.resume(path)
    with pytest.raises(ValueError, match=r"results.shard0-of-1.jsonl:2: id=\?: line: not a JSON row"):
        store.read_rows(path)


class CuttingPRM(ScriptedPRM):
    """Like ScriptedPRM, but a step named in `cut` and every step after it come back NaN, as the
    scorer returns steps past its max_length."""

    def __init__(self, table: dict[str, float], cut: set[str]):
        super().__init__(table)
        self.cut = cut

    def score(self, examples):
        out = []
        for probs, ex in zip(super().score(examples), examples):
            first = next((i for i, s in enumerate(ex["steps"]) if s in self.cut), len(probs))
            out.append(probs[:first] + [float("nan")] * (len(probs) - first))
        return out


@pytest.mark.parametrize("method", ["beam", "dvts", "best_first"])
def test_a_path_cut_by_the_prm_is_never_kept_chosen_or_expanded(method):
    # B would win on its scored prefix (A .9 < B's first step .95), but its second step is past max_length.
    script = {(): [("A", None), ("B", None)], ("A",): [("", "5")], ("B",): [("B1", None)], ("B", "B1"): [("", "6")]}
    policy = ScriptedPolicy(script)
    prm = CuttingPRM({"A": 0.9, "B": 0.95, ans("A", "5"): 0.8}, cut={"B1", ans("B1", "6")})
    cfg = SearchConfig(method, width=2, expansions=1 if method == "dvts" else 2, max_steps=4)
    [tree] = run_search([PROBLEM], policy, prm, cfg)
    cut = [n for n in tree.nodes if n.status == "cut"]
    assert [n.step for n in cut] == ["B1"] and cut[0].score is None and cut[0].probs == [0.95]
    assert not cut[0].kept and (("B", "B1"),) not in {c for call in policy.calls for c, _ in call}
    assert tree.stats["cut_nodes"] == 1
    chosen = tree.nodes[tree.chosen]
    assert chosen.answer == "5" and chosen.status == "finished"
    assert tree.to_treeval().meta["cut_nodes"] == 1


def test_bon_sizes_off_the_powers_of_two_are_computed_exactly():
    from mmprm.search.report import search_report

    # min ranks the wrong .9 first: any subset holding it is wrong. N=4 always holds it; of the four
    # subsets of 3 (all enumerated), one does not: N=3 is right 1/4 of the time, not N=4's 0.
    cands = [{"step_probs": [0.9], "answer": "9", "correct": False, "tokens": 4}] + [
        {"step_probs": [p], "answer": "5", "correct": True, "tokens": 4} for p in (0.5, 0.4, 0.3)
    ]
    search = [{"id": "p1", "correct": True, "stats": {"generated_tokens": 12, "prm_sequences": 3, "seconds": 1.0}}]
    r = search_report({"beam": search}, [{"id": "p1", "candidates": cands}], bon_ns=(3, 4), n_resamples=50)
    assert r["methods"]["Best-of-N (PRM min) N=3"]["mean"] == pytest.approx(0.25)
    assert r["methods"]["Best-of-N (PRM min) N=4"]["mean"] == 0.0
    assert r["methods"]["Best-of-N (PRM min) N=3"]["tokens_per_problem"] == 12.0


def test_report_counts_cut_search_nodes_and_truncated_bon_candidates(tmp_path):
    from mmprm.search.report import search_report, write_search_report

    search = [
        {
            "id": "p1",
            "correct": True,
            "stats": {"generated_tokens": 8, "prm_sequences": 3, "seconds": 1.0, "cut_nodes": 2},
        }
    ]
    bon = [
        {
            "id": "p1",
            "candidates": [  # the truncated one's partial .99 must not win
                {"step_probs": [0.99], "truncated": True, "answer": "9", "correct": False, "tokens": 9},
                {"step_probs": [0.6, 0.7], "answer": "5", "correct": True, "tokens": 5},
            ],
        }
    ]
    r = search_report({"beam": search}, bon, bon_ns=(2,), n_resamples=50)
    assert r["methods"]["beam"]["cut_nodes"] == 2 and r["settings"]["bon_truncated_candidates"] == 1
    assert r["methods"]["Best-of-N (PRM min) N=2"]["mean"] == 1.0
    md = write_search_report(r, tmp_path, "t").read_text()
    assert "beam: 2 search nodes" in md and "Best-of-N: 1 candidates" in md
