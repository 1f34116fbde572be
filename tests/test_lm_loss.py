"""Chunked next-token loss (mmprm.training.lm_loss): the same loss and gradients as full logits on
every tiny arch, tied embeddings too; chunks that split the label tokens unevenly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmprm.models.loading import load_backbone
from mmprm.models.tiny import TINY_ARCHS
from mmprm.training.data import IGNORE, collate_sft, tokenize_sft
from mmprm.training.lm_loss import CHUNK_LOGITS, chunked_cross_entropy, next_token_loss_sum

FULL = 10**9  # one chunk holds every position: the full-logits path


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    from mmprm.data.synthetic import cli_synthetic

    d = tmp_path_factory.mktemp("synthetic_lm_loss")
    assert cli_synthetic(["--out", str(d), "--train", "4", "--test", "1", "--seed", "0"]) == 0
    return d / "train_sft.jsonl"


def sft_batch(processor, path, rows: int) -> dict:
    from mmprm.data.schema import load_examples, load_image

    tokenizer = getattr(processor, "tokenizer", processor)
    text_only = tokenizer is processor  # a text model reads the question without its images

    def images(ex):
        return [] if text_only else [load_image(p) for p in ex.images]

    items = [
        tokenize_sft(processor, ex.question, ex.steps, ex.answer, images(ex), 1024) for ex in load_examples(path)[:rows]
    ]
    return collate_sft(items, pad_id=tokenizer.pad_token_id or 0)


def loss_and_grads(model, batch, chunk_tokens):
    model.zero_grad()
    loss, n = next_token_loss_sum(model, dict(batch), chunk_tokens)
    loss.backward()
    return loss.detach(), n, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_chunked_loss_and_gradients_equal_full_logits(tiny_models, synthetic, arch):
    model, processor = load_backbone(tiny_models(arch))
    model.train()
    batch = sft_batch(processor, synthetic, rows=3)
    n_labels = int((batch["labels"][:, 1:] != IGNORE).sum())
    chunk = next(c for c in (7, 9, 11, 13) if n_labels % c)
    assert n_labels % chunk and batch["labels"][:, 1:].numel() > chunk  # the last chunk is short

    full, n_full, g_full = loss_and_grads(model, batch, chunk_tokens=FULL)
    chunked, n_chunked, g_chunked = loss_and_grads(model, batch, chunk_tokens=chunk)

    assert n_full == n_chunked == n_labels
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=1e-5)
    # the chunked loss reaches every parameter the full loss reaches: LM head, decoder, vision tower
    assert set(g_chunked) == set(g_full)
    assert model.get_output_embeddings().weight.grad is not None  # the head itself (tied in internvl)
    assert arch == "qwen2" or any("vision" in k or "visual" in k for k in g_full)
    for name, grad in g_full.items():
        torch.testing.assert_close(g_chunked[name], grad, atol=1e-5, rtol=1e-5, msg=name)


def test_tied_embeddings_take_both_gradients(tiny_models, synthetic):
    model, processor = load_backbone(tiny_models("qwen2"))
    model.lm_head.weight = model.get_input_embeddings().weight  # one parameter, read twice
    batch = sft_batch(processor, synthetic, rows=2)
    full, _, g_full = loss_and_grads(model, batch, chunk_tokens=FULL)
    chunked, _, g_chunked = loss_and_grads(model, batch, chunk_tokens=5)
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=1e-5)
    name = "model.embed_tokens.weight"
    assert "lm_head.weight" not in g_full  # tied: named once
    for key, grad in g_full.items():
        torch.testing.assert_close(g_chunked[key], grad, atol=1e-5, rtol=1e-5, msg=key)
    assert name in g_chunked


def test_one_chunk_batch_is_bit_identical_to_full_logits(tiny_models, synthetic):
    """A batch whose positions fit one chunk takes the full-logits path: not close, equal."""
    model, processor = load_backbone(tiny_models("qwen2_vl"))
    batch = sft_batch(processor, synthetic, rows=2)
    full, _, g_full = loss_and_grads(model, batch, chunk_tokens=FULL)
    fits, _, g_fits = loss_and_grads(model, batch, chunk_tokens=batch["labels"][:, 1:].numel())
    assert torch.equal(fits, full)
    assert all(torch.equal(g_fits[k], g) for k, g in g_full.items())


def test_chunked_cross_entropy_memory_is_one_chunk_and_no_labels_is_zero():
    head = torch.nn.Linear(8, 50)
    hidden = torch.randn(23, 8, requires_grad=True)
    labels = torch.randint(0, 50, (23,))
    seen = []
    loss = chunked_cross_entropy(hidden, labels, lambda h: seen.append(h.shape[0]) or head(h), chunk_tokens=10)
    assert seen == [10, 10, 3]
    expected = torch.nn.functional.cross_entropy(head(hidden), labels, reduction="sum")
    torch.testing.assert_close(loss, expected)
    loss.backward()  # the chunks' logits are recomputed: the head runs again, once per chunk
    assert sorted(seen) == sorted([10, 10, 3] * 2)
    empty = chunked_cross_entropy(hidden[:0], labels[:0], head, chunk_tokens=10)
    assert empty.item() == 0.0 and empty.requires_grad
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_cross_entropy(hidden, labels, head, chunk_tokens=0)


def old_token_loss_sum(model, batch):
    """recipes/policy_sft.py's loss before chunking, verbatim: the reference the demo published with."""
    labels = batch.pop("labels")
    logits = model(**batch, use_cache=False).logits  # (B, S, V)
    shift_logits, shift_labels = logits[:, :-1].float(), labels[:, 1:]
    loss = torch.nn.functional.cross_entropy(
        shift_logits.reshape(-1, shift_logits.shape[-1]), shift_labels.reshape(-1), ignore_index=IGNORE, reduction="sum"
    )
    return loss, int((shift_labels != IGNORE).sum())


