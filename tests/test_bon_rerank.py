"""recipes/bon_rerank.py end to end: MATH-V candidates, generation with a tiny VLM, shards + merge.

Every baseline number in report.json is recomputed here by hand from the files' own answers and
correctness flags (MATH-V's `correct` for the real candidates), never from mmprm's selection code.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image
from recipe_runs import REPO, recipe_env, run_recipe

from mmprm.answers import answers_match
from mmprm.config import ConfigError
from mmprm.config_sections import PolicyConfig
from mmprm.data.schema import DataError, read_jsonl
from mmprm.rerank.candidates import Candidate, ProblemWithCandidates, load_candidates, load_problems_for_generation
from mmprm.rerank.shards import cli_merge_bon, merge_scored, shard_path, take_shard

RECIPE = REPO / "recipes" / "bon_rerank.py"
CONFIG = REPO / "recipes" / "configs" / "tiny" / "bon_rerank.yaml"
ENV = recipe_env()
N_PROBLEMS = 20


def recipe():
    spec = importlib.util.spec_from_file_location("bon_rerank_recipe", RECIPE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def one_thread():
    """In-process runs use one thread, like the subprocess runs (same numerics, no oversubscription)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def prm_dir(tiny_models, tmp_path_factory) -> Path:
    """A random-init multimodal PRM (tiny Qwen2-VL, token_pair head) saved as prm_train saves one."""
    from mmprm.models.loading import load_backbone
    from mmprm.models.prm import PRMSpec, build_prm, save_prm

    backbone, processor = load_backbone(tiny_models("qwen2_vl"))
    return save_prm(build_prm(backbone, processor, PRMSpec()), processor, tmp_path_factory.mktemp("prm") / "prm")


@pytest.fixture(scope="module")
def mathv_file(real_data, tmp_path_factory) -> Path:
    """The first 20 MATH-V testmini problems, 3 models' CoTs each, labelled by MATH-V's own flags."""
    from mmprm.rerank.candidates import from_mathv, write_candidates

    path = tmp_path_factory.mktemp("mathv") / "mathv_bon.jsonl"
    write_candidates(path, from_mathv(real_data / "mathv", limit=N_PROBLEMS))
    return path


@pytest.fixture(scope="module")
def unsharded(prm_dir, mathv_file, tmp_path_factory) -> Path:
    """One run of the real entry point (a subprocess) over the MATH-V slice."""
    out = tmp_path_factory.mktemp("bon") / "unsharded"
    run_recipe(
        "bon_rerank",
        "--config",
        str(CONFIG),
        f"prm.path={prm_dir}",
        f"candidates_file={mathv_file}",
        f"output_dir={out}",
        "report.resamples=200",
    )
    return out


# ---------------------------------------------------------------- hand computations


def hand_majority(answers: list[str | None], correct: list[bool]) -> float:
    """Majority vote, written out: None abstains; an answer joins the first earlier group whose
    first answer it matches (answers_match); a tie averages the tied groups' share correct."""
    groups: list[tuple[str, list[bool]]] = []
    for a, c in zip(answers, correct):
        if a is None:
            continue
        for rep, members in groups:
            if answers_match(a, rep):
                members.append(c)
                break
        else:
            groups.append((a, [c]))
    if not groups:
        return 0.0
    top = max(len(m) for _, m in groups)
    tied = [m for _, m in groups if len(m) == top]
    return sum(sum(m) / len(m) for m in tied) / len(tied)


