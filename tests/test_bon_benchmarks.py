"""Best-of-N over answer benchmarks: the 7B benchmark config, run on tiny models and the shipped
benchmark rows, writes each benchmark's report (with its own breakdown) and one table over them.

Every number checked here is recomputed from the scored files: verdicts by the benchmark's own
answer rule, the breakdown and the table from the per-problem candidates.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from recipe_runs import REPO, load_recipe

from mmprm.data.eval_sets import answer_correct
from mmprm.data.schema import read_jsonl
from mmprm.rerank.candidates import load_candidates
from mmprm.rerank.shards import benchmark_table, cli_bon_table

FIX = REPO / "tests" / "fixtures" / "eval_sets"
CONFIG = REPO / "recipes" / "configs" / "qwen2_5_vl_7b" / "benchmarks" / "bon_rerank.yaml"
SOURCES = {
    "mathvista": [f"generate.benchmark.source={FIX / 'mathvista'}"],
    "mathverse": [
        f"generate.benchmark.source={FIX / 'mathverse' / 'output_templates' / 'output_testmini.json'}",
        f"generate.benchmark.image_root={FIX / 'mathverse'}",
    ],
}


@pytest.fixture(scope="module")
def runs(tiny_models, tmp_path_factory) -> dict[str, Path]:
    """Best-of-2 on four problems of each benchmark: a tiny Qwen2-VL policy, a tiny PRM."""
    import torch

    from mmprm.models.loading import load_backbone
    from mmprm.models.prm import PRMSpec, build_prm, save_prm

    root = tmp_path_factory.mktemp("bon_benchmarks")
    backbone, processor = load_backbone(tiny_models("qwen2_vl"))
    prm = save_prm(build_prm(backbone, processor, PRMSpec()), processor, root / "prm")
    mod, out = load_recipe("bon_rerank"), {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, source in SOURCES.items():
            out[name] = root / name
            mod.main(
                [
                    "--config",
                    str(CONFIG),
                    f"prm.path={prm}",
                    f"policy.path={tiny_models('qwen2_vl')}",
                    "policy.backend=hf",
                    f"generate.benchmark.name={name}",
                    *source,
                    "generate.benchmark.limit=4",
                    "generate.n=2",
                    "policy.sampling.max_new_tokens=12",
                    "prm.max_length=null",
                    "prm.device=cpu",
                    "model.attn_implementation=sdpa",
                    "report.resamples=50",
                    f"output_dir={out[name]}",
                ]
            )
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.mark.slow
def test_each_benchmark_run_judges_by_its_own_rule_and_breaks_down_by_its_columns(runs):
    for name, out in runs.items():
        problems = {p["id"]: p for p in read_jsonl(out / "problems.jsonl")}
        assert len(problems) == 4 and all(p["meta"]["source"] == name for p in problems.values())
        written = load_candidates(out / "candidates.jsonl")
        for p in written:
            for c in p.candidates:
                assert c.correct == answer_correct(c.answer, problems[p.id])
        report = json.loads((out / "report.json").read_text())
        assert report["num_problems"] == 4 and report["n_max"] == 2
        # The breakdown, by hand: oracle at N=2 solves a problem when either candidate is correct.
        solved = {p.id: float(any(c.correct for c in p.candidates)) for p in written}
        breakdown = report["by_category"]
        assert set(breakdown) == set(problems[written[0].id]["meta"]["breakdown"])
        for col, values in breakdown.items():
            for value, row in values.items():
                ids = [
                    i
                    for i, p in problems.items()
                    if value in map(str, v if isinstance(v := p["meta"][col], list) else [v])
                ]
                assert row["problems"] == len(ids)
                assert row["oracle"] == pytest.approx(sum(solved[i] for i in ids) / len(ids))
        assert f"## By {next(iter(breakdown))} (N=2)" in (out / "report.md").read_text()


@pytest.mark.slow
def test_bon_table_gathers_the_benchmark_reports(runs, capsys):
    assert cli_bon_table([str(runs["mathvista"]), str(runs["mathverse"])]) == 0
    root = runs["mathvista"].parent
    table = json.loads((root / "table.json").read_text())
    reports = {name: json.loads((out / "report.json").read_text()) for name, out in runs.items()}
    assert table == json.loads(json.dumps(benchmark_table(reports)))
    assert table["n"] == 2 and list(table["benchmarks"]) == ["mathvista", "mathverse"]
    for name, row in table["benchmarks"].items():
        for method in ("random", "majority", "oracle", "min", "weighted_vote"):
            assert row[method] == reports[name]["methods"][method]["2"]
    mean = (
        reports["mathvista"]["methods"]["oracle"]["2"]["mean"] + reports["mathverse"]["methods"]["oracle"]["2"]["mean"]
    ) / 2
    assert table["mean_over_benchmarks"]["oracle"] == pytest.approx(mean)
    text = (root / "table.md").read_text()
    assert "| [mathvista](mathvista/report.md) | 4 |" in text and "mean over benchmarks" in text


def test_bon_table_refuses_runs_without_a_report(tmp_path, capsys):
    (tmp_path / "mathvista").mkdir()
    assert cli_bon_table([str(tmp_path / "mathvista")]) == 2
    assert "no report.json in" in capsys.readouterr().err


def test_bon_table_defaults_to_the_largest_n_every_report_has(tmp_path, capsys):
    """Reports with N up to 8 (1, 2, 4, 8) and up to 6 (1, 2, 4, 6) share N=4, not min(n_max)=6."""
    from mmprm.rerank.shards import report_from_scored

    for name, n in (("mathvista", 8), ("mathverse", 6)):
        rows = [
            {
                "id": f"{name}-{i}",
                "candidates": [
                    {"step_probs": [0.1 * ((i + j) % 10)], "answer": str(j % 3), "correct": j % 3 == 0}
                    for j in range(n)
                ],
            }
            for i in range(3)
        ]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        report_from_scored(tmp_path / f"{name}.jsonl", tmp_path / name, resamples=20)
    assert cli_bon_table([str(tmp_path / "mathvista"), str(tmp_path / "mathverse")]) == 0, capsys.readouterr().err
    table = json.loads((tmp_path / "table.json").read_text())
    assert table["n"] == 4
    assert cli_bon_table([str(tmp_path / "mathvista"), str(tmp_path / "mathverse"), "--n", "6"]) == 2
    assert "mathvista: its report has no N=6" in capsys.readouterr().err
