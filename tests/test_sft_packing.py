"""Sequence packing for policy SFT (mmprm.training.packing.collate_sequence_packs, sequence_pack_inputs):
the same summed loss, label count and gradients as the padded rows on the tiny VLMs, images and
M-RoPE included, with full logits and chunked; the pack planner; the recipe's config checks."""

from __future__ import annotations

import pytest
import torch

from mmprm.models.loading import load_backbone
from mmprm.training import packing
from mmprm.training.data import IGNORE, collate_sft, tokenize_sft
from mmprm.training.lm_loss import next_token_loss_sum
from mmprm.training.packing import (
    collate_sequence_packs,
    flatten_packs,
    plan_sequence_packs,
    sequence_pack_inputs,
)

FULL = 10**9  # one chunk: the full-logits path


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    from mmprm.data.synthetic import cli_synthetic

    d = tmp_path_factory.mktemp("synthetic_sft_packing")
    assert cli_synthetic(["--out", str(d), "--train", "5", "--test", "1", "--seed", "1"]) == 0
    return d / "train_sft.jsonl"


def sft_items(processor, path, rows: int, text_rows: int = 0) -> list[dict]:
    """`rows` tokenized rows with their images, the last `text_rows` of them without."""
    from mmprm.data.schema import load_examples, load_image

    out = []
    for k, ex in enumerate(load_examples(path)[:rows]):
        images = [] if k >= rows - text_rows else [load_image(p) for p in ex.images]
        out.append(tokenize_sft(processor, ex.question, ex.steps, ex.answer, images, 1024))
    return out


def loss_and_grads(model, batch, chunk_tokens, packed: bool):
    model.zero_grad()
    if packed:
        with sequence_pack_inputs(model, batch) as inputs:
            loss, n = next_token_loss_sum(model, inputs, chunk_tokens)
            # on CPU sdpa each sequence of a pack attends alone, causal, without the pack's mask
            blocks = packing._active_tree.get()
            assert blocks.calls == model.config.get_text_config().num_hidden_layers
            assert all(sub is None for row in blocks.blocks for *_, sub in row)
    else:
        loss, n = next_token_loss_sum(model, dict(batch), chunk_tokens)
    loss.backward()
    return loss.detach(), n, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def assert_same(a, b):
    loss_a, n_a, g_a = a
    loss_b, n_b, g_b = b
    assert n_a == n_b
    torch.testing.assert_close(loss_b, loss_a, atol=1e-5, rtol=1e-5)
    assert set(g_a) == set(g_b)
    for name, grad in g_a.items():
        torch.testing.assert_close(g_b[name], grad, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "llava", "internvl"])
def test_packed_loss_and_gradients_equal_padding(tiny_models, synthetic, arch):
    model, processor = load_backbone(tiny_models(arch))
    model.train()
    pad = processor.tokenizer.pad_token_id or 0
    items = sft_items(processor, synthetic, rows=5, text_rows=1)
    padded = collate_sft(items, pad)
    # three rows (two images, then the text-only row) in one pack, two in the other
    packed = collate_sequence_packs([[items[0], items[1], items[4]], [items[2], items[3]]], pad)
    assert packed["input_ids"].shape[0] == 2 and (packed["attention_mask"] == 0).any()  # a padded tail
    n_labels = int((padded["labels"][:, 1:] != IGNORE).sum())
    assert int((packed["labels"][:, 1:] != IGNORE).sum()) == n_labels == sum(t["n_targets"] for t in items)

    rows = loss_and_grads(model, padded, FULL, packed=False)
    assert rows[1] == n_labels
    assert_same(rows, loss_and_grads(model, packed, FULL, packed=True))
    # the chunked LM-head loss on both sides, chunks that split the label tokens unevenly
    chunk = next(c for c in (7, 9, 11, 13) if n_labels % c)
    assert_same(rows, loss_and_grads(model, padded, chunk, packed=False))
    assert_same(rows, loss_and_grads(model, packed, chunk, packed=True))
    assert any("vision" in k or "visual" in k for k in rows[2])  # the image rows reach the tower