def mathv_flags(real_data: Path, ids: list[str]) -> dict[str, list[bool]]:
    """MATH-V's `correct` per problem, one per CoT file in sorted file order (from_mathv's order)."""
    flags: dict[str, list[bool]] = {i: [] for i in ids}
    for path in sorted((real_data / "mathv" / "cot_testmini").glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            r = json.loads(line)
            key = f"mathv-{r['id']}"
            if key in flags:
                flags[key].append(bool(r["correct"]))
    return flags


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


# ---------------------------------------------------------------- (a) candidates path, real data


def test_mathv_candidates_report_matches_hand_count(unsharded, mathv_file, real_data):
    report = json.loads((unsharded / "report.json").read_text())
    assert report["num_problems"] == N_PROBLEMS and report["n_max"] == 3
    assert report["settings"]["ns"] == [1, 2, 3]
    methods = {
        "min",
        "average",
        "max",
        "last",
        "product",
        "sum_logpr",
        "sum_logodds",
        "mean_odds",
        "random",
        "majority",
        "weighted_vote",
        "oracle",
    }
    assert set(report["methods"]) == methods
    for by_n in report["methods"].values():
        assert set(by_n) == {"1", "2", "3"}
        for cell in by_n.values():
            lo, hi = cell["ci95"]
            assert 0.0 <= lo <= cell["mean"] <= hi <= 1.0
    assert (unsharded / "report.md").read_text().startswith("# Best-of-N")
    assert (unsharded / "bon_curve.png").read_bytes()[:4] == b"\x89PNG"

    problems = load_candidates(mathv_file)
    rows = read_jsonl(unsharded / "scored.jsonl")
    assert [r["id"] for r in rows] == [p.id for p in problems]
    flags = mathv_flags(real_data, [p.id for p in problems])
    for p, row in zip(problems, rows):
        assert [c["correct"] for c in row["candidates"]] == flags[p.id]  # MATH-V's verdicts, untouched
        assert [c["answer"] for c in row["candidates"]] == [c.answer for c in p.candidates]
        for c, s in zip(p.candidates, row["candidates"]):
            assert len(s["step_probs"]) == len(c.steps) > 0  # one probability per scored step
            assert all(0.0 < q < 1.0 for q in s["step_probs"])

    def got(method: str, n: int) -> float:
        return report["methods"][method][str(n)]["mean"]

    corr = [flags[r["id"]] for r in rows]
    answers = [[c["answer"] for c in r["candidates"]] for r in rows]
    subsets = {n: list(itertools.combinations(range(3), n)) for n in (1, 2, 3)}  # C(3, n) <= 32: all of them
    for n, combos in subsets.items():
        assert got("random", n) == pytest.approx(mean(mean(c) for c in corr), abs=1e-12)
        assert got("oracle", n) == pytest.approx(
            mean(mean(any(c[i] for i in s) for s in combos) for c in corr), abs=1e-12
        )
        assert got("majority", n) == pytest.approx(
            mean(
                mean(hand_majority([a[i] for i in s], [c[i] for i in s]) for s in combos) for a, c in zip(answers, corr)
            ),
            abs=1e-12,
        )
    assert got("oracle", 3) == sum(any(c) for c in corr) / N_PROBLEMS
    # A PRM picks by its own scores: the highest min step probability, ties to the lowest index.
    picks = [max(range(3), key=lambda j: (min(r["candidates"][j]["step_probs"]), -j)) for r in rows]
    assert got("min", 3) == pytest.approx(mean(c[j] for c, j in zip(corr, picks)), abs=1e-12)
    assert got("min", 1) == pytest.approx(got("random", 1), abs=1e-12)  # one candidate: nothing to pick


# ---------------------------------------------------------------- (c) shards + merge


def test_two_shards_merge_to_the_unsharded_output_and_refuse_a_missing_shard(
    unsharded, prm_dir, mathv_file, tmp_path, capsys, one_thread
):
    mod = recipe()
    out = tmp_path / "sharded"
    args = [
        "--config",
        str(CONFIG),
        f"prm.path={prm_dir}",
        f"candidates_file={mathv_file}",
        f"output_dir={out}",
        "report.resamples=200",
        "shard.count=2",
    ]
    mod.main([*args, "shard.index=1"])
    assert not (out / "report.json").exists()  # a shard alone never reports
    assert cli_merge_bon([str(out)]) == 2
    assert "shard(s) [0] of 2 missing" in capsys.readouterr().err
    assert not (out / "scored.jsonl").exists() and not (out / "report.json").exists()

    mod.main([*args, "shard.index=0"])
    assert cli_merge_bon([str(out)]) == 0
    merged, single = read_jsonl(out / "scored.jsonl"), read_jsonl(unsharded / "scored.jsonl")
    assert [r["id"] for r in merged] == [r["id"] for r in single]
    for a, b in zip(merged, single):
        for ca, cb in zip(a["candidates"], b["candidates"], strict=True):
            assert (ca["answer"], ca["correct"]) == (cb["answer"], cb["correct"])
            assert ca["step_probs"] == pytest.approx(cb["step_probs"], abs=1e-6)
    # merge-bon read the run's report settings (resamples=200), so the two reports agree.
    rep_m, rep_s = (json.loads((d / "report.json").read_text()) for d in (out, unsharded))
    assert rep_m["settings"] == rep_s["settings"]
    for method, by_n in rep_s["methods"].items():
        for n, cell in by_n.items():
            assert rep_m["methods"][method][n]["mean"] == pytest.approx(cell["mean"], abs=1e-9)


def test_more_shards_than_problems_merge_with_empty_shards(unsharded, prm_dir, mathv_file, tmp_path, one_thread):
    """2 problems over 3 shards: shard 0's block is empty. It writes its (empty) file without
    loading the PRM (given one that does not exist here), and merge-bon reports the 2 problems."""
    two = tmp_path / "two.jsonl"
    two.write_text("".join(mathv_file.read_text().splitlines(keepends=True)[:2]))
    mod, out = recipe(), tmp_path / "sharded"
    args = ["--config", str(CONFIG), f"candidates_file={two}", f"output_dir={out}", "report.resamples=50"]
    mod.main([*args, f"prm.path={tmp_path / 'no_prm'}", "shard.count=3", "shard.index=0"])
    assert shard_path(out, 0, 3).read_text() == ""
    for i in (1, 2):
        mod.main([*args, f"prm.path={prm_dir}", "shard.count=3", f"shard.index={i}"])
    assert cli_merge_bon([str(out)]) == 0
    single = {r["id"]: r for r in read_jsonl(unsharded / "scored.jsonl")}
    merged = read_jsonl(out / "scored.jsonl")
    assert [r["id"] for r in merged] == list(single)[:2]
    assert json.loads((out / "report.json").read_text())["num_problems"] == 2


def test_merge_bon_refuses_a_shard_scored_by_another_prm(prm_dir, mathv_file, tmp_path, capsys, one_thread):
    """Two shards scored into one folder by two PRMs are two runs: merge-bon names the setting."""
    other = shutil.copytree(prm_dir, tmp_path / "other_prm")  # the same weights, but another PRM to the run
    mod, out = recipe(), tmp_path / "mixed"
    args = ["--config", str(CONFIG), f"candidates_file={mathv_file}", f"output_dir={out}", "shard.count=2"]
    mod.main([*args, f"prm.path={prm_dir}", "shard.index=0", "report.resamples=50"])
    mod.main([*args, f"prm.path={other}", "shard.index=1", "report.resamples=50"])
    capsys.readouterr()
    assert cli_merge_bon([str(out)]) == 2
    err = capsys.readouterr().err
    assert "not one run" in err and "scored.shard1-of-2.jsonl was made with other settings {'prm'" in err
    assert str(other) in err and not (out / "scored.jsonl").exists() and not (out / "report.json").exists()


def test_merge_bon_takes_shards_that_sampled_their_own_candidates_alike(tiny_models, prm_dir, tmp_path, one_thread):
    """Each generating shard has its own candidates file (not a difference between runs); a shard
    whose candidates were sampled otherwise, copied in from another run, is refused by name."""
    from mmprm.data.synthetic import SyntheticConfig, generate, write_split

    write_split(generate(SyntheticConfig(num_problems=2, seed=0, id_prefix="bon")), tmp_path / "data", "test")

    def run(out, index, *extra):
        recipe().main(
            [
                "--config",
                str(CONFIG),
                f"prm.path={prm_dir}",
                "generate.enabled=true",
                f"policy.path={tiny_models('qwen2_vl')}",
                f"generate.problems_file={tmp_path / 'data' / 'test_problems.jsonl'}",
                "generate.n=2",
                "policy.sampling.max_new_tokens=8",
                "report.resamples=50",
                f"output_dir={out}",
                "shard.count=2",
                f"shard.index={index}",
                *extra,
            ]
        )

    out, other = tmp_path / "gen", tmp_path / "other"
    run(out, 0)
    run(out, 1)
    assert cli_merge_bon([str(out)]) == 0
    assert [r["id"] for r in read_jsonl(out / "scored.jsonl")] == ["bon-00000", "bon-00001"]
    run(other, 1, "policy.sampling.seed=7")
    for name in ("candidates.shard1-of-2.jsonl", "candidates.shard1-of-2.jsonl.run.json"):
        shutil.copy(other / name, out / name)
    with pytest.raises(ValueError, match=r"candidates.shard1-of-2.jsonl was made with other settings {'sampling'"):
        merge_scored(out)


def test_take_shard_blocks_cover_everything_once():
    items = list(range(7))
    shards = [take_shard(items, i, 3) for i in range(3)]
    assert shards == [[0, 1], [2, 3], [4, 5, 6]]
    assert take_shard(items[:2], 2, 3) == [1] and take_shard(items[:2], 0, 3) == []
    with pytest.raises(ValueError, match="not in"):
        take_shard(items, 3, 3)


def test_merge_refuses_mixed_runs_and_duplicate_ids(tmp_path, capsys):
    row = {"id": "a", "candidates": [{"step_probs": [0.5], "answer": "1", "correct": True}]}
    assert cli_merge_bon([str(tmp_path)]) == 2
    assert "no scored.shard" in capsys.readouterr().err
    for i in (0, 1):
        shard_path(tmp_path, i, 2).write_text(json.dumps(row) + "\n")
    (tmp_path / "scored.jsonl").write_text("an earlier merge\n")
    with pytest.raises(ValueError, match="id=a appears in more than one shard"):
        merge_scored(tmp_path)
    # a failed merge leaves the earlier one as it was, and no temp file beside it
    assert (tmp_path / "scored.jsonl").read_text() == "an earlier merge\n"
    assert sorted(p.name for p in tmp_path.iterdir() if "tmp" in p.name) == []
    shard_path(tmp_path, 0, 3).write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=r"different shard counts \[2, 3\]"):
        merge_scored(tmp_path)
    # The recipe's own merge (count given) looks only at its run's files.
    (tmp_path / "scored.shard1-of-2.jsonl").unlink()
    shard_path(tmp_path, 0, 1).write_text(json.dumps(row) + "\n")
    assert read_jsonl(merge_scored(tmp_path, count=1)) == [row]


