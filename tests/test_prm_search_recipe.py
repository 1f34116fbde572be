"""recipes/prm_search.py end to end on a tiny VLM toy policy: kill -9 and resume, shards, report."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from recipe_runs import REPO, recipe_env, run_recipe

RECIPE = REPO / "recipes" / "prm_search.py"
YAML = REPO / "recipes" / "configs" / "tiny" / "prm_search.yaml"
# the recipe imports mmprm from this checkout, installed or not
ENV = recipe_env(PYTHONPATH=str(REPO))


def run(args, timeout=600):
    return run_recipe("prm_search", *args, timeout=timeout, extra_env={"PYTHONPATH": str(REPO)})


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def inputs(tiny_models, tmp_path_factory):
    from mmprm.annotate.simulated import train_toy_policy, write_toy_problems
    from mmprm.models.loading import load_backbone
    from mmprm.models.prm import PRMSpec, build_prm, save_prm

    root = tmp_path_factory.mktemp("prm_search")
    policy = train_toy_policy(str(tiny_models("qwen2_vl")), str(root / "policy"), steps=150)
    backbone, processor = load_backbone(policy)
    prm = save_prm(build_prm(backbone, processor, PRMSpec()), processor, root / "prm")
    return policy, prm, write_toy_problems(str(root / "problems"), n=6)


def test_bad_config_fails_before_models_load(tmp_path):
    res = subprocess.run(
        [sys.executable, str(RECIPE), "--config", str(YAML), "searches=[{method: beam, aggregator: mean}]"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=ENV,
        timeout=120,
        check=False,
    )
    assert res.returncode == 2 and "aggregator" in res.stderr and "Traceback" not in res.stderr


def test_missing_model_directory_and_bad_kernel_are_named_before_loading(tmp_path):
    model = tmp_path / "model"  # passes the early check (a config.json), never loaded: the other key fails first
    model.mkdir()
    (model / "config.json").write_text("{}")
    out = tmp_path / "out"
    for overrides, message in (
        (["policy.path=/nonexistent/policy", f"prm.path={model}"], "policy.path: /nonexistent/policy does not exist"),
        ([f"policy.path={model}", "prm.path=/nonexistent/prm"], "prm.path: /nonexistent/prm does not exist"),
        (
            [f"policy.path={model}", f"prm.path={model}", "model.attn_implementation=flash"],
            "model.attn_implementation: 'flash' is not one of",
        ),
    ):
        res = subprocess.run(
            [sys.executable, str(RECIPE), "--config", str(YAML), *overrides, f"output_dir={out}"],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=ENV,
            timeout=120,
            check=False,
        )
        assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr
        assert not out.exists()  # nothing written


def test_backend_takes_the_policy_prompt_format_and_a_shard_seed_stream(tiny_models, tmp_path):
    import importlib.util
    import shutil

    from mmprm.config import load_config
    from mmprm.generation.base import worker_seed
    from mmprm.generation.policy import PolicySpec, save_policy_spec

    spec = importlib.util.spec_from_file_location("_recipe_prm_search_backend", RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = recipe  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(recipe)
    policy = shutil.copytree(tiny_models("qwen2_vl"), tmp_path / "policy")
    save_policy_spec(policy, PolicySpec(system_prompt="Solve it in short steps.", step_mode="blank_lines"))
    base = [f"policy.path={policy}", f"prm.path={tmp_path}", "shard.index=1", "shard.count=2"]

    def make_backend(cfg):  # as main builds it: the shard's own seed stream
        return cfg.policy.build(cfg.model.attn_implementation, sampling=cfg.policy.sampling_for(1, max_new_tokens=16))

    cfg = load_config(recipe.PRMSearchConfig, YAML, base)
    backend = make_backend(cfg)
    assert (backend.system, backend.step_mode) == ("Solve it in short steps.", "blank_lines")  # saved with the policy
    assert backend.sampling.seed == worker_seed(cfg.policy.sampling.seed, 1) != cfg.policy.sampling.seed + 1
    assert backend.sampling.max_new_tokens == 16
    # the config wins, with a warning naming the saved value; "" sends no system turn
    cfg = load_config(recipe.PRMSearchConfig, YAML, [*base, "policy.step_mode=tags", "policy.system_prompt=''"])
    with pytest.warns(UserWarning) as caught:
        backend = make_backend(cfg)
    warned = " ".join(str(w.message) for w in caught)
    assert "step_mode='tags' overrides 'blank_lines'" in warned and "system_prompt='' overrides" in warned
    assert (backend.system, backend.step_mode) == (None, "tags")


def test_check_runs_names_the_setting_another_run_used(tmp_path):
    """check_runs (before any model loads) compares this shard's settings with what this and the
    other shards recorded beside their rows: a changed policy, sampling or search is named."""
    import importlib.util

    from mmprm.config import ConfigError, load_config

    spec = importlib.util.spec_from_file_location("_recipe_prm_search_runs", RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = recipe
    spec.loader.exec_module(recipe)
    out = tmp_path / "out"
    base = [f"policy.path={tmp_path / 'policy'}", f"prm.path={tmp_path / 'prm'}", "bon.enabled=true", "shard.count=2"]

    def check(*extra, index=0):
        recipe.check_runs(load_config(recipe.PRMSearchConfig, YAML, [*base, f"shard.index={index}", *extra]), out, 6)

    check()
    beam = out / recipe.slug(load_config(recipe.PRMSearchConfig, YAML, base).searches[0].label())
    (beam / "results.shard0-of-2.jsonl").write_text('{"id": "a"}\n')
    check()  # the same settings resume
    with pytest.raises(ConfigError, match=r"results.shard0-of-2.jsonl was made with other settings {'policy'"):
        check(f"policy.path={tmp_path / 'policy2'}")
    with pytest.raises(ConfigError, match=r"results.shard0-of-2.jsonl was made .*{'sampling'"):
        check("policy.sampling.temperature=0.5", index=1)  # shard 1, against shard 0's rows
    (out / "bon" / "candidates.shard0-of-2.done").write_text("")  # a .done marker alone is another run's too
    (beam / "results.shard0-of-2.jsonl").unlink()
    with pytest.raises(ConfigError, match=r"candidates.shard0-of-2.jsonl was made .*{'n'"):
        check("bon.n=[2, 32]")


@pytest.mark.slow
def test_kill_resume_shards_and_report(inputs, tmp_path):
    policy, prm, problems = inputs
    out = tmp_path / "out"
    base = [
        "--config",
        str(YAML),
        f"policy.path={policy}",
        f"prm.path={prm}",
        f"problems_file={problems}",
        f"output_dir={out}",
        "batch_problems=1",
        "bon.n=[2,4]",
        "report.resamples=200",
        "searches=[{method: beam, width: 2, expansions: 2, max_steps: 5}, {method: dvts, width: 2, expansions: 2, max_steps: 5}]",
    ]
    beam = out / "beam_W2xM2" / "results.shard0-of-1.jsonl"

    # kill -9 once the first problem is written, then rerun the same command
    proc = subprocess.Popen(
        [sys.executable, str(RECIPE), *base], cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and (not beam.exists() or not beam.read_text().strip()):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with open(beam, "a") as f:
        f.write('{"id": "toy-torn", "answ')  # a row torn mid-write, as a kill during the write leaves it
    done_before = [json.loads(x)["id"] for x in beam.read_text().splitlines()[:-1]]
    assert 1 <= len(done_before) < 6
    res = run(base)
    assert f"{len(done_before)} problems already done" in res.stdout and "torn last row" in res.stderr
    rows = lines(beam)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == 6 and ids[: len(done_before)] == done_before

    # what a user opens: per-problem rows with the whole tree, the report, the plot, tree pictures
    from mmprm.search.core import SearchTree

    for r in rows:
        tree = SearchTree.from_json(r["tree"])
        assert tree.chosen is not None and r["stats"]["generated_tokens"] > 0
        if r["complete"]:
            assert r["steps"] and len(r["step_probs"]) == len(r["steps"])
            assert r["correct"] == (r["answer"] == "5")  # the toy question's answer
    report = json.loads((out / "report.json").read_text())
    assert report["num_problems"] == 6
    assert {"beam W2xM2", "dvts W2xM2", "Best-of-N (PRM min) N=4", "majority vote N=2"} <= set(report["methods"])
    beam_acc = sum(r["correct"] for r in rows) / 6
    assert report["methods"]["beam W2xM2"]["mean"] == pytest.approx(beam_acc)
    assert [m["search"] for m in report["matched"]] == ["beam W2xM2", "dvts W2xM2"]
    assert (out / "search_vs_bon.png").stat().st_size > 5000 and "Equal budget" in (out / "report.md").read_text()
    assert len(list((out / "trees").glob("*.png"))) == 2
    bon = lines(out / "bon" / "candidates.shard0-of-1.jsonl")
    assert len(bon) == 6 and all(len(r["candidates"]) == 4 for r in bon)

    # a rerun after completion searches nothing and duplicates nothing
    res = run(base)
    assert "6 problems already done, 0 to search" in res.stdout and len(lines(beam)) == 6
    # the summary line a user reads: the interval rounded as the difference is
    assert re.search(r"dvts W2xM2 .* diff [+-]\d\.\d{3} \[[+-]\d\.\d{3}, [+-]\d\.\d{3}\]$", res.stdout, re.M)

    # two shards into another folder: the first leaves no report, the second writes it
    sharded = [a if not a.startswith("output_dir=") else f"output_dir={tmp_path / 'sharded'}" for a in base]
    res = run([*sharded, "shard.index=0", "shard.count=2"])
    assert "report is written when all 2 shards are" in res.stdout
    assert not (tmp_path / "sharded" / "report.json").exists()
    run([*sharded, "shard.index=1", "shard.count=2"])
    assert json.loads((tmp_path / "sharded" / "report.json").read_text())["num_problems"] == 6


@pytest.mark.slow
def test_another_prm_on_the_same_output_dir_is_refused_by_name(inputs, tmp_path):
    """Rows and .done markers of one run are never resumed, nor merged, by a run with another PRM:
    on the same shard, or on another shard of the same output_dir."""
    import shutil

    policy, prm, problems = inputs
    other = shutil.copytree(prm, tmp_path / "other_prm")  # the same weights, but another PRM to the run

    def launch(out, *extra):
        return subprocess.run(
            [
                sys.executable,
                str(RECIPE),
                "--config",
                str(YAML),
                f"policy.path={policy}",
                f"problems_file={problems}",
                f"output_dir={out}",
                "limit=2",
                "batch_problems=2",
                "report.resamples=50",
                "searches=[{method: beam, width: 2, expansions: 2, max_steps: 3}]",
                *extra,
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=ENV,
            timeout=600,
            check=False,
        )

    out = tmp_path / "out"
    assert launch(out, f"prm.path={prm}").returncode == 0
    rows = out / "beam_W2xM2" / "results.shard0-of-1.jsonl"
    before = rows.read_text(), (out / "report.json").read_text()
    res = launch(out, f"prm.path={other}")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "results.shard0-of-1.jsonl was made with other settings {'prm'" in res.stderr and str(other) in res.stderr
    assert (rows.read_text(), (out / "report.json").read_text()) == before

    sharded = tmp_path / "sharded"
    assert launch(sharded, f"prm.path={prm}", "shard.index=0", "shard.count=2").returncode == 0
    res = launch(sharded, f"prm.path={other}", "shard.index=1", "shard.count=2")
    assert res.returncode == 2 and "results.shard0-of-2.jsonl was made with other settings {'prm'" in res.stderr
    assert not (sharded / "beam_W2xM2" / "results.shard1-of-2.jsonl").exists()


@pytest.mark.slow
def test_paths_cut_by_the_prm_max_length_are_counted_not_fatal(inputs, tmp_path):
    from mmprm.models.prm import load_prm

    policy, prm, problems = inputs
    first = json.loads(Path(problems).read_text().splitlines()[0])
    images = [str(Path(problems).parent / p) for p in first["images"]]
    steps = ["The bar starts at 2.", "Adding 3 gives 2 + 3 = 5."]  # the toy policy's first two steps
    tok = load_prm(prm, device="cpu").tokenize({**first, "images": images, "steps": steps})
    # room for the prompt and the first step with some slack, not for the second: deeper paths are cut
    max_length = tok.step_positions[0] + 6
    out = tmp_path / "out"
    res = run(
        [
            "--config",
            str(YAML),
            f"policy.path={policy}",
            f"prm.path={prm}",
            f"problems_file={problems}",
            f"output_dir={out}",
            f"prm.max_length={max_length}",
            "bon.n=[3,4]",
            "report.resamples=50",
            "report.trees=0",
            "searches=[{method: beam, width: 2, expansions: 2, max_steps: 5}]",
        ]
    )
    rows = lines(out / "beam_W2xM2" / "results.shard0-of-1.jsonl")
    cut = sum(r["stats"]["cut_nodes"] for r in rows)
    assert cut > 0, res.stdout
    for r in rows:  # the chosen node is never one the PRM could not score to its end
        assert r["tree"]["nodes"][r["tree"]["chosen"]]["status"] != "cut"
    bon = [c for r in lines(out / "bon" / "candidates.shard0-of-1.jsonl") for c in r["candidates"]]
    truncated = [c for c in bon if c["truncated"]]
    assert truncated and all(len(c["step_probs"]) < len(c["steps"]) for c in truncated)
    report = json.loads((out / "report.json").read_text())
    assert report["methods"]["beam W2xM2"]["cut_nodes"] == cut
    assert report["settings"]["bon_truncated_candidates"] == len(truncated)
    assert {"Best-of-N (PRM min) N=3", "Best-of-N (PRM min) N=4"} <= set(report["methods"])
    assert "Cut by the PRM's `prm.max_length`" in (out / "report.md").read_text()
