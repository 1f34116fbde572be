"""`train.compile` / `load_prm(compile=True)`: each decoder layer compiled gives the loss, gradients
and scores of the eager model, and leaves checkpoints as they were.

The default tier compiles with the "aot_eager" backend (dynamo's graph capture and AOTAutograd's
backward, no kernel generation: seconds); the slow tier runs inductor, as `train.compile` does.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest
import torch
from PIL import Image
from recipe_runs import run_recipe, short_train_args
from toy_data import write_toy_prm_data

from mmprm.models.compile_layers import compile_decoder_layers, decoder_layers
from mmprm.models.loading import VISION_TOWER_PATTERN, load_backbone
from mmprm.models.prm import PRMScorer, PRMSpec, build_prm, load_prm, model_input_keys, save_prm
from mmprm.models.tiny import TINY_ARCHS
from mmprm.scoring.losses import soft_ce_token_pair
from mmprm.steps import tokenize_steps
from mmprm.training.collate import collate_steps
from mmprm.training.data import collate_sft, tokenize_sft
from mmprm.training.lm_loss import next_token_loss_sum
from mmprm.training.run import LoraConfig, TrainModelConfig, adapt_backbone

FAST = "qwen2"  # the default tier's arch (text-only: the fastest to trace); the VL archs are slow-tier
ARCH_PARAMS = [
    pytest.param(arch, "aot_eager" if arch == FAST else "inductor", marks=() if arch == FAST else pytest.mark.slow)
    for arch in TINY_ARCHS
]


def _images(arch: str) -> list:
    return [] if arch == "qwen2" else [Image.new("RGB", (28, 28), (200, 30, 30))]


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch, so that its graph count is its own."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


def _assert_same(eager: list, compiled: list) -> None:
    for (loss_e, grads_e), (loss_c, grads_c) in zip(eager, compiled, strict=True):
        assert abs(loss_e - loss_c) <= 1e-5, (loss_e, loss_c)
        assert grads_e.keys() == grads_c.keys() and grads_e
        for name, g in grads_e.items():
            assert torch.allclose(g, grads_c[name], atol=1e-5, rtol=1e-4), name


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_decoder_layers_are_the_language_models_own(tiny_models, arch):
    backbone, processor = load_backbone(tiny_models(arch))
    prm = build_prm(backbone, processor, PRMSpec())
    prm.backbone = adapt_backbone(prm.backbone, TrainModelConfig(lora=LoraConfig(enabled=True)))
    layers = decoder_layers(prm)
    assert len(layers) == backbone.config.get_text_config().num_hidden_layers
    names = {id(m): n for n, m in prm.named_modules()}
    assert all(names[id(m)].endswith(f"layers.{i}") for i, m in enumerate(layers)), [names[id(m)] for m in layers]
    assert not any(re.fullmatch(VISION_TOWER_PATTERN, names[id(m)]) for m in layers)


def test_a_model_without_decoder_layers_is_refused_by_name():
    with pytest.raises(ValueError, match="no decoder layers .* in Linear; turn compile off"):
        compile_decoder_layers(torch.nn.Linear(2, 2))


def _prm_steps(model, processor, arch: str) -> list[tuple[float, dict]]:
    """Two training steps of a PRM on batches of different lengths: (loss, gradients) of each."""
    pad = processor.tokenizer.pad_token_id if hasattr(processor, "tokenizer") else processor.pad_token_id
    out = []
    for n_steps in (2, 4):
        toks = []
        for i in range(2):
            steps = [f"{j} + 3 = {j + 3}." for j in range(n_steps + i)]
            toks.append(
                tokenize_steps(
                    processor, f"Sum {i}?", steps, _images(arch), labels=[float(j % 2) for j in range(len(steps))]
                )
            )
        batch = collate_steps(toks, pad or 0)
        logits = model(batch["input_ids"], batch["attention_mask"], batch["step_mask"], **model_input_keys(batch))
        loss = soft_ce_token_pair(logits, batch["targets"])
        loss.backward()
        out.append((loss.item(), _grads(model)))
    return out


@pytest.mark.parametrize(("arch", "backend"), ARCH_PARAMS)
def test_prm_training_step_loss_and_gradients_equal_eager(tiny_models, arch, backend):
    backbone, processor = load_backbone(tiny_models(arch))
    torch.manual_seed(0)
    model = build_prm(backbone, processor, PRMSpec()).train()
    keys = list(model.state_dict())
    eager = _prm_steps(model, processor, arch)
    assert compile_decoder_layers(model, backend=backend) == 2
    compiled = _prm_steps(model, processor, arch)
    # one graph serves every layer and both lengths (dynamic shapes): no compile per step
    assert 1 <= _graphs() <= 2, _graphs()
    _assert_same(eager, compiled)
    # compiled in place: a checkpoint keeps its keys (no `_orig_mod.`) and loads into a plain model
    state = model.state_dict()
    assert list(state) == keys
    build_prm(load_backbone(tiny_models(arch))[0], processor, PRMSpec()).load_state_dict(state, strict=True)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2_vl", "internvl"])
def test_lora_and_gradient_checkpointing_train_the_same_compiled(tiny_models, arch):
    backbone, processor = load_backbone(tiny_models(arch))
    torch.manual_seed(0)
    model = build_prm(backbone, processor, PRMSpec()).train()
    model.backbone = adapt_backbone(
        model.backbone, TrainModelConfig(gradient_checkpointing=True, lora=LoraConfig(enabled=True, dropout=0.0))
    )
    eager = _prm_steps(model, processor, arch)
    compile_decoder_layers(model)
    compiled = _prm_steps(model, processor, arch)
    assert _graphs() >= 1
    _assert_same(eager, compiled)
    assert all("lora_" in k for k in compiled[0][1])  # only the adapters train


def _sft_steps(model, processor, arch: str) -> list[tuple[float, dict]]:
    tokenizer = getattr(processor, "tokenizer", processor)
    out = []
    for n in (1, 3):
        items = [
            tokenize_sft(processor, f"Add {i} tiles.", ["One.", "Two."] * (n + i), str(i), _images(arch), 512)
            for i in range(2)
        ]
        batch = collate_sft(items, pad_id=tokenizer.pad_token_id or 0)
        loss_sum, count = next_token_loss_sum(model, dict(batch))
        (loss_sum / count).backward()
        out.append(((loss_sum / count).item(), _grads(model)))
    return out


@pytest.mark.slow  # the default tier compiles the PRM step only (test_prm_training_step_...): the same layers
@pytest.mark.parametrize(("arch", "backend"), ARCH_PARAMS)
def test_sft_step_loss_and_gradients_equal_eager(tiny_models, arch, backend):
    model, processor = load_backbone(tiny_models(arch))
    model.train()
    eager = _sft_steps(model, processor, arch)
    compile_decoder_layers(model, backend=backend)
    compiled = _sft_steps(model, processor, arch)
    assert 1 <= _graphs() <= 2, _graphs()
    _assert_same(eager, compiled)


def _examples(arch: str) -> list[dict]:
    """Best-of-N candidates of one question (tree / shared-prompt paths) and a lone one (plain path)."""
    same = [
        {"question": "Q0", "images": _images(arch), "steps": ["a b", "c d e"][: 1 + i % 2] + ["x"] * i}
        for i in range(4)
    ]
    return [*same, {"question": "Another question", "images": [], "steps": ["y", "z"]}]


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "backend"), [p for p in ARCH_PARAMS if p.values[0] in (FAST, "qwen2_vl")])
@pytest.mark.parametrize("sharing", ["trees", "prompt_cache"])
def test_compiled_scorer_gives_the_eager_scores(tiny_models, tmp_path, arch, backend, sharing, monkeypatch):
    backbone, processor = load_backbone(tiny_models(arch))
    torch.manual_seed(0)
    saved = save_prm(build_prm(backbone, processor, PRMSpec()), processor, tmp_path / "prm")
    if sharing == "prompt_cache":  # the KV-cache path: those calls run eagerly, the rest compiled
        monkeypatch.setattr("mmprm.models.prm._packs_trees", lambda backbone: False)
    examples = _examples(arch)
    eager = load_prm(saved, batch_size=2).score(examples)
    scorer = load_prm(saved, batch_size=2)
    compile_decoder_layers(scorer.model, backend=backend)
    compiled = scorer.score(examples)
    assert _graphs() >= 1
    for a, b in zip(eager, compiled, strict=True):
        assert len(a) == len(b) and all(math.isclose(x, y, abs_tol=1e-5) for x, y in zip(a, b))


def test_load_prm_compiles_on_request_and_refuses_it_for_vllm(tiny_models, tmp_path):
    backbone, processor = load_backbone(tiny_models("qwen2"))
    saved = save_prm(build_prm(backbone, processor, PRMSpec()), processor, tmp_path / "prm")
    scorer = load_prm(saved, compile=True)
    assert isinstance(scorer, PRMScorer)
    assert all(layer._compiled_call_impl is not None for layer in decoder_layers(scorer.model))
    assert all(layer._compiled_call_impl is None for layer in decoder_layers(load_prm(saved).model))
    with pytest.raises(ValueError, match="compile: applies to backend 'hf' only"):
        load_prm(saved, backend="vllm", compile=True)


def test_the_prm_section_builds_with_compile_and_the_token_budget(tiny_models, tmp_path):
    """`prm.compile` and `prm.max_batch_tokens` reach the scorer every recipe builds."""
    from mmprm.config_sections import PRMScorerConfig
    from mmprm.models.prm import MAX_BATCH_TOKENS

    backbone, processor = load_backbone(tiny_models("qwen2"))
    saved = save_prm(build_prm(backbone, processor, PRMSpec()), processor, tmp_path / "prm")
    assert PRMScorerConfig().max_batch_tokens == MAX_BATCH_TOKENS
    scorer = PRMScorerConfig(path=str(saved), device="cpu", compile=True, max_batch_tokens=333).build()
    assert scorer.max_batch_tokens == 333
    assert all(layer._compiled_call_impl is not None for layer in decoder_layers(scorer.model))
    with pytest.raises(ValueError, match="prm.compile: applies to backend hf only"):
        PRMScorerConfig(path=str(saved), backend="vllm", compile=True).validate()


def _train_args(model, train, ev, out, steps: int = 3) -> list[str]:
    return short_train_args(model, train, ev, out, steps)


def _losses(out) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["split"] == "train"]


@pytest.mark.slow
def test_prm_train_with_train_compile_trains_the_eager_run_and_saves_plain_weights(tiny_models, tmp_path):
    train = write_toy_prm_data(tmp_path, 12, 0)
    ev = write_toy_prm_data(tmp_path, 4, 1, name="eval.jsonl")
    model = tiny_models("qwen2_vl")  # images through the eager tower into compiled layers
    run_recipe("prm_train", *_train_args(model, train, ev, tmp_path / "eager"))
    res = run_recipe("prm_train", *_train_args(model, train, ev, tmp_path / "compiled"), "train.compile=true")
    assert "train.compile: 2 decoder layers compiled" in res.stdout
    assert _losses(tmp_path / "compiled") == pytest.approx(_losses(tmp_path / "eager"), abs=1e-5)
    examples = [{"question": "Q", "images": [], "steps": ["a", "b c"]}]
    scores = [load_prm(tmp_path / run).score(examples) for run in ("eager", "compiled")]
    assert scores[0][0] == pytest.approx(scores[1][0], abs=1e-5)


@pytest.mark.slow
def test_train_compile_is_refused_under_zero3_before_the_model_loads(tiny_models, tmp_path):
    from ports import free_port
    from recipe_runs import REPO, recipe_env

    train = write_toy_prm_data(tmp_path, 4, 0, images=False)
    launcher = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", "launch/accelerate/deepspeed_zero3.yaml", "--num_processes", "1",
        "--main_process_port", str(free_port()), "--mixed_precision", "no", "--dynamo_backend", "no",
    ]  # fmt: skip
    args = _train_args(tiny_models("qwen2"), train, train, tmp_path / "o")
    cmd = [*launcher, str(REPO / "recipes" / "prm_train.py"), *args, "train.compile=true"]
    res = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=recipe_env(ACCELERATE_USE_CPU="false")
    )
    assert res.returncode != 0
    assert "train.compile: not supported under DeepSpeed ZeRO-3" in res.stdout + res.stderr, res.stderr[-3000:]
    assert "Loading weights" not in res.stderr


@pytest.mark.slow
def test_policy_sft_with_train_compile_trains_the_eager_run(tiny_models, tmp_path):
    from mmprm.data.synthetic import cli_synthetic

    assert cli_synthetic(["--out", str(tmp_path / "data"), "--train", "8", "--test", "2", "--seed", "0"]) == 0
    train, ev = tmp_path / "data" / "train_sft.jsonl", tmp_path / "data" / "test_sft.jsonl"
    args = [
        f"model.name_or_path={tiny_models('qwen2_vl')}",
        f"data.train_file={train}",
        f"data.eval_file={ev}",
        "train.max_steps=3",
        "train.batch_size=4",
        "train.lr=3e-3",
        "train.log_every=1",
        "train.eval_every=3",
        "train.save_every=3",
        "train.eval_generations=1",
        "train.max_new_tokens=4",
        "data.max_length=256",
        "train.report_to=none",
    ]
    run_recipe("policy_sft", *args, f"output_dir={tmp_path / 'eager'}")
    res = run_recipe("policy_sft", *args, f"output_dir={tmp_path / 'compiled'}", "train.compile=true")
    assert "train.compile: 2 decoder layers compiled" in res.stdout
    assert _losses(tmp_path / "compiled") == pytest.approx(_losses(tmp_path / "eager"), abs=1e-5)
    state = load_backbone(tmp_path / "compiled")[0].state_dict()  # the saved model, plain keys
    assert not any("_orig_mod" in k for k in state)


@pytest.mark.slow
def test_compile_benchmark_quick():
    from recipe_runs import REPO

    res = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "compile_training.py"), "--quick"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [line for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, res.stdout[-2000:]
    out = json.loads(lines[0])
    assert out["eager"]["steps_per_s"] > 0 and out["compiled"]["steps_per_s"] > 0
    assert out["max_loss_diff"] <= 1e-5


@pytest.mark.slow
def test_fsdp2_wraps_the_compiled_layers_and_steps_the_eager_gradient(tiny_models, tmp_path):
    """Compiled before accelerate's FSDP2 preparation (fully_shard per decoder layer): the layers
    run compiled over sharded parameters and give the eager logits and gradient norm."""
    from test_fsdp2 import run_fsdp2_step

    eager = run_fsdp2_step(tiny_models, tmp_path / "eager", "frozen", "1.0", "false")
    compiled = run_fsdp2_step(tiny_models, tmp_path / "compiled", "frozen", "1.0", "true")
    assert eager["compiled_graphs"] == 0 and compiled["compiled_graphs"] >= 1
    assert compiled["sharded"] == eager["sharded"] > 0
    assert compiled["before"] == pytest.approx(eager["before"], rel=1e-5)
    assert torch.allclose(torch.tensor(compiled["logits"]), torch.tensor(eager["logits"]), atol=1e-5)


@pytest.mark.slow
def test_two_process_ddp_with_train_compile_trains_the_eager_run(tiny_models, tmp_path):
    """Compiled before accelerate wraps the model in DDP: 2 gloo processes log the losses of the
    same run uncompiled (the gradient all-reduce runs on the compiled layers' gradients)."""
    from recipe_runs import cpu_ddp_launcher

    train = write_toy_prm_data(tmp_path, 16, 0)
    ev = write_toy_prm_data(tmp_path, 4, 1, name="eval.jsonl")
    args = _train_args(tiny_models("qwen2_vl"), train, ev, tmp_path / "eager")
    env = {"ACCELERATE_USE_CPU": "true"}
    run_recipe("prm_train", *args, launcher=cpu_ddp_launcher(), extra_env=env)
    args = _train_args(tiny_models("qwen2_vl"), train, ev, tmp_path / "compiled")
    res = run_recipe("prm_train", *args, "train.compile=true", launcher=cpu_ddp_launcher(), extra_env=env)
    assert "train.compile: 2 decoder layers compiled" in res.stdout
    assert json.loads((tmp_path / "compiled" / "config.resolved.json").read_text())["num_processes"] == 2
    assert _losses(tmp_path / "compiled") == pytest.approx(_losses(tmp_path / "eager"), abs=1e-5)