# ---------------------------------------------------------------- (b) generate path


def test_generate_with_tiny_vlm_policy_writes_candidates_and_report(tiny_models, prm_dir, tmp_path, one_thread):
    from mmprm.data.synthetic import SyntheticConfig, generate, write_split

    write_split(generate(SyntheticConfig(num_problems=3, seed=0, id_prefix="bon")), tmp_path / "data", "test")
    problems_file = tmp_path / "data" / "test_problems.jsonl"
    out = tmp_path / "gen"
    recipe().main(
        [
            "--config",
            str(CONFIG),
            f"prm.path={prm_dir}",
            "generate.enabled=true",
            f"policy.path={tiny_models('qwen2_vl')}",
            f"generate.problems_file={problems_file}",
            "generate.n=4",
            "policy.sampling.max_new_tokens=16",
            "report.resamples=100",
            f"output_dir={out}",
        ]
    )
    gold = {p.id: p for p in load_problems_for_generation(problems_file)}
    written = load_candidates(out / "candidates.jsonl")
    assert [p.id for p in written] == list(gold)
    scored = read_jsonl(out / "scored.jsonl")
    for p, row in zip(written, scored):
        assert p.images == gold[p.id].images and p.answer == gold[p.id].answer
        assert len(p.candidates) == len(row["candidates"]) == 4
        for c, s in zip(p.candidates, row["candidates"]):
            assert isinstance(c.text, str)
            assert c.correct == (c.answer is not None and answers_match(c.answer, p.answer))
            # An unparsed generation is judged on its whole text as one step.
            n_scored = len(c.steps) if c.steps else int(bool(c.text.strip()))
            assert len(s["step_probs"]) == n_scored
    report = json.loads((out / "report.json").read_text())
    assert report["num_problems"] == 3 and report["n_max"] == 4 and report["settings"]["ns"] == [1, 2, 4]


