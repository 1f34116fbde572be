"""Rollout backends behind one interface (`base.RolloutBackend`): HF generate, vLLM, simulated.

Backends import their engine lazily, so `import mmprm.annotate.backends` needs neither torch
generation nor vllm.
"""

from mmprm.annotate.backends.base import (
    GenerationStats,
    RolloutBackend,
    RolloutInputError,
    RolloutRequest,
    SamplingConfig,
    rollout_prompt,
)

__all__ = [
    "GenerationStats",
    "RolloutBackend",
    "RolloutInputError",
    "RolloutRequest",
    "SamplingConfig",
    "rollout_prompt",
]
