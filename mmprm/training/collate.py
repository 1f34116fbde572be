"""Batches of tokenized examples, as the PRM, the SFT policy and the tree packer feed them to a model.

`collate_steps` pads tokenized steps (`mmprm.steps.tokenize_steps`) into one batch;
`collate_model_inputs` batches the processor's image tensors beside them; `model_input_keys`
picks what of a batch goes to the backbone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mmprm.steps import TokenizedSteps

# Processor outputs that run along the token axis (padded like input_ids, not concatenated).
PER_TOKEN_KEYS = ("mm_token_type_ids", "token_type_ids")


def collate_steps(items: Sequence[TokenizedSteps], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch of tokenized examples; step positions stay where tokenization put them.

    Returns input_ids/attention_mask/step_mask (B, S), targets (N,) float when labelled, and the
    processor's image tensors concatenated along dim 0 (the models index images in batch order).
    """
    width = max(len(t.input_ids) for t in items)
    batch = len(items)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    step_mask = torch.zeros((batch, width), dtype=torch.bool)
    for i, t in enumerate(items):
        n = len(t.input_ids)
        input_ids[i, :n] = torch.tensor(t.input_ids)
        attention_mask[i, :n] = 1
        step_mask[i, t.step_positions] = True
    out: dict[str, torch.Tensor] = {"input_ids": input_ids, "attention_mask": attention_mask, "step_mask": step_mask}
    if all(t.labels is not None for t in items):
        # float32 end to end: a 0.7 label reaches the loss as 0.7
        out["targets"] = torch.tensor([x for t in items for x in t.labels], dtype=torch.float32)
    out.update(collate_model_inputs([t.model_inputs for t in items], width))
    return out


def collate_model_inputs(extras: Sequence[dict[str, torch.Tensor]], width: int) -> dict[str, torch.Tensor]:
    """Batch the processor's extra outputs of single examples (PRM and SFT collators alike).

    Per-token tensors (1, n) are right-padded with 0 to (B, width) like input_ids; image tensors
    are concatenated along dim 0, since the models consume images in batch order.
    """
    out: dict[str, torch.Tensor] = {}
    for key in sorted(set().union(*(e.keys() for e in extras))):
        values = [e[key] for e in extras if key in e]
        if key in PER_TOKEN_KEYS:
            padded = torch.zeros((len(extras), width), dtype=values[0].dtype)
            for i, e in enumerate(extras):
                if key in e:
                    v = e[key][0][:width]
                    padded[i, : len(v)] = v
            out[key] = padded
        else:
            out[key] = torch.cat(values, dim=0)
    return out


def model_input_keys(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entries of a collated batch that go to the backbone (not targets)."""
    return {
        k: v
        for k, v in batch.items()
        if k not in ("targets", "step_weights", "input_ids", "attention_mask", "step_mask")
    }
