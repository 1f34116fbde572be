"""Checkpoints a killed job leaves behind: `latest` resumes from the newest complete one, never from
one cut off while saving or rewritten, `keep` bounds how many stay on disk and never deletes the run
that resumed, and a fresh start never trains over another run's checkpoints unless asked."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from accelerate import Accelerator

from mmprm.training.run import CHECKPOINT_DONE, TrainConfig, find_checkpoint, save_checkpoint, start_run


@pytest.fixture
def accelerator():
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(3, 2)
    acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.1))  # what save_state writes
    return acc


def steps(out) -> list[str]:
    return sorted((p.name for p in (out / "checkpoints").iterdir()), key=lambda n: int(n.split("_")[1]))


def test_latest_passes_over_a_checkpoint_cut_off_while_saving(accelerator, tmp_path):
    for step in (5, 10):
        save_checkpoint(accelerator, tmp_path, step, run_id="a")
    # a job killed inside save_state at step 15: some files written, no marker
    shutil.copytree(tmp_path / "checkpoints" / "step_10", tmp_path / "checkpoints" / "step_15")
    (tmp_path / "checkpoints" / "step_15" / CHECKPOINT_DONE).unlink()
    said = []
    assert find_checkpoint(tmp_path, "latest", log=said.append) == tmp_path / "checkpoints" / "step_10"
    assert len(said) == 1 and "step_15" in said[0] and "cut off while saving" in said[0]
    # step_9 sorts after step_10 as text: the order must be numeric
    save_checkpoint(accelerator, tmp_path, 9, run_id="a")
    assert find_checkpoint(tmp_path, "latest", log=said.append) == tmp_path / "checkpoints" / "step_10"
    # an explicit path loads as it is, marker or not
    assert find_checkpoint(tmp_path, str(tmp_path / "checkpoints" / "step_15")) == tmp_path / "checkpoints" / "step_15"
    accelerator.load_state(str(tmp_path / "checkpoints" / "step_10"))


def test_latest_with_no_complete_checkpoint_refuses_to_start_over(accelerator, tmp_path):
    assert find_checkpoint(tmp_path, "latest") is None  # a fresh run: nothing to resume
    accelerator.save_state(str(tmp_path / "checkpoints" / "step_4"))  # unmarked: cut off, or an older version's
    with pytest.raises(FileNotFoundError, match=r"no complete checkpoint .*step_4.*resume_from_checkpoint=PATH"):
        find_checkpoint(tmp_path, "latest")
    with pytest.raises(FileNotFoundError, match="no such checkpoint directory"):
        find_checkpoint(tmp_path, str(tmp_path / "checkpoints" / "step_99"))


def test_keep_deletes_all_but_the_newest_complete_checkpoints(accelerator, tmp_path):
    save_checkpoint(accelerator, tmp_path, 2, run_id="a", keep=2)
    (tmp_path / "checkpoints" / "step_3").mkdir()  # cut off: older than the next save, so it goes too
    for step in (4, 6, 8):
        save_checkpoint(accelerator, tmp_path, step, run_id="a", keep=2)
    assert steps(tmp_path) == ["step_6", "step_8"]
    assert all((tmp_path / "checkpoints" / s / CHECKPOINT_DONE).is_file() for s in steps(tmp_path))
    save_checkpoint(accelerator, tmp_path, 10, run_id="a")  # keep=None keeps every one
    assert steps(tmp_path) == ["step_6", "step_8", "step_10"]


def test_keep_checkpoints_below_one_is_refused():
    with pytest.raises(ValueError, match="train.keep_checkpoints: 0"):
        TrainConfig(keep_checkpoints=0).validate()


@pytest.mark.parametrize("recipe", ["prm_train", "policy_sft"])
@pytest.mark.parametrize("key", ["log_every", "eval_every", "save_every"])
def test_a_zero_step_interval_is_refused_when_the_config_loads(recipe, key):
    """`step % 0` would raise ZeroDivisionError at the first step, after the model has loaded."""
    from recipe_runs import REPO, load_recipe

    from mmprm.config import ConfigError, load_config

    mod = load_recipe(recipe)
    with pytest.raises(ConfigError, match=rf"train\.{key}: 0 is not a step interval"):
        cls = mod.PRMTrainConfig if recipe == "prm_train" else mod.PolicySFTConfig
        load_config(cls, REPO / "recipes" / "configs" / "tiny" / f"{recipe}.yaml", [f"train.{key}=0"])


def marker(out, step: int) -> dict:
    return json.loads((out / "checkpoints" / f"step_{step}" / CHECKPOINT_DONE).read_text())


def test_an_interrupted_save_leaves_every_earlier_checkpoint_intact(accelerator, tmp_path):
    # Written aside and renamed into place: a job killed mid-save (here while rewriting step_10,
    # then while writing step_15) leaves step_10 whole, marker and all, and `latest` resumes it.
    for step in (5, 10):
        save_checkpoint(accelerator, tmp_path, step, run_id="a")
    folder = tmp_path / "checkpoints"
    before = {p.name: p.read_bytes() for p in (folder / "step_10").iterdir()}
    save_state = accelerator.save_state

    def killed_while_saving(path):  # the model written, then the job dies before the optimizer
        save_state(path)
        (folder / path.rsplit("/", 1)[1] / "optimizer.bin").unlink()
        raise KeyboardInterrupt

    accelerator.save_state = killed_while_saving
    for step in (10, 15):
        with pytest.raises(KeyboardInterrupt):
            save_checkpoint(accelerator, tmp_path, step, run_id="a")
        assert {p.name: p.read_bytes() for p in (folder / "step_10").iterdir()} == before
        assert find_checkpoint(tmp_path, "latest") == folder / "step_10"
    assert not (folder / "step_15").exists()
    accelerator.save_state = save_state
    save_checkpoint(accelerator, tmp_path, 15, run_id="a")  # the next save clears what the kills left
    assert sorted(p.name for p in folder.iterdir()) == ["step_10", "step_15", "step_5"]
    assert find_checkpoint(tmp_path, "latest") == folder / "step_15"
    accelerator.load_state(str(folder / "step_15"))


def test_a_checkpoint_set_aside_for_its_rewrite_is_put_back(accelerator, tmp_path):
    # killed between the two renames of a rewrite: the old step_4 sits as step_4.replaced
    save_checkpoint(accelerator, tmp_path, 4, run_id="a")
    folder = tmp_path / "checkpoints"
    (folder / "step_4").rename(folder / "step_4.replaced")
    save_checkpoint(accelerator, tmp_path, 6, run_id="a")
    assert sorted(p.name for p in folder.iterdir()) == ["step_4", "step_6"]
    assert marker(tmp_path, 4)["step"] == 4


def test_the_marker_names_the_run_and_every_resume_keeps_it(accelerator, tmp_path):
    first = start_run(accelerator, tmp_path, None, 0)
    save_checkpoint(accelerator, tmp_path, 2, run_id=first)
    assert marker(tmp_path, 2) == {"step": 2, "processes": 1, "run_id": first}
    again = start_run(accelerator, tmp_path, find_checkpoint(tmp_path, "latest"), 2)
    assert again == first
    save_checkpoint(accelerator, tmp_path, 4, run_id=again)
    assert marker(tmp_path, 4)["run_id"] == first
    other = start_run(accelerator, tmp_path / "elsewhere", None, 0)
    assert other != first  # a fresh start is a new run


def test_resuming_an_earlier_step_sets_the_later_continuation_aside(accelerator, tmp_path):
    """The run saved steps 5 and 10; it is resumed from step 5 (step 10 diverged) and saves every 3
    steps keeping 1: step 8 must be what remains and what `latest` resumes, not the abandoned 10."""
    run = start_run(accelerator, tmp_path, None, 0)
    for step in (5, 10):
        save_checkpoint(accelerator, tmp_path, step, run_id=run)
    (tmp_path / "checkpoints" / "step_15").mkdir()  # the abandoned run was killed saving step 15
    resumed = find_checkpoint(tmp_path, str(tmp_path / "checkpoints" / "step_5"))
    said = []
    assert start_run(accelerator, tmp_path, resumed, 5, log=said.append) == run
    aside = tmp_path / "checkpoints" / "abandoned_after_step_5"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["abandoned_after_step_5", "step_5"]
    assert [p.name for p in aside.iterdir()] == ["step_10"] and (aside / "step_10" / CHECKPOINT_DONE).is_file()
    assert any("step_15" in s and "cut off while saving" in s for s in said)
    assert any("step_10" in s and str(aside) in s for s in said)
    kept = shutil.copytree(resumed, tmp_path / "kept" / "step_5")
    save_checkpoint(accelerator, tmp_path, 8, run_id=run, keep=1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["abandoned_after_step_5", "step_8"]
    assert find_checkpoint(tmp_path, "latest") == tmp_path / "checkpoints" / "step_8"
    # rewound to step 5 once more (from a copy kept elsewhere): the second continuation goes beside the first
    assert start_run(accelerator, tmp_path, kept, 5) == run
    assert (aside / "step_10").is_dir() and (tmp_path / "checkpoints" / "abandoned_after_step_5_2" / "step_8").is_dir()


def test_keep_never_deletes_another_runs_checkpoints(accelerator, tmp_path):
    save_checkpoint(accelerator, tmp_path, 1, run_id="other")  # e.g. resumed from a path elsewhere
    save_checkpoint(accelerator, tmp_path, 2, run_id="old")
    (tmp_path / "checkpoints" / "step_2" / CHECKPOINT_DONE).write_text('{"step": 2, "processes": 1}')
    for step in (3, 4):
        save_checkpoint(accelerator, tmp_path, step, run_id="mine", keep=1)
    # a marker that names no run was written before markers did: pruned as this run's
    assert steps(tmp_path) == ["step_1", "step_4"]


def test_a_fresh_start_over_another_runs_checkpoints_is_refused_unless_asked(accelerator, tmp_path):
    assert find_checkpoint(tmp_path, None) is None  # nothing there: a fresh start
    save_checkpoint(accelerator, tmp_path, 3, run_id="a")
    (tmp_path / "checkpoints" / "step_4").mkdir()  # cut off: still another run's
    for fresh in (lambda: find_checkpoint(tmp_path, None), lambda: start_run(accelerator, tmp_path, None, 0)):
        with pytest.raises(FileExistsError) as e:
            fresh()
        assert str(tmp_path / "checkpoints") in str(e.value) and "step_3, step_4" in str(e.value)
        assert "resume_from_checkpoint=latest" in str(e.value) and "train.overwrite_output_dir=true" in str(e.value)
    assert steps(tmp_path) == ["step_3", "step_4"]
    assert find_checkpoint(tmp_path, None, overwrite=True) is None
    said = []
    run = start_run(accelerator, tmp_path, None, 0, overwrite=True, log=said.append)
    assert run != "a" and not list((tmp_path / "checkpoints").iterdir())
    assert "step_3, step_4" in said[0]


@pytest.mark.parametrize("recipe", ["prm_train", "policy_sft"])
def test_the_recipes_refuse_a_fresh_start_before_loading_anything(recipe, tiny_models, tmp_path):
    from recipe_runs import REPO, recipe_env

    (tmp_path / "checkpoints" / "step_10").mkdir(parents=True)
    cmd = [
        sys.executable,
        str(REPO / "recipes" / f"{recipe}.py"),
        f"model.name_or_path={tiny_models('qwen2_vl')}",
        f"data.train_file={tmp_path / 'never_read.jsonl'}",
        f"output_dir={tmp_path}",
        "train.report_to=none",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=recipe_env())
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.startswith(f"{recipe}: {tmp_path / 'checkpoints'} holds another run's checkpoints (step_10)")
    assert "train.overwrite_output_dir=true" in res.stderr


def test_the_metrics_file_holds_only_the_steps_this_run_continues(accelerator, tmp_path):
    run = start_run(accelerator, tmp_path, None, 0)
    save_checkpoint(accelerator, tmp_path, 4, run_id=run)
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"split": "eval", "step": s, "loss": 1.0 / s} for s in (2, 4, 6)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"split": "ev')  # killed mid-line
    said = []
    start_run(accelerator, tmp_path, tmp_path / "checkpoints" / "step_4", 4, log=said.append)
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [2, 4]
    assert "dropped 2 row(s)" in said[0]  # step 6 and the cut line
    said.clear()
    start_run(accelerator, tmp_path, None, 0, overwrite=True, log=said.append)
    assert metrics.read_text() == "" and any("fresh start: dropped 2 row(s)" in s for s in said)
