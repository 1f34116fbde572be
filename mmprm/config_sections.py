"""Config sections several recipes share, each defined once with its help (`Attributes:`).

A recipe's config composes these with sections of its own; `mmprm.config.load_config` reads them
like any other. The sampling section is `mmprm.generation.base.SamplingConfig`, the one the
generation backends take.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

AttnImplementation = Literal["sdpa", "flash_attention_2", "flex_attention", "eager", "auto"]


@dataclass
class ModelLoadConfig:
    """Model loading.

    Attributes:
        attn_implementation: attention kernel of every model this recipe loads with transformers (a
            vLLM engine chooses its own): sdpa | flash_attention_2 (mmprm[flash], CUDA) |
            flex_attention | eager | auto (flash-attn when installed and a GPU is visible, else sdpa)
    """

    attn_implementation: AttnImplementation = "sdpa"


@dataclass
class ShardConfig:
    """This process's share of the problems (contiguous blocks).

    Attributes:
        index: this shard, 0 <= index < count
        count: number of shards (one process per GPU or Slurm task); see the recipe for how they join
    """

    index: int = 0
    count: int = 1

    def validate(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard.index={self.index} must be in [0, shard.count={self.count})")
