"""prm_train: the real recipe entry point on tiny models - loss, labels, resume, DDP, load_prm."""

import contextlib
import json
import math
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from recipe_runs import (
    REPO,
    check_train_rows,
    cpu_ddp_launcher,
    load_recipe,
    read_metrics,
    run_recipe,
    short_train_args,
)
from safetensors.torch import load_file
from toy_data import write_toy_prm_data, write_uneven_tree_data

from mmprm.training.run import CHECKPOINT_DONE

RECIPE = REPO / "recipes" / "prm_train.py"


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    d = tmp_path_factory.mktemp("toy")
    return write_toy_prm_data(d, 32, 0), write_toy_prm_data(d, 16, 1, name="eval.jsonl")


def common(model, train, ev, out, steps=12):
    return short_train_args(model, train, ev, out, steps)


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "internvl", "llava", "qwen2"])
def test_every_arch_trains_and_loss_goes_down(tiny_models, toy, tmp_path, arch):
    train, ev = toy
    if arch == "qwen2":  # text-only: the same toy signal without images
        train = write_toy_prm_data(tmp_path / "text", 32, 0, images=False)
        ev = write_toy_prm_data(tmp_path / "text", 16, 1, images=False, name="eval.jsonl")
    out = tmp_path / arch
    run_recipe("prm_train", *common(tiny_models(arch), train, ev, out, steps=16), "train.warmup_steps=0")
    rows = read_metrics(out, "train")
    first, last = sum(r["loss"] for r in rows[:4]) / 4, sum(r["loss"] for r in rows[-4:]) / 4
    assert last < first, f"{arch}: loss did not go down ({first:.4f} -> {last:.4f})"
    assert (out / "mmprm_prm.json").exists() and (out / "checkpoints" / "step_16").is_dir()
    check_train_rows(rows, mfu=False)  # no train.peak_tflops on a CPU: MFU is null
    ev_rows = read_metrics(out, "eval")
    assert {"bce", "brier", "step_accuracy", "first_error_f1"} <= set(ev_rows[-1])


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "internvl", "llava"])
def test_lora_training_leaves_the_vision_tower_as_the_base_model_has_it(tiny_models, toy, tmp_path, arch):
    """With the default frozen tower and LoRA on the default target names, the checkpoint holds no
    adapter in the tower and the saved (merged) PRM holds the base model's vision weights."""
    train, ev = toy
    out = tmp_path / arch
    lora = ["model.lora.enabled=true", "model.lora.r=4", "model.lora.alpha=8", "model.lora.dropout=0"]
    run_recipe("prm_train", *common(tiny_models(arch), train, ev, out, steps=2), *lora)

    def in_tower(name):
        return "vision_tower." in name or ("visual." in name and "merger" not in name)

    trained = load_file(out / "checkpoints" / "step_2" / "model.safetensors")
    adapters = [k for k in trained if "lora_" in k]
    assert adapters and [k for k in adapters if in_tower(k)] == []
    base, saved = load_file(tiny_models(arch) / "model.safetensors"), load_file(out / "model.safetensors")
    tower = [k for k in base if in_tower(k)]
    assert tower and [k for k in tower if not torch.equal(saved[k], base[k])] == []


def test_value_head_hard_labels_balance_and_load_prm_round_trip(tiny_models, toy, tmp_path):
    import mmprm
    from mmprm.data.schema import load_examples

    train, ev = toy
    out = tmp_path / "value"
    run_recipe(
        "prm_train",
        *common(tiny_models("qwen2_vl"), train, ev, out, steps=6),
        "prm.head=value",
        "data.label_mode=hard",
        "data.balance=true",
    )
    scorer = mmprm.load_prm(out)
    examples = load_examples(ev)[:3]
    scores = scorer.score(examples)
    assert [len(s) for s in scores] == [len(e.steps) for e in examples]
    assert all(0.0 < p < 1.0 for s in scores for p in s)
    again = mmprm.load_prm(out).score(examples)
    assert again == scores  # deterministic reload: same head weights, same tokenization