@pytest.mark.slow
def test_tiny_yaml_header_commands_then_the_launch_line(tmp_path):
    """The YAML's header, run as a user would from the repo root: tiny PRM trained by prm_train,
    toy policy, generated candidates, then the YAML's first line."""
    (tmp_path / "recipes").symlink_to(REPO / "recipes")  # the commands name recipes/ relative to the root
    header = []
    for line in CONFIG.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line.lstrip("#").strip())
    launch = header[0]
    start = next(i for i, t in enumerate(header) if "Make the inputs first" in t)
    commands, current = [], ""
    for text in header[start + 1 :]:
        if not current and not text.startswith(("mmprm ", "python ")):
            break
        current += text.rstrip("\\").strip() + " "
        if not text.endswith("\\"):
            commands.append(current.split())
            current = ""
    assert len(commands) == 5
    for cmd in [*commands, launch.split()]:
        argv = [sys.executable, *cmd[1:]] if cmd[0] == "python" else cmd
        res = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=ENV)
        assert res.returncode == 0, f"{' '.join(cmd)}:\n{res.stdout[-2000:]}{res.stderr[-3000:]}"
    cands = load_candidates(tmp_path / "runs" / "tiny" / "bon_candidates" / "candidates.jsonl")
    assert len(cands) == 8 and all(len(p.candidates) == 4 for p in cands)
    # The toy policy writes our format: parsed steps carry the answer, verdicts follow the answer.
    for c in (c for p in cands for c in p.candidates):
        assert c.correct == (c.answer is not None and answers_match(c.answer, "5"))
        if c.answer is not None and c.steps:
            assert c.steps[-1].endswith(f"<answer>{c.answer}</answer>")
    report = json.loads((tmp_path / "runs" / "tiny" / "bon" / "report.json").read_text())
    assert report["num_problems"] == 8 and report["n_max"] == 4


