"""MFU arithmetic: FLOPs per token from a model's shape, and the device's peak."""

import pytest
import torch

from mmprm.mfu import flops_per_token, model_shape, peak_flops


def tiny_qwen2(tied: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=100,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tied,
    )
    return Qwen2ForCausalLM(config)


@pytest.mark.parametrize("tied", [False, True])
def test_model_shape_counts_by_hand(tied):
    # per layer: q 8x8+8, k 8x4+4, v 8x4+4, o 8x8 (head dim 4, one kv head), MLP 3 x 8x16, two norms of 8
    layer = (64 + 8) + (32 + 4) + (32 + 4) + 64 + 3 * 128 + 2 * 8
    assert layer == 608
    # two layers, the final norm and the LM head (100 x 8); the input embedding, a lookup, is left
    # out, except that tied it is the LM head
    assert model_shape(tiny_qwen2(tied)) == (2 * 608 + 8 + 800, 2, 8)


def test_flops_per_token_by_hand():
    # 6N for the matmuls forward and backward, 12 * layers * hidden * seq for attention
    assert flops_per_token(2024, 2, 8, 10) == 6 * 2024 + 12 * 2 * 8 * 10 == 14064
    assert flops_per_token(0, 1, 1, 0.5) == 6.0


def test_model_shape_counts_the_vision_tower(tiny_models):
    from mmprm.models.loading import load_backbone

    model, _ = load_backbone(tiny_models("qwen2_vl"))
    n, layers, hidden = model_shape(model)
    vision = sum(p.numel() for p in model.model.visual.parameters())
    embed = model.get_input_embeddings().weight.numel()
    assert vision > 0 and n == sum(p.numel() for p in model.parameters()) - embed
    text = model.config.get_text_config()
    assert (layers, hidden) == (text.num_hidden_layers, text.hidden_size)


@pytest.mark.parametrize(
    "key,name,expected",
    [
        (None, "NVIDIA H100 80GB HBM3", 989.5e12),
        (None, "NVIDIA H100 PCIe", 756e12),
        (None, "NVIDIA H200", 989.5e12),
        (None, "NVIDIA A100-SXM4-80GB", 312e12),
        (None, "Tesla T4", None),  # not in the table: MFU is null unless train.peak_tflops is set
        (None, None, None),  # CPU
        (100.0, None, 100e12),  # the key wins, on CPU too
        (500.0, "NVIDIA H100 80GB HBM3", 500e12),
    ],
)
def test_peak_flops(key, name, expected):
    assert peak_flops(key, name) == expected
