"""DeepSpeed ZeRO-2/3 for real: prm_train and policy_sft through `accelerate launch` with the shipped
launch/accelerate/deepspeed_zero{2,3}.yaml, 1 and 2 CPU processes (gloo), plus resume and bf16.

The model is the tiny qwen2_vl at hidden 128: its embeddings and LM head (1025 x 128 = 131,200
elements with the step token) pass ZeRO-3's `stage3_param_persistence_threshold` (1e5), so they
are really partitioned - each of 2 ranks holds 65,600 elements of each. Two processes are one
group: `mmprm.training.run.process_group_kwargs` names gloo, without which accelerate starts two
separate one-rank DeepSpeed runs on a machine without GPUs.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import pytest
import torch
from ports import free_port
from recipe_runs import REPO, read_metrics, run_recipe
from safetensors.torch import load_file
from toy_data import write_toy_prm_data, write_uneven_tree_data

pytestmark = pytest.mark.slow
pytest.importorskip("deepspeed")

EMBED = "backbone.model.language_model.embed_tokens.weight"
LM_HEAD = "backbone.lm_head.weight"


def launch(
    recipe: str,
    stage: int,
    processes: int,
    *overrides: str,
    bf16: bool = False,
    config_file: Path | None = None,
    timeout: int = 900,
) -> str:
    """`accelerate launch --config_file launch/accelerate/deepspeed_zeroN.yaml` as a user types it
    (or `config_file`)."""
    launcher = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(config_file or f"launch/accelerate/deepspeed_zero{stage}.yaml"),
        "--num_processes", str(processes),
        "--main_process_port", str(free_port()),
        "--mixed_precision", "bf16" if bf16 else "no",
        "--dynamo_backend", "no",
    ]  # fmt: skip
    t0 = time.time()
    # ACCELERATE_USE_CPU (set for the DDP tests on CPU) turns DeepSpeed off: these runs need it off
    res = run_recipe(recipe, *overrides, launcher=launcher, timeout=timeout, extra_env={"ACCELERATE_USE_CPU": "false"})
    print(f"\n[{recipe} zero{stage} x{processes}{' bf16' if bf16 else ''}] {time.time() - t0:.1f}s")
    return res.stdout + res.stderr


def check_partitions(out: Path, stage: int, processes: int, names: list[str], numel: int) -> None:
    """ZeRO-3 really partitioned the embeddings and the LM head; ZeRO-2 keeps whole weights."""
    report = out / "zero3_partitions.json"
    if stage == 2:
        assert not report.exists()
        return
    data = json.loads(report.read_text())
    assert data["num_processes"] == processes
    by_name = {r["name"]: r for r in data["parameters"]}
    for name in names:
        r = by_name[name]
        assert r["partitioned"] and r["numel"] == numel, r
        assert r["local_numel"] == math.ceil(numel / processes), r
        print(f"  {name} {r['shape']}: {r['local_numel']} of {r['numel']} on rank 0")


@pytest.fixture(scope="module")
def model_128(tmp_path_factory) -> Path:
    from mmprm.models.tiny import build_tiny_model

    return build_tiny_model("qwen2_vl", tmp_path_factory.mktemp("qwen2_vl_128"), seed=0, hidden_size=128)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    d = tmp_path_factory.mktemp("toy")
    # 9 eval rows over 2 ranks with eval batches of 4: rank 0 has 2 batches, rank 1 only 1 - under
    # ZeRO-3 the ranks must still run the same number of forwards.
    return write_toy_prm_data(d, 32, 0), write_toy_prm_data(d, 9, 1, name="eval.jsonl")


def prm_args(model: Path, toy, out: Path, steps: int) -> list[str]:
    train, ev = toy
    return [
        f"model.name_or_path={model}",
        f"data.train_file={train}",
        f"data.eval_file={ev}",
        f"output_dir={out}",
        f"train.max_steps={steps}",
        "train.lr=1e-3",
        "train.batch_size=4",
        "train.log_every=1",
        f"train.eval_every={steps}",
        f"train.save_every={steps}",
        "train.eval_batch_size=4",
        "data.max_length=256",
        "train.report_to=none",
        "train.warmup_steps=0",
    ]


def round_trip_diff(out: Path, eval_file: Path, dtype: torch.dtype | None = None) -> float:
    """Largest |score| difference between the in-memory model's last eval and `load_prm(out)`."""
    import mmprm
    from mmprm.data.schema import load_examples

    lines = (out / "eval_predictions.jsonl").read_text().splitlines()
    predictions = {r["id"]: r["scores"] for r in map(json.loads, lines)}
    examples = load_examples(eval_file)
    assert sorted(predictions) == sorted(e.id for e in examples)  # each row once, none from padding
    scored = mmprm.load_prm(out, dtype=dtype).score(examples)
    return max(abs(a - b) for e, s in zip(examples, scored) for a, b in zip(s, predictions[e.id]))