def test_packed_gradients_by_sequence_are_autograds_to_the_bit(tiny_models, synthetic, monkeypatch):
    """The sequences of a pack attend alone (slices of the keys, causal): the blocks' backward
    written out gives the gradients of autograd through the blocks, bit for bit."""
    model, processor = load_backbone(tiny_models("qwen2_vl"))
    model.train()
    items = sft_items(processor, synthetic, rows=3, text_rows=1)
    packed = collate_sequence_packs([[items[0], items[2]], [items[1]]], processor.tokenizer.pad_token_id or 0)
    applied = []
    apply = packing._AttentionByBlocks.apply
    monkeypatch.setattr(packing._AttentionByBlocks, "apply", lambda *a: applied.append(1) or apply(*a))
    written_out = loss_and_grads(model, packed, FULL, packed=True)
    assert len(applied) == model.config.get_text_config().num_hidden_layers
    monkeypatch.setattr(packing, "_blocks_backward_applies", lambda *a: False)
    autograd = loss_and_grads(model, packed, FULL, packed=True)
    assert torch.equal(written_out[0], autograd[0])
    assert written_out[2].keys() == autograd[2].keys()
    for name, grad in autograd[2].items():
        assert torch.equal(written_out[2][name], grad), name


@pytest.mark.parametrize("arch", ["qwen2_vl", "llava"])
def test_flattened_layout_of_flash_attention_equals_padding(tiny_models, synthetic, arch):
    """flash-attn's layout (one sequence, no mask, positions restarting per row), run with sdpa:
    transformers builds the block-diagonal mask from those positions, as flash-attn cuts by them."""
    model, processor = load_backbone(tiny_models(arch))
    model.train()
    pad = processor.tokenizer.pad_token_id or 0
    items = sft_items(processor, synthetic, rows=4)
    rows = loss_and_grads(model, collate_sft(items, pad), FULL, packed=False)
    batch = collate_sequence_packs([items[:3], items[3:]], pad)
    config = model.config.get_text_config()
    config._attn_implementation = "flash_attention_2"  # the inputs flash-attn gets, without running it
    with sequence_pack_inputs(model, batch) as inputs:
        pass
    config._attn_implementation = "sdpa"
    assert inputs["input_ids"].shape == (1, int(batch["attention_mask"].sum())) and "attention_mask" not in inputs
    model.zero_grad()
    loss, n = next_token_loss_sum(model, inputs, FULL)
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    assert_same(rows, (loss.detach(), n, grads))


def test_flatten_drops_padding_and_keeps_mrope_rows():
    real = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    pos = torch.tensor([[0, 1, 0, 0], [0, 1, 0, 1]])
    batch = {"input_ids": torch.arange(8).view(2, 4), "labels": torch.arange(8).view(2, 4), "position_ids": pos}
    flat = flatten_packs(batch, real)
    assert flat["input_ids"].tolist() == [[0, 1, 2, 4, 5]] and flat["position_ids"].tolist() == [[0, 1, 0, 0, 1]]
    mrope = flatten_packs({**batch, "position_ids": pos.expand(4, -1, -1)}, real)["position_ids"]
    assert mrope.shape == (4, 1, 5) and mrope[3].tolist() == [[0, 1, 0, 0, 1]]


def test_packs_ignore_the_label_the_loss_ignores():
    assert packing.IGNORE == IGNORE


def test_plan_fits_the_budget_and_is_deterministic():
    lengths = [120, 30, 250, 90, 256, 60, 60, 10, 200, 45]
    packs = plan_sequence_packs(lengths, 256)
    assert sorted(i for p in packs for i in p) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in p) <= 256 for p in packs)
    assert len(packs) == 5  # 1,121 tokens need at least 5 packs of 256
    assert packs == plan_sequence_packs(lengths, 256)


def test_packing_refuses_attention_without_a_mask(tiny_models, synthetic):
    model, processor = load_backbone(tiny_models("qwen2"))
    items = sft_items(processor, synthetic, rows=2, text_rows=2)
    batch = collate_sequence_packs([items], processor.pad_token_id or 0)
    model.config._attn_implementation = "sdpa_paged"
    with pytest.raises(ValueError, match="data.pack_sequences"):
        with sequence_pack_inputs(model, batch):
            pass


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_packed_mrope_positions_are_each_rows_own(tiny_models, synthetic, arch):
    """RoPE is relative, so a row's positions shifted by a constant give the same loss: the test
    above cannot see the shift. Here the M-RoPE positions of each row in a pack (image tokens
    included) equal those the model gives the row alone, and the text positions restart at 0."""
    model, processor = load_backbone(tiny_models(arch))
    items = sft_items(processor, synthetic, rows=3)
    batch = collate_sequence_packs([items], processor.tokenizer.pad_token_id or 0)
    with sequence_pack_inputs(model, batch) as inputs:
        pos = inputs["position_ids"]  # (4, 1, L)
    start = 0
    for t in items:
        alone = collate_sft([t], 0)
        kwargs = {k: alone[k] for k in ("image_grid_thw",) if k in alone}
        own, _ = model.model.get_rope_index(alone["input_ids"], mm_token_type_ids=alone["mm_token_type_ids"], **kwargs)
        n = len(t["input_ids"])
        assert (alone["mm_token_type_ids"] == 1).any()  # the row has image tokens
        assert torch.equal(pos[1:, 0, start : start + n], own[:, 0])
        assert torch.equal(pos[0, 0, start : start + n], torch.arange(n))
        start += n