def test_demo_sft_step_is_bit_identical_to_the_old_loss(tmp_path):
    """The quickstart's SFT (qwen2_vl, hidden 128, 4 layers, batch 8, vision tower trained) with the
    recipe's default config: loss and every gradient equal, not close, to the old full-logits code."""
    import importlib.util
    import sys

    from mmprm.data.synthetic import cli_synthetic
    from mmprm.models.tiny import build_tiny_model

    spec = importlib.util.spec_from_file_location(
        "policy_sft_recipe_for_loss", Path(__file__).resolve().parents[1] / "recipes" / "policy_sft.py"
    )
    recipe = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = recipe  # dataclasses look their module up
    spec.loader.exec_module(recipe)
    cfg = recipe.PolicySFTConfig()
    args = [
        "--out",
        str(tmp_path),
        "--train",
        "8",
        "--test",
        "1",
        "--seed",
        "0",
        "--min-tiles",
        "3",
        "--max-tiles",
        "4",
    ]
    assert cli_synthetic(args) == 0
    path = build_tiny_model("qwen2_vl", tmp_path / "model", seed=0, hidden_size=128, num_layers=4)
    model, processor = load_backbone(path)
    model.train()
    batch = sft_batch(processor, tmp_path / "train_sft.jsonl", rows=8)
    assert batch["labels"].shape[0] == 8
    # the demo's widest batch (8 rows of data.max_length 256) fits the default chunk: one chunk, full logits
    assert 8 * 255 * model.get_output_embeddings().out_features <= CHUNK_LOGITS

    grads = []
    for loss_fn in (old_token_loss_sum, lambda m, b: recipe.token_loss_sum(m, b, cfg.train.loss_chunk_tokens)):
        torch.manual_seed(0)
        model.zero_grad()
        loss, n = loss_fn(model, dict(batch))
        (loss / n).backward()
        grads.append((loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}))
    (old, g_old), (new, g_new) = grads
    assert torch.equal(new, old)
    assert g_new.keys() == g_old.keys() and len(g_old) > 0
    assert all(torch.equal(g_new[k], g) for k, g in g_old.items())


def test_liger_is_not_taken_off_cuda():
    """Liger's kernels are Triton on CUDA: on CPU the chunked path runs, installed or not."""
    from mmprm.training.lm_loss import _liger_loss

    head = torch.nn.Linear(8, 50)
    assert _liger_loss(head, torch.randn(3, 8), torch.tensor([1, 2, 3])) is None


def test_lora_model_with_a_lora_lm_head(tiny_models, synthetic):
    """Through PEFT, LoRA on the LM head included: the head is called as the LoRA module."""
    from peft import LoraConfig, get_peft_model

    model, processor = load_backbone(tiny_models("qwen2"))
    model = get_peft_model(
        model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False)
    )
    batch = sft_batch(processor, synthetic, rows=2)
    full, _, g_full = loss_and_grads(model, batch, chunk_tokens=FULL)
    chunked, _, g_chunked = loss_and_grads(model, batch, chunk_tokens=6)
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=1e-5)
    assert any("lm_head.lora" in k for k in g_full) and g_chunked.keys() == g_full.keys()
    for key, grad in g_full.items():
        torch.testing.assert_close(g_chunked[key], grad, atol=1e-5, rtol=1e-5, msg=key)