@pytest.mark.parametrize("stage,processes", [(2, 1), (2, 2), (3, 1), (3, 2)])
def test_prm_train_under_deepspeed(model_128, toy, tmp_path, stage, processes):
    out = tmp_path / "prm"
    log = launch("prm_train", stage, processes, *prm_args(model_128, toy, out, steps=12))
    assert json.loads((out / "config.resolved.json").read_text())["num_processes"] == processes
    train = read_metrics(out, "train")
    first, last = sum(r["loss"] for r in train[:4]) / 4, sum(r["loss"] for r in train[-4:]) / 4
    print(f"  loss {first:.4f} -> {last:.4f}")
    assert last < first, f"loss did not go down ({first:.4f} -> {last:.4f})"
    # clip_grad_norm_ does not clip under DeepSpeed: the engine's own global norm is logged
    assert all(r["grad_norm"] is not None and r["grad_norm"] > 0 for r in train), train
    check_partitions(out, stage, processes, [EMBED, LM_HEAD], 1025 * 128)
    if stage == 3:
        assert "ZeRO-3: " in log and f"{LM_HEAD} [1025, 128]" in log
    # the saved PRM scores the eval rows exactly as the trained model did in memory
    diff = round_trip_diff(out, toy[1])
    print(f"  load_prm round trip max |diff| = {diff:.2e}")
    assert diff <= 1e-5


def test_tree_packed_prm_train_under_zero3_two_processes(model_128, toy, tmp_path):
    """Packed batches under ZeRO-3: the tree mask, the M-RoPE positions and the row-count weights
    with every weight partitioned over two ranks."""
    train, ev = toy
    rows = []
    for r in map(json.loads, train.read_text().splitlines()):  # each problem a small tree: the row and its prefix
        rows += [r, {**r, "id": r["id"] + "/prefix", "steps": r["steps"][:1], "labels": r["labels"][:1]}]
    tree = tmp_path / "tree.jsonl"
    tree.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for image in {i for r in rows for i in r["images"]}:  # image paths are relative to the data file
        (tmp_path / image).write_bytes((train.parent / image).read_bytes())
    out = tmp_path / "prm"
    log = launch(
        "prm_train", 3, 2, *prm_args(model_128, (tree, ev), out, steps=12), "data.pack_trees=true", "train.batch_size=2"
    )
    assert "tree packing: 64 rows in 32 packs" in log
    train_rows = read_metrics(out, "train")
    first, last = sum(r["loss"] for r in train_rows[:4]) / 4, sum(r["loss"] for r in train_rows[-4:]) / 4
    assert last < first, f"loss did not go down ({first:.4f} -> {last:.4f})"
    check_partitions(out, 3, 2, [EMBED, LM_HEAD], 1025 * 128)
    assert round_trip_diff(out, ev) <= 1e-5


def zero3_partitioning_everything(folder: Path) -> Path:
    """launch/accelerate/deepspeed_zero3.yaml with stage3_param_persistence_threshold 0: every
    weight is partitioned, the 128 x 128 projections and LoRA adapters of the tiny model too."""
    ds = json.loads((REPO / "launch" / "deepspeed" / "zero3.json").read_text())
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    (folder / "zero3.json").write_text(json.dumps(ds))
    shipped = (REPO / "launch" / "accelerate" / "deepspeed_zero3.yaml").read_text()
    assert "launch/deepspeed/zero3.json" in shipped and "zero3_init_flag: true" in shipped
    config = folder / "deepspeed_zero3.yaml"
    config.write_text(shipped.replace("launch/deepspeed/zero3.json", str(folder / "zero3.json")))
    return config