# ---------------------------------------------------------------- inputs and config


def test_load_problems_names_file_line_id_and_field(tmp_path):
    Image.new("RGB", (2, 2)).save(tmp_path / "a.png")  # the loader opens every image
    rows = [
        {"id": "p1", "images": ["a.png"], "question": "<image1> How many?", "answer": 3, "choices": None},
        {"id": "p2", "images": ["missing.png"], "question": "Q?", "answer": "1"},
        {"id": "p3", "images": [], "question": "Q?"},
        {"id": "p1", "images": [], "question": "Q?", "answer": "2"},
        {"id": "p5", "images": [], "question": "<image1> Q?", "answer": "2", "choices": "A"},
    ]
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{not json\n")
    with pytest.raises(DataError) as e:
        load_problems_for_generation(path)
    lines = e.value.problems
    assert any(line.startswith(f"{path}:2: id=p2: images[0]: image not found") for line in lines)
    assert f"{path}:3: id=p3: answer: missing (the gold answer is needed to verify generated solutions)" in lines
    assert any(line.startswith(f"{path}:4: id=p1: id: duplicated (first on line 1") for line in lines)
    assert any(line.startswith(f"{path}:5: id=p5: images: question has 1 image placeholder(s) but 0") for line in lines)
    assert any(line.startswith(f"{path}:5: id=p5: choices:") for line in lines)
    assert any(line.startswith(f"{path}:6: id=?: line: invalid JSON") for line in lines)
    path.write_text(json.dumps(rows[0]) + "\n")
    (p,) = load_problems_for_generation(path)
    assert p.id == "p1" and p.answer == "3" and p.images == [str((tmp_path / "a.png").resolve())]
    assert p.candidates == []


def test_unparsed_candidate_is_scored_on_its_whole_text():
    p = ProblemWithCandidates(
        id="x",
        question="Q?",
        answer="1",
        candidates=[
            Candidate(text="<step>a</step>", steps=["a"]),
            Candidate(text="  just some words  ", steps=[]),
            Candidate(text="", steps=[]),
            Candidate(text=None, steps=[]),
        ],
    )
    assert [x["steps"] for x in p.prm_inputs()] == [["a"], ["just some words"], [], []]


def test_unknown_correctness_is_refused_before_scoring(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(
        json.dumps(
            {"id": "q1", "question": "Q?", "answer": None, "candidates": [{"text": "<step>x</step><answer>2</answer>"}]}
        )
        + "\n"
    )
    with pytest.raises(DataError) as e:  # prm does not exist: the check comes first
        recipe().main([f"prm.path={tmp_path / 'no_prm'}", f"candidates_file={path}", f"output_dir={tmp_path / 'o'}"])
    assert e.value.problems == [
        f"{path}: id=q1: candidates[0].correct: unknown (give the problem's gold `answer` "
        "or each candidate's `correct`)"
    ]


def test_tiny_yaml_parses_and_opens_with_its_launch_command():
    mod = recipe()
    first = CONFIG.read_text().splitlines()[0]
    assert first == "# python recipes/bon_rerank.py --config recipes/configs/tiny/bon_rerank.yaml"
    cfg = mod.load_config(mod.BonRerankConfig, CONFIG)
    assert cfg.prm.path == "runs/tiny/prm" and cfg.candidates_file.startswith("runs/tiny/")
    assert cfg.generate.n == 4 and cfg.shard.count == 1
    assert mod.BonRerankConfig().policy.sampling.max_new_tokens == 4096 and cfg.policy.sampling.max_new_tokens == 128
    # the prompt format comes from the policy (mmprm_policy.json) unless the config says otherwise
    assert cfg.policy.step_mode is None and cfg.policy.system_prompt is None
    res = subprocess.run(
        [sys.executable, str(RECIPE), "--config", str(CONFIG), "shard.index=2", "shard.count=2"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=ENV,
        timeout=120,
    )
    assert res.returncode == 2 and "shard.index=2 must be in [0, shard.count=2)" in res.stderr


def test_candidates_cut_by_scoring_max_length_are_ranked_last_and_counted(prm_dir, tmp_path, one_thread):
    from mmprm.rerank.candidates import write_candidates

    long_steps = [f"Step {k}: add {k} to the running total and keep going." for k in range(30)]
    problems = [
        ProblemWithCandidates(
            id=f"q{i}",
            question="What is 2 + 3?",
            answer="5",
            candidates=[
                Candidate(text=None, steps=[*long_steps, "So 9.\n<answer>9</answer>"], answer="9", correct=False),
                Candidate(text=None, steps=["2 + 3 = 5.", "So 5.\n<answer>5</answer>"], answer="5", correct=True),
            ],
        )
        for i in range(3)
    ]
    cands = tmp_path / "c.jsonl"
    write_candidates(cands, problems)
    out = tmp_path / "out"
    recipe().main(
        [
            "--config",
            str(CONFIG),
            f"prm.path={prm_dir}",
            f"candidates_file={cands}",
            f"output_dir={out}",
            "prm.max_length=160",
            "report.resamples=20",
        ]
    )
    rows = read_jsonl(out / "scored.jsonl")
    assert [[c.get("truncated", False) for c in r["candidates"]] for r in rows] == [[True, False]] * 3
    assert all(0 < len(r["candidates"][0]["step_probs"]) < 31 for r in rows)  # the scored prefix is kept
    report = json.loads((out / "report.json").read_text())
    assert report["truncated_candidates"] == 3
    for m in ("min", "average", "max", "last", "product", "sum_logpr", "sum_logodds", "mean_odds"):
        assert report["methods"][m]["2"]["mean"] == 1.0, m  # the complete, correct candidate wins every time
    assert "3 of 6 candidates were truncated" in (out / "report.md").read_text()


def test_mm_prm_edge_rules_carry_through_shards_and_merge_bon(prm_dir, tmp_path, capsys, one_thread):
    """report.edge_rules=mm_prm on both shards: merge-bon reports under MM-PRM's rules. Each problem
    has an empty candidate (right) and a scored one (wrong, every step p < 1): sum_logpr scores the
    empty one 0 under MM-PRM's rules, above any log p < 0, and -inf under mmprm's; min scores both
    empty ones 0, below the scored p > 0. A shard reported under other rules is refused by name."""
    from mmprm.rerank.candidates import write_candidates

    problems = [
        ProblemWithCandidates(
            id=f"q{i}",
            question="What is 2 + 3?",
            answer="5",
            candidates=[
                Candidate(text=None, steps=[], answer=None, correct=True),
                Candidate(text=None, steps=["2 + 3 = 6.", "So 6.\n<answer>6</answer>"], answer="6", correct=False),
            ],
        )
        for i in range(2)
    ]
    cands = tmp_path / "c.jsonl"
    write_candidates(cands, problems)
    mod = recipe()

    def run(out, index, *extra):
        args = ["--config", str(CONFIG), f"prm.path={prm_dir}", f"candidates_file={cands}", f"output_dir={out}"]
        mod.main([*args, "report.resamples=20", "shard.count=2", f"shard.index={index}", *extra])

    out = tmp_path / "mm_prm"
    run(out, 0, "report.edge_rules=mm_prm")
    run(out, 1, "report.edge_rules=mm_prm")
    assert json.loads((out / "report_settings.json").read_text())["edge_rules"] == "mm_prm"
    assert cli_merge_bon([str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["edge_rules"] == "mm_prm"
    assert report["methods"]["sum_logpr"]["2"]["mean"] == 1.0 and report["methods"]["min"]["2"]["mean"] == 0.0
    assert "Edge rules of every aggregator: `mm_prm`" in (out / "report.md").read_text()
    # the same scores reported under mmprm's rules, by merge-bon's flag: the empty candidate loses
    assert cli_merge_bon([str(out), "--edge-rules", "mmprm"]) == 0
    assert json.loads((out / "report.json").read_text())["methods"]["sum_logpr"]["2"]["mean"] == 0.0

    mixed = tmp_path / "mixed"
    run(mixed, 1)
    for name in ("scored.shard0-of-2.jsonl", "scored.shard0-of-2.jsonl.run.json"):  # shard 0 as scored above
        shutil.copy(out / name, mixed / name)
    capsys.readouterr()
    assert cli_merge_bon([str(mixed)]) == 2
    assert "shard1-of-2.jsonl was made with other settings {'edge_rules': (None, 'mm_prm')}" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="edge_rules"):  # a rerun of the shard under other rules
        run(out, 1)


def test_killed_scoring_resumes_after_the_last_written_chunk(unsharded, prm_dir, mathv_file, tmp_path, one_thread):
    """A shard is scored chunk by chunk into `<shard>.partial`; killed after two chunks (plus a torn
    row), the same command scores only the rest and ends with the unsharded run's file. A finished
    shard is not scored again; other settings on the same output_dir are refused."""
    mod = recipe()
    out = tmp_path / "resumed"
    args = [
        "--config",
        str(CONFIG),
        f"prm.path={prm_dir}",
        f"candidates_file={mathv_file}",
        f"output_dir={out}",
        "report.resamples=200",
        "scoring.chunk_problems=4",
    ]
    real, scored = mod.score_chunk, []

    def dies_on_the_third_chunk(scorer, problems, *rest):
        if len(scored) == 8:
            raise KeyboardInterrupt  # what kill leaves: two chunks on disk, nothing of the third
        scored.extend(p.id for p in problems)
        return real(scorer, problems, *rest)

    mod.score_chunk = dies_on_the_third_chunk
    with pytest.raises(KeyboardInterrupt):
        mod.main(args)
    partial = out / "scored.shard0-of-1.jsonl.partial"
    assert [r["id"] for r in read_jsonl(partial)] == scored and not (out / "scored.shard0-of-1.jsonl").exists()
    with open(partial, "a") as f:
        f.write('{"id": "torn", "candi')

    mod = recipe()
    real, rescored = mod.score_chunk, []
    mod.score_chunk = lambda scorer, problems, *rest: (
        rescored.extend(p.id for p in problems) or real(scorer, problems, *rest)
    )
    mod.main(args)
    single = read_jsonl(unsharded / "scored.jsonl")
    assert rescored == [r["id"] for r in single][8:]
    merged = read_jsonl(out / "scored.jsonl")
    assert [r["id"] for r in merged] == [r["id"] for r in single] and not partial.exists()
    for a, b in zip(merged, single):
        for ca, cb in zip(a["candidates"], b["candidates"], strict=True):
            assert ca["step_probs"] == pytest.approx(cb["step_probs"], abs=1e-6)

    rescored.clear()
    mod.main(args)  # finished: only the report is written again
    assert rescored == []
    with pytest.raises(ConfigError, match=r"scored.shard0-of-1.jsonl was made with other settings .*max_length"):
        mod.main([*args, "prm.max_length=64"])


def test_generation_shard_without_problems_starts_no_engine(tiny_models, prm_dir, tmp_path, one_thread, monkeypatch):
    """1 problem over 2 shards: shard 0 samples nothing (no backend is made) and writes empty
    candidates and scored files, which merge-bon takes beside shard 1's."""
    from mmprm.data.synthetic import SyntheticConfig, generate, write_split

    write_split(generate(SyntheticConfig(num_problems=1, seed=0, id_prefix="bon")), tmp_path / "data", "test")
    out = tmp_path / "gen"
    args = [
        "--config",
        str(CONFIG),
        f"prm.path={prm_dir}",
        "generate.enabled=true",
        f"policy.path={tiny_models('qwen2_vl')}",
        f"generate.problems_file={tmp_path / 'data' / 'test_problems.jsonl'}",
        "generate.n=2",
        "policy.sampling.max_new_tokens=8",
        "report.resamples=50",
        f"output_dir={out}",
        "shard.count=2",
    ]
    mod = recipe()

    def no_backend(policy, *args, **kwargs):
        raise AssertionError("an empty shard made a backend")

    monkeypatch.setattr(PolicyConfig, "build", no_backend)
    mod.main([*args, "shard.index=0"])
    assert (out / "candidates.shard0-of-2.jsonl").read_text() == ""
    assert shard_path(out, 0, 2).read_text() == ""
    monkeypatch.undo()
    mod.main([*args, "shard.index=1"])
    assert cli_merge_bon([str(out)]) == 0
    assert [r["id"] for r in read_jsonl(out / "scored.jsonl")] == ["bon-00000"]


def test_killed_generation_resumes_and_keeps_what_was_sampled(tiny_models, prm_dir, tmp_path, one_thread, monkeypatch):
    from mmprm.data.synthetic import SyntheticConfig, generate, write_split

    write_split(generate(SyntheticConfig(num_problems=3, seed=0, id_prefix="bon")), tmp_path / "data", "test")
    args = [
        "--config",
        str(CONFIG),
        f"prm.path={prm_dir}",
        "generate.enabled=true",
        f"policy.path={tiny_models('qwen2_vl')}",
        f"generate.problems_file={tmp_path / 'data' / 'test_problems.jsonl'}",
        "generate.n=2",
        "policy.batch_size=2",  # one problem per backend call
        "policy.sampling.max_new_tokens=8",
        "report.resamples=50",
        f"output_dir={tmp_path / 'gen'}",
    ]
    mod = recipe()
    build, calls = PolicyConfig.build, []

    def backend_killed_on_the_second_call(policy, *args, **kwargs):
        backend = build(policy, *args, **kwargs)
        generate_batch = backend.generate

        def generate_or_die(requests):
            calls.append(len(requests))
            if len(calls) == 2:
                raise KeyboardInterrupt
            return generate_batch(requests)

        backend.generate = generate_or_die
        return backend

    monkeypatch.setattr(PolicyConfig, "build", backend_killed_on_the_second_call)
    with pytest.raises(KeyboardInterrupt):
        mod.main(args)
    monkeypatch.undo()
    first = read_jsonl(tmp_path / "gen" / "candidates.jsonl.partial")
    assert [r["id"] for r in first] == ["bon-00000"]

    mod = recipe()
    mod.main(args)
    written = read_jsonl(tmp_path / "gen" / "candidates.jsonl")
    assert [r["id"] for r in written] == ["bon-00000", "bon-00001", "bon-00002"]
    assert written[0] == first[0]  # the sample written before the kill is kept, not drawn again
    assert len(read_jsonl(tmp_path / "gen" / "scored.jsonl")) == 3
