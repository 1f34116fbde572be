"""A requeue loses nothing: SIGUSR1 (the notice train.sbatch hands on before a Slurm time limit)
makes a training run save the step it is on and exit, the rerun resumes there, and the tracker
run (wandb id, TensorBoard folder) is the same across both."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from recipe_runs import REPO, read_metrics, recipe_env, run_recipe
from toy_data import write_toy_prm_data

from mmprm.training.run import CHECKPOINT_DONE, TRACKER_FILE, SaveNotice, tracker_run


def test_save_notice_is_caught_and_its_handler_given_back():
    before = signal.getsignal(signal.SIGUSR1)
    notice = SaveNotice()
    assert not notice.received
    os.kill(os.getpid(), signal.SIGUSR1)  # the process lives on: the handler only takes note
    assert notice.received
    notice.close()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_tracker_run_keeps_its_id_for_one_run_and_not_for_the_next(tmp_path):
    first = tracker_run(tmp_path, "run-a", "wandb")
    assert json.loads((tmp_path / TRACKER_FILE).read_text()) == first
    assert tracker_run(tmp_path, "run-a", "wandb") == first  # a requeue: same run, same tracker id
    other = tracker_run(tmp_path, "run-b", "wandb")  # a fresh start over the folder
    assert other["tracker_id"] != first["tracker_id"] and other["run_id"] == "run-b"
    (tmp_path / TRACKER_FILE).write_text('{"run_id": "run-b", "tracker')  # cut off while written
    assert tracker_run(tmp_path, "run-b", "wandb")["run_id"] == "run-b"
    assert tracker_run(tmp_path / "elsewhere", "run-c", "wandb", write=False)["run_id"] == "run-c"
    assert not (tmp_path / "elsewhere" / TRACKER_FILE).exists()  # ranks other than 0 do not write


@pytest.mark.slow
def test_sigusr1_saves_the_step_it_came_in_and_the_rerun_resumes_there(tiny_models, tmp_path):
    train = write_toy_prm_data(tmp_path / "data", 32, 0)
    out = tmp_path / "run"
    args = [
        f"model.name_or_path={tiny_models('qwen2_vl')}",
        f"data.train_file={train}",
        f"output_dir={out}",
        "train.max_steps=2000",
        "train.batch_size=2",
        "train.log_every=1",
        "train.save_every=1000",
        "train.lr=1e-3",
        "data.max_length=256",
        "train.report_to=tensorboard",
    ]
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "recipes" / "prm_train.py"), *args],
        cwd=REPO,
        env=recipe_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not ((out / "metrics.jsonl").exists() and len(read_metrics(out, "train")) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, "the run never reached step 3"
            time.sleep(0.1)
        seen = read_metrics(out, "train")[-1]["step"]
        proc.send_signal(signal.SIGUSR1)
        text, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, text[-3000:]
    last = read_metrics(out, "train")[-1]["step"]
    assert seen <= last <= seen + 2, (seen, last)  # the step under way when the signal came, no more
    assert f"stopping at step {last} on the save notice (SIGUSR1)" in text
    assert [p.name for p in (out / "checkpoints").iterdir()] == [f"step_{last}"]
    assert json.loads((out / "checkpoints" / f"step_{last}" / CHECKPOINT_DONE).read_text())["step"] == last
    assert not (out / "model.safetensors").exists()  # stopped, not finished
    tracker = json.loads((out / TRACKER_FILE).read_text())

    res = run_recipe("prm_train", *args, "resume_from_checkpoint=latest", f"train.stop_at_step={last + 2}")
    assert f"at step {last}" in res.stdout + res.stderr
    assert [r["step"] for r in read_metrics(out, "train")] == list(range(1, last + 3))
    assert json.loads((out / TRACKER_FILE).read_text()) == tracker
    events = list((out / "prm_train").glob("events.out.tfevents.*"))
    assert len(events) == 2, events  # both runs logged into the one TensorBoard run folder


def test_train_dist_timeout_s_reaches_the_process_group(monkeypatch):
    from datetime import timedelta

    from mmprm.training.run import TrainConfig, process_group_kwargs

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert process_group_kwargs(900) == []  # one process, no launcher: no process group
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")
    (handler,) = process_group_kwargs(900)
    assert handler.to_kwargs() == {"timeout": timedelta(seconds=900)}  # the backend stays accelerate's
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    (handler,) = process_group_kwargs(900)
    assert handler.to_kwargs() == {"backend": "gloo", "timeout": timedelta(seconds=900)}
    with pytest.raises(ValueError, match="train.dist_timeout_s: 0"):
        TrainConfig(dist_timeout_s=0).validate()
