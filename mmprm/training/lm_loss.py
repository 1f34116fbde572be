"""Next-token cross-entropy of a causal (multimodal) LM without full-vocabulary logits.

    loss_sum, n = next_token_loss_sum(model, batch)   # batch holds "labels"; chunk size from the vocabulary

A chunk holds at most `CHUNK_LOGITS` logits unless told otherwise (883 tokens at Qwen2-VL's
151,936-token vocabulary, 131,072 at a tiny model's 1,024). A batch whose B * (S - 1) positions fit
one chunk takes the plain path (the model's logits, then cross-entropy): its logits are no larger
than one chunk's, and the result is bit-identical to what policy SFT always computed. A longer batch runs the model to its last hidden state only, keeps the
label positions, and sends them through the LM head a chunk at a time
(`chunked_cross_entropy`), each chunk's logits recomputed in backward: peak memory is one chunk's
logits, whatever the sequence length. With liger-kernel installed (`pip install mmprm[liger]`) and
the model on a GPU, its fused linear cross-entropy does the same in one Triton kernel.

The LM head is always called as a module, never read as `.weight` on our path: under DeepSpeed
ZeRO-3 the weight is partitioned and DeepSpeed gathers it inside the module's forward (and again in
the recomputation).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mmprm.training.data import IGNORE

# Logits per chunk by default: 512 MiB in fp32, a few copies of which live in a chunk's backward.
CHUNK_LOGITS = 2**27


def liger_available() -> bool:
    """Whether liger-kernel is installed (it runs on CUDA only)."""
    return importlib.util.find_spec("liger_kernel") is not None


def _chunk_loss(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, labels: torch.Tensor):
    logits = head(hidden).float()  # (C, V), fp32 for a stable log-sum-exp, as the full-logits path
    return F.cross_entropy(logits, labels, reduction="sum")


def chunked_cross_entropy(
    hidden: torch.Tensor, labels: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], chunk_tokens: int
) -> torch.Tensor:
    """Summed cross-entropy of `head(hidden)` against `labels`, one chunk of rows at a time.

    Each chunk's logits live only while its loss is computed; backward recomputes them
    (activation checkpointing), so peak memory is one chunk's (C, V) logits, not (N, V).

    Args:
        hidden: (N, H) hidden states at the positions that carry loss (no ignored rows).
        labels: (N,) target token ids.
        head: the LM head, called as a module on (C, H) -> (C, V).
        chunk_tokens: rows per chunk, C <= chunk_tokens (the last chunk may be shorter).

    Returns:
        Scalar: sum over the N rows of -log softmax(head(hidden))[label]; 0 (in the graph) for N = 0.
    """
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(
            f"chunked_cross_entropy: hidden must be (N, H) and labels (N,), got {tuple(hidden.shape)} "
            f"and {tuple(labels.shape)}"
        )
    if chunk_tokens < 1:
        raise ValueError(f"chunked_cross_entropy: chunk_tokens must be >= 1, got {chunk_tokens}")
    if hidden.shape[0] == 0:
        return hidden.sum().float() * 0.0
    total = None
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, y = hidden[start : start + chunk_tokens], labels[start : start + chunk_tokens]
        part = (
            checkpoint(_chunk_loss, head, h, y, use_reentrant=False)
            if torch.is_grad_enabled()
            else _chunk_loss(head, h, y)
        )
        total = part if total is None else total + part
    return total


def _unwrap(model: nn.Module) -> nn.Module:
    """The model under DDP / DeepSpeed wrappers (PEFT stays: it forwards get_output_embeddings)."""
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model)


def _fsdp(model: nn.Module) -> bool:
    """FSDP reshards the LM head after the root forward; calling it afterwards would read a shard."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    fsdp2 = getattr(torch.distributed.fsdp, "FSDPModule", ())
    return isinstance(model, FullyShardedDataParallel) or (bool(fsdp2) and isinstance(model, fsdp2))


def _liger_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
    """Liger's fused linear cross-entropy (sum), or None where it cannot run: not installed, not on
    CUDA, a head that is not a plain Linear (LoRA on the head) or a ZeRO-3 partitioned weight."""
    if not (hidden.is_cuda and liger_available()) or type(head) is not nn.Linear or hasattr(head.weight, "ds_id"):
        return None
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE, reduction="sum")
    # the kernel multiplies in one dtype; under autocast the final norm may hand back fp32
    return loss(head.weight, hidden.to(head.weight.dtype), labels, head.bias)


def next_token_loss_sum(
    model: nn.Module, batch: dict[str, Any], chunk_tokens: int | None = None, use_liger: bool = True
) -> tuple[torch.Tensor, int]:
    """Sum of next-token cross-entropy over labelled tokens, and their count.

    Args:
        model: a causal LM (HF `*ForCausalLM` / `*ForConditionalGeneration`), possibly wrapped by
            PEFT, DDP or DeepSpeed; its forward takes `output_hidden_states` and `logits_to_keep`.
        batch: model inputs plus "labels" (B, S), IGNORE where no loss; "labels" is popped.
        chunk_tokens: logits rows per chunk; None: CHUNK_LOGITS // vocabulary. A batch with
            B * (S - 1) <= chunk_tokens takes full logits.
        use_liger: take liger-kernel's fused loss where it can run.

    Returns:
        (scalar loss sum, number of labelled tokens); labels[:, t + 1] is the target at position t.
    """
    labels = batch.pop("labels")  # (B, S)
    shift_labels = labels[:, 1:]  # (B, S - 1)
    count = int((shift_labels != IGNORE).sum())
    head = _unwrap(model).get_output_embeddings()
    if chunk_tokens is None:  # out_features survives ZeRO-3 partitioning, the weight's shape does not
        chunk_tokens = max(1, CHUNK_LOGITS // head.out_features)
    if shift_labels.numel() <= chunk_tokens or _fsdp(model):
        logits = model(**batch, use_cache=False).logits  # (B, S, V)
        shift_logits = logits[:, :-1].float()
        loss = F.cross_entropy(
            shift_logits.reshape(-1, shift_logits.shape[-1]),
            shift_labels.reshape(-1),
            ignore_index=IGNORE,
            reduction="sum",
        )
        return loss, count
    # logits_to_keep=1: the model's own LM head call costs one position per row; hidden_states[-1]
    # is the final-norm output, the LM head's input
    out = model(**batch, use_cache=False, output_hidden_states=True, logits_to_keep=1)
    keep = shift_labels != IGNORE  # (B, S - 1)
    hidden = out.hidden_states[-1][:, :-1][keep]  # (N, H), label positions only
    targets = shift_labels[keep]  # (N,)
    if use_liger and (fused := _liger_loss(head, hidden, targets)) is not None:
        return fused, count
    return chunked_cross_entropy(hidden, targets, head, chunk_tokens), count