def test_lora_prm_train_under_zero3_two_processes_saves_what_it_trained(model_128, toy, tmp_path):
    """The final save merges LoRA into weights that ZeRO-3 holds in slices over two ranks: the
    saved PRM scores the eval rows as the trained model did in memory, and its merged
    projections are the base weights plus the trained adapters."""
    out = tmp_path / "prm"
    lora = ["model.lora.enabled=true", "model.lora.r=4", "model.lora.alpha=8", "model.lora.dropout=0"]
    launch(
        "prm_train", 3, 2, *prm_args(model_128, toy, out, steps=12), *lora,
        config_file=zero3_partitioning_everything(tmp_path),
    )  # fmt: skip
    q_proj = "backbone.base_model.model.model.language_model.layers.0.self_attn.q_proj"
    check_partitions(out, 3, 2, [f"{q_proj}.base_layer.weight"], 128 * 128)
    check_partitions(out, 3, 2, [f"{q_proj}.lora_A.default.weight"], 4 * 128)
    saved = load_file(out / "model.safetensors")
    start = load_file(model_128 / "model.safetensors")
    weight = "model.layers.0.self_attn.q_proj.weight"  # the checkpoint layout transformers saves
    assert saved[weight].shape == start[weight].shape == (128, 128)
    assert (saved[weight] - start[weight]).abs().max() > 0  # the adapters were merged in
    diff = round_trip_diff(out, toy[1])
    print(f"  LoRA load_prm round trip max |diff| = {diff:.2e}")
    assert diff <= 1e-5


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    from mmprm.data.synthetic import cli_synthetic

    d = tmp_path_factory.mktemp("sft")
    assert cli_synthetic(["--out", str(d), "--train", "24", "--test", "9", "--seed", "0"]) == 0
    return d / "train_sft.jsonl", d / "test_sft.jsonl"


def sft_args(model: Path, sft_data, out: Path, steps: int) -> list[str]:
    train, ev = sft_data
    return [
        f"model.name_or_path={model}",
        f"data.train_file={train}",
        f"data.eval_file={ev}",
        f"output_dir={out}",
        f"train.max_steps={steps}",
        "train.lr=3e-3",
        "train.batch_size=4",
        "train.log_every=1",
        f"train.eval_every={steps}",
        f"train.save_every={steps}",
        "train.eval_batch_size=4",
        "data.max_length=256",
        "train.report_to=none",
    ]


@pytest.mark.parametrize("stage,processes", [(2, 1), (2, 2), (3, 1), (3, 2)])
def test_policy_sft_under_deepspeed(model_128, sft_data, tmp_path, stage, processes):
    from mmprm.models.loading import load_backbone

    out = tmp_path / "policy"
    # 9 eval rows, batches of 4: uneven over 2 ranks for the eval loss and for generation alike
    launch(
        "policy_sft", stage, processes, *sft_args(model_128, sft_data, out, steps=8),
        "train.eval_generations=9", "train.max_new_tokens=8",
    )  # fmt: skip
    evals = read_metrics(out, "eval")
    print(f"  eval loss {evals[0]['loss']:.4f} -> {evals[-1]['loss']:.4f}")
    assert evals[-1]["loss"] < evals[0]["loss"] and evals[-1]["generated"] == 9
    check_partitions(out, stage, processes, ["model.language_model.embed_tokens.weight", "lm_head.weight"], 1024 * 128)
    model, _ = load_backbone(out)  # whole weights were gathered for the save
    assert model.get_input_embeddings().weight.shape == (1024, 128)
    start, _ = load_backbone(model_128)
    moved = (model.lm_head.weight - start.lm_head.weight).abs().max().item()
    assert moved > 0