def test_resolved_config_repeats_the_run(tiny_models, toy, tmp_path):
    # config.resolved.json holds every setting of a run beside its process count: given back as
    # --config, with only the output folder changed, it trains the same weights.
    train, ev = toy
    first, again = tmp_path / "first", tmp_path / "again"
    run_recipe("prm_train", *common(tiny_models("qwen2_vl"), train, ev, first, steps=4))
    assert json.loads((first / "config.resolved.json").read_text())["num_processes"] == 1
    run_recipe("prm_train", "--config", first / "config.resolved.json", f"output_dir={again}")
    a, b = load_file(first / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys()
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst <= 1e-6, f"the rerun from config.resolved.json differs by {worst}"


def test_exact_resume_matches_straight_run(tiny_models, toy, tmp_path):
    train, ev = toy
    model = tiny_models("qwen2_vl")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    args = common(model, train, ev, straight, steps=20)
    run_recipe("prm_train", *args, "train.save_every=100", "train.warmup_steps=3", "train.grad_accum=2")
    args_r = common(model, train, ev, resumed, steps=20)
    run_recipe(
        "prm_train",
        *args_r,
        "train.save_every=100",
        "train.warmup_steps=3",
        "train.grad_accum=2",
        "train.stop_at_step=10",
    )
    assert not (resumed / "model.safetensors").exists()
    # The job was then killed while saving step 15: files without the completion marker, and
    # damaged. `latest` must pass over it and resume from step 10.
    cut = resumed / "checkpoints" / "step_15"
    shutil.copytree(resumed / "checkpoints" / "step_10", cut)
    (cut / CHECKPOINT_DONE).unlink()
    for part in cut.glob("*.safetensors"):
        part.write_bytes(b"")
    res = run_recipe(
        "prm_train",
        *args_r,
        "train.save_every=100",
        "train.warmup_steps=3",
        "train.grad_accum=2",
        "resume_from_checkpoint=latest",
    )
    assert "passing over step_15" in res.stdout + res.stderr
    a, b = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys()
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst <= 1e-6, f"resumed run differs from straight run by {worst}"


def test_a_run_that_stops_early_logs_the_steps_since_its_last_row(tiny_models, toy, tmp_path):
    """Stopping (train.stop_at_step, or the SIGUSR1 save notice, which shares the path) between
    two log steps writes a row for the steps since the last one; the resumed run logs the rest."""
    train, ev = toy
    out = tmp_path / "run"
    args = [*common(tiny_models("qwen2_vl"), train, ev, out, steps=8), "train.log_every=3", "train.eval_every=100"]
    run_recipe("prm_train", *args, "train.stop_at_step=5")
    assert [r["step"] for r in read_metrics(out, "train")] == [3, 5]
    run_recipe("prm_train", *args, "resume_from_checkpoint=latest")
    assert [r["step"] for r in read_metrics(out, "train")] == [3, 5, 6, 8]


@pytest.mark.slow
def test_a_run_resumed_on_two_processes_trains_the_rest_of_its_epoch(tiny_models, tmp_path):
    """64 rows, train.global_batch_size=8: 5 steps on 1 process then 3 on 2 processes train the
    weights of 8 steps on 1, the whole first epoch (the 2-process rest used to count its position
    in its own, larger batches, jump to epoch 1 and skip 24 rows)."""
    train = write_toy_prm_data(tmp_path / "d", 64, 0)
    args = [*common(tiny_models("qwen2_vl"), train, "null", tmp_path / "x", steps=8), "prm.head=value"]
    args += ["train.warmup_steps=0", "train.global_batch_size=8", "train.save_every=100"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_recipe("prm_train", *args, f"output_dir={straight}")
    run_recipe("prm_train", *args, f"output_dir={resumed}", "train.stop_at_step=5")
    res = run_recipe(
        "prm_train",
        *args,
        f"output_dir={resumed}",
        "resume_from_checkpoint=latest",
        launcher=cpu_ddp_launcher(),
        extra_env={"ACCELERATE_USE_CPU": "true"},
    )
    assert json.loads((resumed / "config.resolved.json").read_text())["num_processes"] == 2
    assert "global batches of 4 rows, this run cuts 8: it trains on from rows 40" in res.stdout + res.stderr
    for name in ("model.safetensors", "value_head.safetensors"):
        a, b = load_file(straight / name), load_file(resumed / name)
        worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
        assert worst <= 1e-5, f"{name}: resumed on 2 processes, the run trained other weights, by {worst}"


def test_batches_collated_ahead_train_the_same_weights(tiny_models, toy, tmp_path):
    """train.prefetch_batches collates the next step's micro-batches on a background thread (and
    waits for it around evaluation): the same batches, so the same weights and eval rows bit for bit."""
    train, ev = toy
    model = tiny_models("qwen2_vl")
    runs = {}
    for prefetch in ("true", "false"):
        out = tmp_path / prefetch
        args = common(model, train, ev, out, steps=6)
        run_recipe("prm_train", *args, "train.grad_accum=2", "train.eval_every=3", f"train.prefetch_batches={prefetch}")
        runs[prefetch] = load_file(out / "model.safetensors"), read_metrics(out, "eval")
    (a, eval_a), (b, eval_b) = runs["true"], runs["false"]
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert [r["bce"] for r in eval_a] == [r["bce"] for r in eval_b] and len(eval_a) == 2


class StepLogits(torch.nn.Module):
    """A value head with one logit per step, read through the step's input id: its gradient is
    the step's weight in the loss."""

    def __init__(self, n: int):
        super().__init__()
        self.logit = torch.nn.Parameter(torch.zeros(n))

    def forward(self, input_ids, attention_mask, step_mask, **_):
        return self.logit[input_ids[step_mask]]  # (N,)


def balanced_step_weights(targets: list[float], splits: list[int]) -> list[float]:
    """Each step's weight in one window's loss under data.balance, the window's steps run as
    micro-batches of `splits` steps (one step per row), through prm_train's `train_micro_batch`."""
    prm_train = load_recipe("prm_train")
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=len(splits))  # backward() divides by it
    model = StepLogits(len(targets))
    run = SimpleNamespace(
        accelerator=accelerator, model=model, train=SimpleNamespace(grad_accum=len(splits)), progress=SimpleNamespace()
    )
    pos_weight, neg_weight = prm_train.balance_weights(sum(t >= 0.5 for t in targets), len(targets))
    data = prm_train.PRMData(None, None, {}, None, [], [], pos_weight, neg_weight, balanced=True)
    start = 0
    for k, size in enumerate(splits):
        ids = torch.arange(start, start + size)
        batch = {
            "input_ids": ids[:, None],  # (B, 1): a row of one step token
            "attention_mask": torch.ones(size, 1, dtype=torch.long),
            "step_mask": torch.ones(size, 1, dtype=torch.bool),
            "targets": torch.tensor(targets)[ids],
        }
        prm_train.train_micro_batch(run, lambda _: contextlib.nullcontext(), data, batch, [], k, len(targets))
        start += size
    # the loss of step i is BCE(logit_i, t_i): at logit 0 its slope is 0.5 - t_i, so the gradient
    # is weight_i * (0.5 - t_i) / n_window
    grad = model.logit.grad
    return [float(g) * len(targets) / (0.5 - t) for g, t in zip(grad, targets)]


def test_balance_weighs_a_step_the_same_in_any_split_of_the_window():
    # 7 positive steps and 1 negative: balancing gives each side half the loss, 4.0 for the
    # negative and 4/7 for each positive, whether the window runs as 1 x 8 or 2 x 4 micro-batches
    targets = [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    for splits in ([8], [4, 4], [3, 5], [1] * 8):
        weights = balanced_step_weights(targets, splits)
        assert weights[3] == pytest.approx(4.0), f"micro-batches of {splits}: the negative weighs {weights[3]:.3f}"
        assert weights[:3] + weights[4:] == pytest.approx([4 / 7] * 7), f"micro-batches of {splits}"


@pytest.mark.slow
def test_balance_trains_the_same_weights_in_one_or_two_micro_batches(tiny_models, toy, tmp_path):
    """data.balance: a global batch of 8 rows trains the same weights as 1 x 8 or 2 x 4 micro-batches."""
    train, _ = toy
    args = [*common(tiny_models("qwen2_vl"), train, "null", tmp_path / "x", steps=3), "prm.head=value"]
    # without group_by_length both splits cut the same shuffled order into the same global batches
    args += ["data.balance=true", "train.warmup_steps=0", "train.global_batch_size=8", "train.group_by_length=false"]
    runs = {}
    for batch_size in (8, 4):
        out = tmp_path / f"b{batch_size}"
        run_recipe("prm_train", *args, f"output_dir={out}", f"train.batch_size={batch_size}")
        runs[batch_size] = out
    for name in ("model.safetensors", "value_head.safetensors"):
        a, b = load_file(runs[8] / name), load_file(runs[4] / name)
        worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
        assert worst <= 1e-5, f"{name}: 2 x 4 micro-batches train other weights than 1 x 8, by {worst}"


def write_tree_data(out_dir, n):
    """n toy problems, each a small MCTS tree: the row, its one-step prefix and a branch beside it."""
    src = write_toy_prm_data(out_dir, n, 0)
    rows = []
    for r in map(json.loads, src.read_text().splitlines()):
        rows += [r, {**r, "id": r["id"] + "/prefix", "steps": r["steps"][:1], "labels": r["labels"][:1]}]
        rows.append(
            {**r, "id": r["id"] + "/branch", "steps": [r["steps"][0], "So it is 7."], "labels": [r["labels"][0], 0.4]}
        )
    train = out_dir / "tree.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return train


def test_tree_packing_trains_the_same_weights_as_rows(tiny_models, tmp_path):
    """With every row in every batch, packing changes the arithmetic, not the loss: the weights
    after three optimizer steps match row-by-row training."""
    train = write_tree_data(tmp_path / "toy", 8)
    model = tiny_models("qwen2_vl")
    args = [*common(model, train, "null", tmp_path / "x", steps=3), "prm.head=value", "train.warmup_steps=0"]
    by_row, packed = tmp_path / "rows", tmp_path / "packed"
    run_recipe("prm_train", *args, f"output_dir={by_row}", "train.batch_size=24")
    res = run_recipe("prm_train", *args, f"output_dir={packed}", "train.batch_size=8", "data.pack_trees=true")
    assert "tree packing: 24 rows in 8 packs" in res.stdout + res.stderr
    assert "saves little" not in res.stdout + res.stderr
    for name in ("model.safetensors", "value_head.safetensors"):
        a, b = load_file(by_row / name), load_file(packed / name)
        worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
        assert worst <= 1e-4, f"{name}: packed training differs from row training by {worst}"
    loss = [r["loss"] for r in read_metrics(packed, "train")]
    assert loss == pytest.approx([r["loss"] for r in read_metrics(by_row, "train")], abs=1e-4)


def test_tree_packed_resume_matches_straight_run(tiny_models, tmp_path):
    train = write_tree_data(tmp_path / "toy", 12)
    args = [*common(tiny_models("qwen2_vl"), train, "null", tmp_path / "x", steps=10), "prm.head=value"]
    args += ["data.pack_trees=true", "train.batch_size=3", "train.save_every=100"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_recipe("prm_train", *args, f"output_dir={straight}")
    run_recipe("prm_train", *args, f"output_dir={resumed}", "train.stop_at_step=5")  # 12 packs: mid second epoch
    run_recipe("prm_train", *args, f"output_dir={resumed}", "resume_from_checkpoint=latest")
    a, b = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst <= 1e-6, f"resumed packed run differs from the straight run by {worst}"


def test_tree_packing_says_when_rows_share_nothing(tiny_models, toy, tmp_path):
    train, ev = toy  # one row per problem: a pack is the row itself
    res = run_recipe(
        "prm_train", *common(tiny_models("qwen2_vl"), train, ev, tmp_path / "x", steps=2), "data.pack_trees=true"
    )
    assert "tree packing: 32 rows in 32 packs" in res.stdout + res.stderr
    assert "tree packing saves little here" in res.stdout + res.stderr


def test_tree_packing_refuses_flash_attention(tiny_models, toy, tmp_path):
    train, ev = toy
    res = subprocess.run(
        [sys.executable, str(RECIPE), *common(tiny_models("qwen2_vl"), train, ev, tmp_path / "x")]
        + ["data.pack_trees=true", "model.attn_implementation=flash_attention_2"],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2
    assert "data.pack_trees needs attention that takes a tree mask" in res.stderr


def test_flex_attention_training_without_a_gpu_is_refused(tiny_models, toy, tmp_path):
    """torch's FlexAttention has no backward on CPU: training with it stops before loading."""
    train, ev = toy
    res = subprocess.run(
        [sys.executable, str(RECIPE), *common(tiny_models("internvl"), train, ev, tmp_path / "x")]
        + ["data.pack_trees=true", "model.attn_implementation=flex_attention"],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2
    assert "flex_attention trains on a GPU only" in res.stderr


@pytest.mark.slow
@pytest.mark.parametrize("head", ["token_pair", "value", "value+packed"])
def test_two_process_ddp(tiny_models, toy, tmp_path, head):
    train, ev = toy
    head, packed = head.split("+")[0], head.endswith("+packed")
    out = tmp_path / "ddp"
    launcher = cpu_ddp_launcher()
    # without ACCELERATE_USE_CPU each process would see no GPU and run alone (world size 1);
    # a value head leaves the LM head without a gradient, which plain DDP rejects at step 2
    run_recipe(
        "prm_train",
        *common(tiny_models("qwen2_vl"), train, ev, out, steps=6),
        f"prm.head={head}",
        f"data.pack_trees={str(packed).lower()}",
        launcher=launcher,
        extra_env={"ACCELERATE_USE_CPU": "true"},
    )
    assert (out / "mmprm_prm.json").exists()
    # two real processes in one group, not two independent single-process runs
    assert json.loads((out / "config.resolved.json").read_text())["num_processes"] == 2
    ev_rows = read_metrics(out, "eval")
    assert ev_rows and math.isfinite(ev_rows[-1]["bce"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "packed,balance", [(True, False), (False, False), (True, True)], ids=["packed", "rows", "packed+balance"]
)
def test_two_processes_train_the_weights_of_one_on_the_same_global_batch(tiny_models, tmp_path, packed, balance):
    """A step token weighs the same whichever rank runs it: 2 ranks of batch 2 with packs (or rows)
    of unequal step counts train the weights of 1 rank of batch 4, accumulation and data.balance
    included."""
    train = write_uneven_tree_data(tmp_path / "toy", 8)
    args = [*common(tiny_models("qwen2_vl"), train, "null", tmp_path / "x", steps=3), "prm.head=value"]
    # group_by_length would sort the batch so that the strided shares hold equal step counts
    args += [
        "train.warmup_steps=0",
        "train.global_batch_size=8",  # accumulates 2 micro-steps on either world size
        "train.group_by_length=false",
        f"data.pack_trees={str(packed).lower()}",
        f"data.balance={str(balance).lower()}",
    ]
    one, two = tmp_path / "one", tmp_path / "two"
    res = run_recipe("prm_train", *args, f"output_dir={one}", "train.batch_size=4")
    unit = "packs" if packed else "rows"
    assert f"4 {unit} x 2 micro-step(s) x 1 process(es) = 8 {unit} per optimizer step" in res.stdout + res.stderr
    res = run_recipe(
        "prm_train",
        *args,
        f"output_dir={two}",
        "train.batch_size=2",
        launcher=cpu_ddp_launcher(),
        extra_env={"ACCELERATE_USE_CPU": "true"},
    )
    assert json.loads((two / "config.resolved.json").read_text())["num_processes"] == 2
    assert f"2 {unit} x 2 micro-step(s) x 2 process(es) = 8 {unit}" in res.stdout + res.stderr
    if packed:
        assert "tree packing: 20 rows in 8 packs" in res.stdout + res.stderr
    for name in ("model.safetensors", "value_head.safetensors"):
        a, b = load_file(one / name), load_file(two / name)
        worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
        assert worst <= 1e-4, f"{name}: 2 ranks train other weights than 1 rank, by {worst}"
    loss = [r["loss"] for r in read_metrics(two, "train")]
    assert loss == pytest.approx([r["loss"] for r in read_metrics(one, "train")], abs=1e-4)


@pytest.mark.slow
def test_two_processes_with_a_row_count_that_used_to_starve_a_rank(tiny_models, tmp_path):
    # 9 rows, 2 processes x batch 4: the epoch's second global batch held 1 row, so rank 1 got an
    # empty list and collate_steps([]) failed. Now that batch repeats 7 rows from the epoch's start.
    train = write_toy_prm_data(tmp_path / "d", 9, 0)
    ev = write_toy_prm_data(tmp_path / "d", 3, 1, name="eval.jsonl")  # 3 eval rows on 2 ranks: 2 + 1 (+1 wrapped)
    out = tmp_path / "starve"
    launcher = cpu_ddp_launcher()
    res = run_recipe(
        "prm_train",
        *common(tiny_models("qwen2_vl"), train, ev, out, steps=4),
        launcher=launcher,
        extra_env={"ACCELERATE_USE_CPU": "true"},
    )
    assert json.loads((out / "config.resolved.json").read_text())["num_processes"] == 2
    assert "9 rows do not fill whole global batches of 8: each epoch's last batch repeats 7 rows" in res.stdout
    rows = read_metrics(out)
    assert [r["step"] for r in rows if r["split"] == "train"] == [1, 2, 3, 4]  # two full epochs
    assert all(math.isfinite(r["loss"]) for r in rows if r["split"] == "train")
    ev_rows = [r for r in rows if r["split"] == "eval"]
    assert ev_rows and math.isfinite(ev_rows[-1]["bce"])
    assert (out / "mmprm_prm.json").exists()


def test_bad_data_fails_before_training_with_row_named(tiny_models, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "x1", "question": "q", "steps": ["a", "b"], "labels": [1.0]}) + "\n")
    cmd = [
        sys.executable,
        str(RECIPE),
        f"model.name_or_path={tiny_models('qwen2')}",
        f"data.train_file={bad}",
        f"output_dir={tmp_path / 'o'}",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 2
    assert f"{bad}:1: id=x1: labels: 1 labels for 2 steps" in res.stderr
    assert not (tmp_path / "o" / "checkpoints").exists()


def test_a_missing_data_file_is_named_before_the_model_loads(tiny_models, tmp_path):
    cmd = [sys.executable, str(RECIPE), f"model.name_or_path={tiny_models('qwen2')}", "data.train_file=nope.jsonl"]
    res = subprocess.run([*cmd, f"output_dir={tmp_path / 'o'}"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 2 and "data.train_file: nope.jsonl does not exist (relative to" in res.stderr
    assert "Loading weights" not in res.stderr and not (tmp_path / "o").exists()


def test_images_for_a_text_only_model_fail_before_training(tiny_models, toy, tmp_path):
    train, _ = toy
    cmd = [
        sys.executable,
        str(RECIPE),
        f"model.name_or_path={tiny_models('qwen2')}",
        f"data.train_file={train}",
        f"output_dir={tmp_path / 'o'}",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 2 and "this model is text-only but 32 rows have images" in res.stderr


def test_unknown_config_key_is_a_clear_error(tmp_path):
    res = subprocess.run([sys.executable, str(RECIPE), "train.lrr=1"], capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 2 and "unknown key(s) train.lrr" in res.stderr
