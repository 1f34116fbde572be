"""PRM training losses on step tokens, with soft (Monte-Carlo) targets kept as floats.

Two heads are supported, both read only at step-token positions (`gather_steps`):

* token pair: the LM head's logits of a "+" and a "-" token, (N, 2) as [pos, neg]; the loss is
  cross-entropy against the distribution [t, 1 - t] (`soft_ce_token_pair`).
* value head: one logit per step, (N,); the loss is BCE-with-logits against t
  (`soft_bce_value`).

For the same logit difference the two are the same loss: softmax over [a, b] is
sigmoid(a - b). Both average over the N step tokens of the batch; with N = 0 (every step
truncated away) they return a zero that keeps the graph, not NaN.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def _check_targets(targets: torch.Tensor, n: int, where: str) -> torch.Tensor:
    if targets.shape != (n,):
        raise ValueError(f"{where}: targets must have shape ({n},), got {tuple(targets.shape)}")
    targets = targets.float()  # soft labels stay fractional; integer 0/1 labels are fine too
    if n and not ((targets >= 0) & (targets <= 1)).all():
        raise ValueError(f"{where}: targets must lie in [0, 1] (Monte-Carlo success rates)")
    return targets


def _mean(per_step: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """Plain mean, or weighted mean sum(w * l) / sum(w) (positive/negative balancing)."""
    if weights is None:
        return per_step.mean()
    w = weights.to(per_step.dtype)
    return (w * per_step).sum() / w.sum().clamp_min(1e-12)


def soft_ce_token_pair(
    pair_logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Cross-entropy of the [pos, neg] token pair against [t, 1 - t], mean over steps.

    Args:
        pair_logits: (N, 2) logits of the positive and the negative label token at each step.
        targets: (N,) float in [0, 1], the probability that the step is good.
        weights: optional (N,) per-step weights; the mean becomes sum(w * l) / sum(w).

    Returns:
        Scalar loss: mean_i -(t_i log softmax_pos + (1 - t_i) log softmax_neg).
    """
    if pair_logits.dim() != 2 or pair_logits.shape[1] != 2:
        raise ValueError(f"soft_ce_token_pair: pair_logits must be (N, 2), got {tuple(pair_logits.shape)}")
    t = _check_targets(targets, pair_logits.shape[0], "soft_ce_token_pair")
    if pair_logits.shape[0] == 0:
        return pair_logits.sum() * 0.0
    logp = F.log_softmax(pair_logits.float(), dim=-1)  # (N, 2), fp32 for a stable log-sum-exp
    return _mean(-(t * logp[:, 0] + (1 - t) * logp[:, 1]), weights)


def soft_bce_value(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Binary cross-entropy with logits against soft targets, mean over steps.

    Args:
        logits: (N,) value-head logits at step tokens.
        targets: (N,) float in [0, 1].
        weights: optional (N,) per-step weights; the mean becomes sum(w * l) / sum(w).
    """
    if logits.dim() != 1:
        raise ValueError(f"soft_bce_value: logits must be (N,), got {tuple(logits.shape)}")
    t = _check_targets(targets, logits.shape[0], "soft_bce_value")
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    return _mean(F.binary_cross_entropy_with_logits(logits.float(), t, reduction="none"), weights)


def gather_steps(values: torch.Tensor, steps: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
    """Rows of `values` at step positions, in batch order then position order.

    Args:
        values: (B, S, ...) per-token tensor (hidden states, logits, ...).
        steps: (B, S) bool mask of step tokens, or per example a list of positions
            (`TokenizedSteps.step_positions`, shifted by any left padding).

    Returns:
        (N, ...) with N the number of step tokens; row k lines up with the k-th label of the
        flattened per-example label lists.
    """
    if values.dim() < 2:
        raise ValueError(f"gather_steps: values must be (B, S, ...), got {tuple(values.shape)}")
    b, s = values.shape[:2]
    if isinstance(steps, torch.Tensor):
        if steps.dtype != torch.bool or tuple(steps.shape) != (b, s):
            raise ValueError(f"gather_steps: mask must be bool ({b}, {s}), got {steps.dtype} {tuple(steps.shape)}")
        return values[steps]  # boolean indexing is row-major: batch, then position
    if len(steps) != b:
        raise ValueError(f"gather_steps: {len(steps)} position lists for a batch of {b}")
    rows, cols = [], []
    for i, pos in enumerate(steps):
        for p in pos:
            if not 0 <= p < s:
                raise ValueError(f"gather_steps: example {i} position {p} is outside sequence length {s}")
            rows.append(i)
            cols.append(p)
    idx = torch.tensor([rows, cols], dtype=torch.long, device=values.device)  # (2, N)
    return values[idx[0], idx[1]]