@pytest.mark.slow
def test_recipe_trains_the_weights_of_padding_when_every_row_is_in_every_batch(tiny_models, tmp_path):
    """policy_sft with data.pack_sequences: 8 rows in one pack a step train the weights of the
    same 8 rows padded, 3 AdamW steps, the chunked LM-head loss on both."""
    from recipe_runs import read_metrics, run_recipe
    from safetensors.torch import load_file

    from mmprm.data.synthetic import cli_synthetic

    assert cli_synthetic(["--out", str(tmp_path / "data"), "--train", "8", "--test", "1", "--seed", "2"]) == 0
    common = [
        f"model.name_or_path={tiny_models('qwen2_vl')}",
        f"data.train_file={tmp_path / 'data' / 'train_sft.jsonl'}",
        "data.max_length=256",
        "train.max_steps=3",
        "train.lr=3e-3",
        "train.warmup_steps=0",
        "train.log_every=1",
        "train.report_to=none",
        "train.loss_chunk_tokens=64",
    ]
    padded, packed = tmp_path / "padded", tmp_path / "packed"
    run_recipe("policy_sft", *common, f"output_dir={padded}", "train.batch_size=8")
    res = run_recipe(
        "policy_sft",
        *common,
        f"output_dir={packed}",
        "train.batch_size=1",
        "data.pack_sequences=true",
        "data.pack_tokens=2048",
    )
    assert "sequence packing: 8 rows in 1 packs of at most 2048 tokens" in res.stdout, res.stdout[-2000:]
    a, b = load_file(padded / "model.safetensors"), load_file(packed / "model.safetensors")
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst <= 1e-4, f"packed training moves the weights elsewhere, by {worst}"
    loss = [r["loss"] for r in read_metrics(packed, "train")]
    assert loss == pytest.approx([r["loss"] for r in read_metrics(padded, "train")], abs=1e-5)


def test_recipe_refuses_a_pack_smaller_than_a_row():
    from recipe_runs import load_recipe

    from mmprm.config import load_config

    Config = load_recipe("policy_sft").PolicySFTConfig
    overrides = ["model.name_or_path=m", "data.train_file=t.jsonl", "data.pack_sequences=true", "data.pack_tokens=100"]
    with pytest.raises(Exception, match="data.pack_tokens=100 is below data.max_length=2048"):
        load_config(Config, None, overrides)
    assert load_config(Config, None, overrides[:2]).data.pack_sequences is False  # off by default


@pytest.mark.slow  # FlexAttention compiles its kernel (torch.compile) on first use
def test_flex_attention_block_mask_gives_the_padded_loss(tiny_models, synthetic):
    """attn_implementation=flex_attention: the packs' block-diagonal mask as a FlexAttention block
    mask gives the padded rows' loss (forward only: FlexAttention has no backward on CPU)."""
    model, processor = load_backbone(tiny_models("internvl"))
    flex, _ = load_backbone(tiny_models("internvl"), attn_implementation="flex_attention")
    pad = processor.tokenizer.pad_token_id or 0
    items = sft_items(processor, synthetic, rows=4, text_rows=1)
    with torch.no_grad():
        rows, n_rows = next_token_loss_sum(model, collate_sft(items, pad), FULL)
        with sequence_pack_inputs(flex, collate_sequence_packs([items[:3], items[3:]], pad)) as inputs:
            assert type(inputs["attention_mask"]).__name__ == "BlockMask"
            packed, n_packed = next_token_loss_sum(flex, inputs, FULL)
    assert n_rows == n_packed
    torch.testing.assert_close(packed, rows, atol=1e-4, rtol=1e-5)