def saved_policy_eval_loss(out: Path, eval_file: Path) -> float:
    """The mean token loss of the policy saved in `out` on `eval_file`, by policy_sft's own
    `eval_loss` on one process."""
    import importlib.util
    from types import SimpleNamespace

    from mmprm.models.loading import load_backbone
    from mmprm.training.data import SFTCollator, load_tokenized
    from mmprm.training.vision_sync import no_vision_sync

    spec = importlib.util.spec_from_file_location("policy_sft_recipe", REPO / "recipes" / "policy_sft.py")
    recipe = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
    spec.loader.exec_module(recipe)
    model, processor = load_backbone(out)
    settings = {"max_length": 256, "system": None}  # what sft_args trains with
    data, _ = load_tokenized(eval_file, "sft", processor, settings)
    collate = SFTCollator(data, processor, processor.tokenizer.pad_token_id, **settings)
    one_process = SimpleNamespace(process_index=0, num_processes=1, device=torch.device("cpu"), reduce=lambda t, _: t)
    return recipe.eval_loss(model, collate, 4, one_process, no_vision_sync)


def test_lora_policy_sft_under_zero3_two_processes_saves_what_it_trained(model_128, sft_data, tmp_path):
    """The final save merges LoRA into weights that ZeRO-3 holds in slices over two ranks: the
    saved policy has whole weights, the adapters merged in, and the eval loss the trained model
    had in memory."""
    out = tmp_path / "policy"
    lora = ["model.lora.enabled=true", "model.lora.r=4", "model.lora.alpha=8", "model.lora.dropout=0"]
    launch(
        "policy_sft", 3, 2, *sft_args(model_128, sft_data, out, steps=8), *lora, "train.eval_generations=0",
        config_file=zero3_partitioning_everything(tmp_path),
    )  # fmt: skip
    q_proj = "base_model.model.model.language_model.layers.0.self_attn.q_proj"
    check_partitions(out, 3, 2, [f"{q_proj}.base_layer.weight"], 128 * 128)
    check_partitions(out, 3, 2, [f"{q_proj}.lora_A.default.weight"], 4 * 128)
    saved = load_file(out / "model.safetensors")
    start = load_file(model_128 / "model.safetensors")
    assert saved.keys() == start.keys()
    assert all(saved[k].shape == start[k].shape for k in start)
    weight = "model.layers.0.self_attn.q_proj.weight"  # the checkpoint layout transformers saves
    assert (saved[weight] - start[weight]).abs().max() > 0  # the adapters were merged in
    evals = read_metrics(out, "eval")
    assert abs(evals[-1]["loss"] - evals[0]["loss"]) > 1e-2  # the adapters move the loss
    loss = saved_policy_eval_loss(out, sft_data[1])
    print(f"  eval loss in memory {evals[-1]['loss']:.6f}, saved policy {loss:.6f}")
    assert loss == pytest.approx(evals[-1]["loss"], abs=1e-5)


