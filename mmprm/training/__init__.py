"""Training: what the training recipes share.

    from mmprm.training import TrainConfig, TrainingRun, load_trainable_backbone

- `mmprm.training.run`: batch order, LR schedule, checkpoints and the run itself (`TrainingRun`);
- `mmprm.training.data`: tokenized rows cached on disk and the PRM / SFT collators;
- `mmprm.training.packing`: one sequence per problem (tree packing);
- `mmprm.training.collate`: tokenized rows padded into a batch (the scorer's too);
- `mmprm.training.vision_sync`, `mmprm.training.lm_loss`: sharded multimodal training, the SFT loss.

Names are resolved lazily, so importing a submodule (the scorer imports `collate`) does not load
the training run.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    name: "mmprm.training.run"
    for name in (
        "LoraConfig",
        "TrainConfig",
        "TrainModelConfig",
        "TrainingRun",
        "adapt_backbone",
        "eval_share",
        "leave_run",
        "load_trainable_backbone",
        "wrap_padding",
    )
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mmprm.training' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
