"""transformers' sdpa attention without a copy of the key/value heads per query group where none is
needed: on CPU, outside autograd.

    from mmprm.models.attention import use_grouped_query_sdpa
    use_grouped_query_sdpa()   # load_backbone does it; every "sdpa" model in the process then runs it

Grouped-query attention (Qwen2-VL, Qwen2.5-VL, InternVL's language models: fewer key/value heads
than query heads) with a mask, which every left-padded batch has, makes transformers repeat each
key/value head once per query group (`repeat_kv`) before calling sdpa: CUDA's fused kernels take no
mask with grouped heads. While decoding, that copies the whole KV cache at every token, in every
layer. The CPU kernel takes a mask with grouped heads (`enable_gqa`), so on CPU this runs the one
grouped call, and its outputs are bitwise those of the repeated heads (tests/test_attention.py).
With autograd it keeps transformers' path: the key/value gradients of the grouped kernel sum the
query groups in another order (equal within float rounding, not bitwise), and a training run should
not change its numbers because an inference speed-up landed. Anywhere else (CUDA, no groups, no
mask, position bias, a paged cache) it is transformers' function unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["grouped_query_sdpa", "grouped_query_sdpa_applies", "use_grouped_query_sdpa"]

# `enable_gqa` came with torch 2.5; mmprm allows 2.4 (pyproject), where the repeat stays.
_HAS_ENABLE_GQA = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def grouped_query_sdpa_applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any) -> bool:
    """Whether the grouped call replaces the repeated heads: fewer key than query heads, a mask
    tensor (without one transformers already groups), on CPU, and no tensor that needs a gradient."""
    return (
        _HAS_ENABLE_GQA
        and isinstance(mask, torch.Tensor)
        and query.device.type == "cpu"
        and key.shape[1] < query.shape[1]
        and not (query.requires_grad or key.requires_grad or value.requires_grad)
    )


def grouped_query_sdpa(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function (query (B, H, Lq, D), key/value (B, H_kv, Lk, D)) ->
    ((B, Lq, H, D), None), as `transformers.integrations.sdpa_attention.sdpa_attention_forward`."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = kwargs.get("position_bias") is None and kwargs.get("cache") is None and not kwargs.get("output_attentions")
    if not (plain and grouped_query_sdpa_applies(query, key, value, attention_mask)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    # With a mask transformers never sets is_causal (the mask carries causality) and never crops keys.
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=False, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def use_grouped_query_sdpa() -> None:
    """Make `grouped_query_sdpa` the "sdpa" attention of every transformers model in this process
    (transformers' documented way to override a kernel: `AttentionInterface.register`). Models keep
    `attn_implementation="sdpa"`, so their masks and every check on the name are unchanged.
    Registering again is free."""
    from transformers import AttentionInterface

    AttentionInterface.register("sdpa", grouped_query_sdpa)
