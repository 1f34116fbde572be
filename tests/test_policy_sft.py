"""policy_sft: assistant-only loss masking token by token, the real entry point on two tiny
architectures, dropped-example accounting, exact resume, and format compliance after training."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
from ports import free_port
from recipe_runs import REPO, check_train_rows, cpu_ddp_launcher, read_metrics, run_recipe
from safetensors.torch import load_file

from mmprm.training.run import lr_factor

RECIPE = REPO / "recipes" / "policy_sft.py"
IGNORE = -100


def common(model, train, out, steps, ev=None):
    args = [
        f"model.name_or_path={model}",
        f"data.train_file={train}",
        f"output_dir={out}",
        f"train.max_steps={steps}",
        "train.lr=3e-3",
        "train.batch_size=4",
        "train.log_every=1",
        f"train.eval_every={steps}",
        f"train.save_every={steps}",
        "data.max_length=256",
        "train.report_to=none",
        "train.warmup_steps=0",
    ]
    if ev is not None:
        args.append(f"data.eval_file={ev}")
    return args


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """A small colour-tile split: (train_sft.jsonl, test_sft.jsonl)."""
    from mmprm.data.synthetic import cli_synthetic

    d = tmp_path_factory.mktemp("synthetic")
    assert cli_synthetic(["--out", str(d), "--train", "24", "--test", "8", "--seed", "0"]) == 0
    return d / "train_sft.jsonl", d / "test_sft.jsonl"


# ---- tokenization: which tokens carry loss --------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen2_vl", "internvl", "qwen2"])
def test_loss_mask_is_exactly_the_rendered_solution(tiny_models, synthetic, arch):
    from PIL import Image

    from mmprm.data.schema import load_examples
    from mmprm.models.loading import load_processor
    from mmprm.steps import prompt_text, render_solution
    from mmprm.training.data import tokenize_sft

    processor = load_processor(tiny_models(arch))
    tok = getattr(processor, "tokenizer", processor)
    ex = load_examples(synthetic[0])[0]
    if arch == "qwen2":  # text-only: the same row without its image
        ex.images = []
    system = "Solve step by step."

    images = [Image.open(p).convert("RGB") for p in ex.images]
    row = tokenize_sft(processor, ex.question, ex.steps, ex.answer, images, max_length=1024, system=system)

    # Expected: the prompt exactly as the processor expands it (image tokens included), then
    # the policy-format solution and EOS, tokenized on their own.
    prompt = prompt_text(processor, ex.question, len(ex.images), system)
    if images:
        prompt_ids = processor(text=[prompt], images=images, return_tensors="pt")["input_ids"][0].tolist()
    else:
        prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    solution = render_solution(ex.steps, ex.answer) + tok.eos_token
    solution_ids = tok(solution, add_special_tokens=False)["input_ids"]

    assert row["input_ids"] == prompt_ids + solution_ids
    assert row["labels"] == [IGNORE] * len(prompt_ids) + solution_ids
    assert row["labels"][-1] == tok.eos_token_id  # the model learns to stop
    assert tok.decode(row["input_ids"][len(prompt_ids) :]) == solution
    if images:  # every image token sits in the masked prompt
        image_positions = [i for i, t in enumerate(row["input_ids"]) if t == processor.image_token_id]
        assert image_positions and max(image_positions) < len(prompt_ids)
        assert "pixel_values" in row["extra"]

    # Truncation keeps the whole prompt and the first solution tokens, labels still aligned.
    cut = tokenize_sft(
        processor, ex.question, ex.steps, ex.answer, images, max_length=len(prompt_ids) + 3, system=system
    )
    assert cut["input_ids"] == prompt_ids + solution_ids[:3]
    assert cut["labels"] == [IGNORE] * len(prompt_ids) + solution_ids[:3]
    # No assistant token left -> dropped (None), never a row with zero loss tokens.
    assert (
        tokenize_sft(processor, ex.question, ex.steps, ex.answer, images, max_length=len(prompt_ids), system=system)
        is None
    )


def test_collate_pads_labels_with_ignore(tiny_models, synthetic):
    from mmprm.data.schema import load_examples, load_image
    from mmprm.models.loading import load_processor
    from mmprm.training.data import collate_sft, tokenize_sft

    processor = load_processor(tiny_models("qwen2_vl"))
    rows = [
        tokenize_sft(processor, ex.question, ex.steps, ex.answer, [load_image(p) for p in ex.images], 1024)
        for ex in load_examples(synthetic[0])[:3]
    ]
    batch = collate_sft(rows, pad_id=processor.tokenizer.pad_token_id)
    width = max(len(r["input_ids"]) for r in rows)
    assert batch["input_ids"].shape == batch["labels"].shape == (3, width)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        assert batch["labels"][i, :n].tolist() == r["labels"]
        assert (batch["labels"][i, n:] == IGNORE).all() and (batch["attention_mask"][i, n:] == 0).all()
        assert batch["attention_mask"][i, :n].sum() == n


# ---- the real entry point ---------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen2_vl", "internvl"])
def test_recipe_trains_saves_and_reloads(tiny_models, synthetic, tmp_path, arch):
    from mmprm.models.loading import load_backbone

    train, ev = synthetic
    rows = [json.loads(line) for line in open(train)]
    # One question longer than max_length: truncation would leave no assistant token at all, so
    # the row must be dropped and counted, not trained on with zero loss tokens.
    long_row = {
        **rows[0],
        "id": "too-long",
        "question": "Add the tiles. " + " ".join(["Note the colour of every tile carefully."] * 60),
    }
    data = train.parent / "train_with_long.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows + [long_row]))
    out = tmp_path / arch
    res = run_recipe(
        "policy_sft",
        *common(tiny_models(arch), data, out, steps=6, ev=ev),
        "train.eval_generations=2",
        "train.max_new_tokens=8",
        "train.eval_batch_size=2",
        "train.peak_tflops=1.5",
    )
    assert (
        f"train: {len(rows)} examples kept, 1 dropped (no assistant token left within max_length=256)" in res.stdout
    ), res.stdout[-2000:]
    rows = read_metrics(out)
    train_rows = [r for r in rows if r["split"] == "train"]
    eval_rows = [r for r in rows if r["split"] == "eval"]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(r["loss"]) for r in train_rows)
    check_train_rows(train_rows, mfu=True)
    # The logged LR is the one the next step uses: peak x the cosine factor of the step count.
    assert [r["lr"] for r in train_rows] == pytest.approx([3e-3 * lr_factor(s, 0, 6, "cosine") for s in range(1, 7)])
    # At lr 3e-3 six steps move a random-init model well off its ~ln(vocab) starting loss.
    assert eval_rows[-1]["loss"] < eval_rows[0]["loss"] - 1.0, eval_rows
    assert [r["step"] for r in eval_rows] == [0, 6]
    assert {"format_compliance", "answer_accuracy"} <= set(eval_rows[-1]) and eval_rows[-1]["generated"] == 2
    assert (out / "checkpoints" / "step_6").is_dir() and (out / "config.resolved.json").exists()
    model, _ = load_backbone(out)  # a standard HF directory, loaded like the base model
    assert type(model).__name__ == type(load_backbone(tiny_models(arch))[0]).__name__


def test_missing_answer_fails_before_training_naming_the_row(tiny_models, synthetic, tmp_path):
    train, _ = synthetic
    rows = [json.loads(line) for line in open(train)][:3]
    del rows[1]["answer"]
    bad = train.parent / "no_answer.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = [
        sys.executable,
        str(RECIPE),
        f"model.name_or_path={tiny_models('qwen2')}",
        f"data.train_file={bad}",
        f"output_dir={tmp_path / 'o'}",
        "train.report_to=none",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 2, res.stderr[-3000:]
    assert f"id={rows[1]['id']}: answer: missing" in res.stderr and str(bad) in res.stderr
    assert not (tmp_path / "o" / "checkpoints").exists()
    # an eval file that is not there is named before the model loads
    res = subprocess.run([*cmd, f"data.eval_file={tmp_path}"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 2 and f"data.eval_file: {tmp_path} is a directory; a JSONL file" in res.stderr
    assert "Loading weights" not in res.stderr


@pytest.mark.slow
def test_exact_resume_matches_straight_run(tiny_models, synthetic, tmp_path):
    train, _ = synthetic
    model = tiny_models("qwen2_vl")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    # grad_accum and warmup put the batch stream and the scheduler in the resumed state too.
    extra = ["train.save_every=100", "train.warmup_steps=3", "train.grad_accum=2"]
    run_recipe("policy_sft", *common(model, train, straight, steps=8), *extra)
    run_recipe("policy_sft", *common(model, train, resumed, steps=8), *extra, "train.stop_at_step=4")
    assert not (resumed / "model.safetensors").exists() and (resumed / "checkpoints" / "step_4").is_dir()
    res = run_recipe(
        "policy_sft", *common(model, train, resumed, steps=8), *extra, "resume_from_checkpoint=latest",
        "train.keep_checkpoints=1",
    )  # fmt: skip
    assert "resumed from" in res.stdout and "at step 4" in res.stdout
    # keep_checkpoints=1: the final checkpoint replaced the one the run resumed from
    assert [p.name for p in (resumed / "checkpoints").iterdir()] == ["step_8"]
    a, b = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys()
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst <= 1e-6, f"resumed run differs from straight run by {worst}"
    # The resumed run logs steps 5..8 only, with the straight run's losses.
    losses = {r["step"]: r["loss"] for r in read_metrics(straight, "train")}
    again = {r["step"]: r["loss"] for r in read_metrics(resumed, "train")}
    assert sorted(again) == list(range(1, 9))
    assert all(abs(again[s] - losses[s]) <= 1e-5 for s in range(5, 9)), (losses, again)


@pytest.mark.slow
def test_two_process_ddp_keeps_the_lr_schedule(tiny_models, synthetic, tmp_path):
    # accelerate steps a prepared scheduler once per process by default: on 2 processes the
    # cosine would reach 0 at half of max_steps. The recipe steps it once per optimizer step.
    train, _ = synthetic
    out = tmp_path / "ddp"
    # torchrun + ACCELERATE_USE_CPU gives real 2-process gloo DDP on CPU; `accelerate launch
    # --multi_gpu` without GPUs would start two independent single-process runs instead.
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(RECIPE),
    ]
    cmd = launcher + common(tiny_models("qwen2_vl"), train, out, steps=4) + ["train.batch_size=2", "train.grad_accum=2"]
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "ACCELERATE_USE_CPU": "true",
    }
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    rows = read_metrics(out, "train")
    assert [r["lr"] for r in rows] == pytest.approx([3e-3 * lr_factor(s, 0, 4, "cosine") for s in range(1, 5)]), (
        rows,
        res.stdout[-3000:],
    )
    assert (out / "model.safetensors").exists()


def write_uneven_sft_data(train):
    """The synthetic rows cut to 1 to 4 steps, so the ranks of a global batch get rows of unequal
    assistant-token counts (written beside `train`, whose image paths are relative)."""
    out = train.parent / "uneven_sft.jsonl"
    rows = [json.loads(line) for line in open(train)]
    rows = [{**r, "steps": r["steps"][: i % 4 + 1]} for i, r in enumerate(rows)]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


@pytest.mark.slow
def test_two_processes_train_the_weights_of_one_on_the_same_global_batch(tiny_models, synthetic, tmp_path):
    """An assistant token weighs the same whichever rank runs it: 2 ranks of batch 2 with rows of
    unequal target-token counts train the weights of 1 rank of batch 4, accumulation included."""
    train = write_uneven_sft_data(synthetic[0])
    one, two = tmp_path / "one", tmp_path / "two"
    # group_by_length would sort the batch so that the strided shares hold similar lengths
    args = [*common(tiny_models("qwen2_vl"), train, one, steps=3), "train.grad_accum=2", "train.group_by_length=false"]
    run_recipe("policy_sft", *args, "train.batch_size=4")
    run_recipe(
        "policy_sft",
        *args,
        f"output_dir={two}",
        "train.batch_size=2",
        launcher=cpu_ddp_launcher(),
        extra_env={"ACCELERATE_USE_CPU": "true"},
    )
    assert json.loads((two / "config.resolved.json").read_text())["num_processes"] == 2
    a, b = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst <= 1e-4, f"2 ranks train other weights than 1 rank, by {worst}"
    loss = [r["loss"] for r in read_metrics(two, "train")]
    assert loss == pytest.approx([r["loss"] for r in read_metrics(one, "train")], abs=1e-4)


@pytest.mark.slow
def test_chunked_loss_under_ddp_trains_the_weights_of_full_logits(tiny_models, synthetic, tmp_path):
    """train.loss_chunk_tokens=16 calls the LM head outside DDP's forward, 16 tokens at a time and
    again in backward: 2 DDP ranks train the weights 1 rank trains with full logits."""
    train = write_uneven_sft_data(synthetic[0])
    full, chunked = tmp_path / "full", tmp_path / "chunked"
    args = [*common(tiny_models("qwen2_vl"), train, full, steps=3), "train.group_by_length=false"]
    run_recipe("policy_sft", *args, "train.batch_size=4")
    run_recipe(
        "policy_sft",
        *args,
        f"output_dir={chunked}",
        "train.batch_size=2",
        "train.loss_chunk_tokens=16",
        launcher=cpu_ddp_launcher(),
        extra_env={"ACCELERATE_USE_CPU": "true"},
    )
    a, b = load_file(full / "model.safetensors"), load_file(chunked / "model.safetensors")
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst <= 1e-4, f"the chunked loss under DDP trains other weights, by {worst}"


def test_demo_size_tiny_model(tmp_path):
    """The wider preset the slow test and the demo train: same class and tokenizer, 16-dim heads."""
    from mmprm.models.tiny import build_tiny_model

    path = build_tiny_model("qwen2_vl", tmp_path / "wide", seed=0, hidden_size=128, num_layers=3)
    text = json.loads((path / "config.json").read_text())["text_config"]
    assert (text["hidden_size"], text["num_hidden_layers"], text["num_attention_heads"]) == (128, 3, 8)
    for bad in ({"hidden_size": 100}, {"num_layers": 0}):
        with pytest.raises(ValueError, match="tiny"):
            build_tiny_model("qwen2", tmp_path / "bad", **bad)


# ---- what SFT is for: the policy learns the step format -----------------------------------------


@pytest.mark.slow
def test_format_compliance_rises_after_short_training(tmp_path):
    """A 128-wide tiny Qwen2-VL, 150 CPU steps on 200 colour-tile problems.

    Measured when written: format compliance 0.000 at step 0 -> 0.875 at step 150 (32 greedy
    generations, 128 new tokens; eval loss 6.99 -> 0.43). At 100 steps it was only 0.50.
    """
    from mmprm.data.synthetic import cli_synthetic
    from mmprm.models.tiny import build_tiny_model

    data = tmp_path / "data"
    assert cli_synthetic(["--out", str(data), "--train", "200", "--test", "32", "--seed", "0"]) == 0
    model = build_tiny_model("qwen2_vl", tmp_path / "model", seed=0, hidden_size=128)
    out = tmp_path / "run"
    run_recipe(
        "policy_sft",
        *common(model, data / "train_sft.jsonl", out, steps=150, ev=data / "test_sft.jsonl"),
        "train.batch_size=16",
        "train.warmup_steps=5",
        "train.log_every=10",
        "train.eval_generations=32",
        "train.max_new_tokens=128",
        "train.eval_batch_size=16",
    )
    evals = read_metrics(out, "eval")
    before, after = evals[0], evals[-1]
    assert before["step"] == 0 and after["step"] == 150 and after["generated"] == 32
    print(
        f"format compliance {before['format_compliance']:.3f} -> {after['format_compliance']:.3f}, "
        f"eval loss {before['loss']:.3f} -> {after['loss']:.3f}"
    )
    assert before["format_compliance"] <= 0.1
    assert after["format_compliance"] >= 0.5
    assert after["loss"] < before["loss"] / 5


# ---- the prompt format travels with the policy -------------------------------------------------


def _recipe_module(name):
    spec = importlib.util.spec_from_file_location(f"{name}_recipe_for_spec", REPO / "recipes" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_annotation_and_generation_prompt_the_policy_exactly_as_sft_trained_it(tiny_models, synthetic, tmp_path):
    """SFT with a system prompt -> mmprm_policy.json -> annotation's and Best-of-N's backends send
    the very prompt tokens SFT trained on, with no system prompt or step mode in their configs."""
    from mmprm.config import load_config
    from mmprm.data.schema import load_examples, load_image
    from mmprm.generation.base import RolloutRequest
    from mmprm.models.loading import load_processor

    train, _ = synthetic
    out = tmp_path / "policy"
    system = "You are a careful tile counter. Write one step per tile."
    run_recipe("policy_sft", *common(tiny_models("qwen2_vl"), train, out, steps=1), f"model.system_prompt={system}")
    spec = json.loads((out / "mmprm_policy.json").read_text())
    assert spec == {"format": "mmprm-policy", "version": 1, "system_prompt": system, "step_mode": "tags"}

    processor = load_processor(out)
    ex = load_examples(train)[0]
    from mmprm.training.data import IGNORE, tokenize_sft

    row = tokenize_sft(processor, ex.question, ex.steps, ex.answer, [load_image(p) for p in ex.images], 4096, system)
    n_prompt = next(i for i, label in enumerate(row["labels"]) if label != IGNORE)
    sft_prompt = row["input_ids"][:n_prompt]

    def sent_ids(backend):
        text, images = backend._prompt(0, RolloutRequest(ex.id, ex.question, ex.images, [], 1))
        assert len(images) == len(ex.images) == 1
        enc = processor(text=[text], images=[load_image(p) for p in ex.images], return_tensors="pt")
        return enc["input_ids"][0].tolist()

    mcts = _recipe_module("mcts_annotate")
    cfg = load_config(
        mcts.AnnotateConfig, REPO / "recipes" / "configs" / "tiny" / "mcts_annotate.yaml", [f"policy.path={out}"]
    )
    assert cfg.policy.system_prompt is None and cfg.policy.step_mode is None  # nothing said in the config
    backend = cfg.policy.build(sampling=mcts.rank_sampling(cfg, 0))  # as mcts_annotate builds it
    assert backend.step_mode == "tags" and backend.system == system
    assert sent_ids(backend) == sft_prompt

    bon = _recipe_module("bon_rerank")
    cfg = load_config(
        bon.BonRerankConfig,
        REPO / "recipes" / "configs" / "tiny" / "bon_rerank.yaml",
        ["generate.enabled=true", f"policy.path={out}", f"generate.problems_file={train}"],
    )
    backend = cfg.policy.build(sampling=cfg.policy.sampling_for(cfg.shard.index))  # as bon_rerank builds it
    assert backend.step_mode == "tags" and sent_ids(backend) == sft_prompt

    # A config that does say something wins, with a warning naming the saved value.
    cfg = load_config(
        mcts.AnnotateConfig,
        REPO / "recipes" / "configs" / "tiny" / "mcts_annotate.yaml",
        [f"policy.path={out}", "policy.system_prompt=Be brief."],
    )
    with pytest.warns(UserWarning, match="overrides 'You are a careful tile counter"):
        assert cfg.policy.build(sampling=mcts.rank_sampling(cfg, 0)).system == "Be brief."
