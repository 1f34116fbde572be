"""Checkpoints a killed job leaves behind: `latest` resumes from the newest complete one, never from
one cut off while saving, and `keep` bounds how many stay on disk."""

from __future__ import annotations

import shutil

import pytest
import torch
from accelerate import Accelerator

from mmprm.training import CHECKPOINT_DONE, TrainConfig, find_checkpoint, save_checkpoint


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
        save_checkpoint(accelerator, tmp_path, step)
    # a job killed inside save_state at step 15: some files written, no marker
    shutil.copytree(tmp_path / "checkpoints" / "step_10", tmp_path / "checkpoints" / "step_15")
    (tmp_path / "checkpoints" / "step_15" / CHECKPOINT_DONE).unlink()
    said = []
    assert find_checkpoint(tmp_path, "latest", log=said.append) == tmp_path / "checkpoints" / "step_10"
    assert len(said) == 1 and "step_15" in said[0] and "cut off while saving" in said[0]
    # step_9 sorts after step_10 as text: the order must be numeric
    save_checkpoint(accelerator, tmp_path, 9)
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
    save_checkpoint(accelerator, tmp_path, 2, keep=2)
    (tmp_path / "checkpoints" / "step_3").mkdir()  # cut off: older than the next save, so it goes too
    for step in (4, 6, 8):
        save_checkpoint(accelerator, tmp_path, step, keep=2)
    assert steps(tmp_path) == ["step_6", "step_8"]
    assert all((tmp_path / "checkpoints" / s / CHECKPOINT_DONE).is_file() for s in steps(tmp_path))
    save_checkpoint(accelerator, tmp_path, 10)  # keep=None keeps every one
    assert steps(tmp_path) == ["step_6", "step_8", "step_10"]


def test_keep_checkpoints_below_one_is_refused():
    with pytest.raises(ValueError, match="train.keep_checkpoints: 0"):
        TrainConfig(keep_checkpoints=0).validate()