def test_zero2_resume_continues_exactly(model_128, toy, tmp_path):
    """Stop at step 6 of 12 and resume: the same weights as the straight run (tolerance of the
    plain-DDP resume test in test_prm_train.py)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    extra = ["train.save_every=100", "train.warmup_steps=3", "train.grad_accum=2", "data.eval_file=null"]
    launch("prm_train", 2, 2, *prm_args(model_128, toy, straight, steps=12), *extra)
    launch("prm_train", 2, 2, *prm_args(model_128, toy, resumed, steps=12), *extra, "train.stop_at_step=6")
    assert not (resumed / "model.safetensors").exists()
    launch("prm_train", 2, 2, *prm_args(model_128, toy, resumed, steps=12), *extra, "resume_from_checkpoint=latest")
    a, b = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys()
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    print(f"  resumed vs straight max |diff| = {worst:.2e}")
    assert worst <= 1e-6, f"resumed run differs from straight run by {worst}"


def test_zero2_two_processes_train_the_weights_of_one_on_the_same_global_batch(model_128, tmp_path):
    """DeepSpeed averages the ranks' gradients as DDP does: 2 ranks of batch 2, with packs of
    unequal step counts, train the weights of 1 rank of batch 4 (test_prm_train.py has the DDP run)."""
    train = write_uneven_tree_data(tmp_path / "toy", 8)
    one, two = tmp_path / "one", tmp_path / "two"
    args = [*prm_args(model_128, (train, "null"), one, steps=3), "prm.head=value", "data.pack_trees=true"]
    args += ["train.grad_accum=2", "train.group_by_length=false"]  # see test_prm_train.py
    launch("prm_train", 2, 1, *args, "train.batch_size=4")
    launch("prm_train", 2, 2, *args, f"output_dir={two}", "train.batch_size=2")
    for name in ("model.safetensors", "value_head.safetensors"):
        a, b = load_file(one / name), load_file(two / name)
        worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
        print(f"  {name}: 2 ranks vs 1 max |diff| = {worst:.2e}")
        assert worst <= 1e-4, f"{name}: 2 ranks train other weights than 1 rank, by {worst}"


def test_bf16_prm_train_zero2(model_128, toy, tmp_path):
    """The dtype path of every GPU run (bf16 weights, bf16 autocast, DeepSpeed bf16) on CPU."""
    out = tmp_path / "bf16"
    launch(
        "prm_train",
        2,
        1,
        *prm_args(model_128, toy, out, steps=12),
        "model.dtype=bfloat16",
        "train.bf16=true",
        bf16=True,
    )
    train = read_metrics(out, "train")
    first, last = sum(r["loss"] for r in train[:4]) / 4, sum(r["loss"] for r in train[-4:]) / 4
    print(f"  bf16 loss {first:.4f} -> {last:.4f}")
    assert all(math.isfinite(r["loss"]) for r in train) and last < first
    assert load_file(out / "model.safetensors")["lm_head.weight"].dtype == torch.bfloat16
    diff = round_trip_diff(out, toy[1], dtype=torch.bfloat16)
    print(f"  bf16 load_prm round trip max |diff| = {diff:.2e}")
    assert diff <= 1e-2  # same bf16 weights; CPU bf16 kernels may round differently per batch shape


def mix_text_only_rows(src: Path, dest: Path) -> Path:
    """SRC with every second row's images removed (text-only), beside SRC's images."""
    rows = [json.loads(line) for line in src.read_text().splitlines()]
    dest.write_text(
        "".join(json.dumps({**r, "images": [] if i % 2 else r["images"]}) + "\n" for i, r in enumerate(rows))
    )
    return dest


# Batches of 1 row per rank: a step where one rank's row has an image and the other's has none.
# Before mmprm.training.vision_sync, gloo aborted at the first such step ("Received data size doesn't
# match") and NCCL hangs; the timeout turns a hang into a failure.
MIXED = ["train.batch_size=1", "train.eval_batch_size=1", "train.group_by_length=false"]
VISUAL_PATCH = "model.visual.patch_embed.proj.weight"


def test_prm_train_under_zero3_mixes_text_only_and_image_rows(model_128, toy, tmp_path):
    train, ev = (mix_text_only_rows(f, f.with_name(f"mixed_{f.name}")) for f in toy)
    out = tmp_path / "prm"
    log = launch(
        "prm_train", 3, 2, *prm_args(model_128, (train, ev), out, steps=8), *MIXED, "train.eval_every=4",
        "model.freeze_vision_tower=false", config_file=zero3_partitioning_everything(tmp_path), timeout=300,
    )  # fmt: skip
    assert "step 8 eval:" in log
    check_partitions(out, 3, 2, [f"backbone.{VISUAL_PATCH}"], 32 * 3 * 2 * 14 * 14)  # the tower is sharded
    assert all(math.isfinite(r["loss"]) for r in read_metrics(out, "train"))
    assert round_trip_diff(out, ev) <= 1e-5


def test_policy_sft_under_zero3_mixes_text_only_and_image_rows(model_128, sft_data, tmp_path):
    """Training, the eval loss and generation (transformers encodes images before the prefill)."""
    train, ev = (mix_text_only_rows(f, f.with_name(f"mixed_{f.name}")) for f in sft_data)
    out = tmp_path / "policy"
    launch(
        "policy_sft", 3, 2, *sft_args(model_128, (train, ev), out, steps=4), *MIXED, "train.eval_every=2",
        "train.eval_generations=4", "train.max_new_tokens=4",
        config_file=zero3_partitioning_everything(tmp_path), timeout=300,
    )  # fmt: skip
    check_partitions(out, 3, 2, [VISUAL_PATCH], 32 * 3 * 2 * 14 * 14)
    evals = read_metrics(out, "eval")
    assert [r["step"] for r in evals] == [0, 2, 4] and all(r["generated"] == 4 for r in evals)
