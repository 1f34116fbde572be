"""Model builders: load a backbone from a path, add the step token, tiny presets for tests.

Names are resolved lazily so `import mmprm.models` does not import torch or transformers.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "load_processor": "mmprm.models.loading",
    "load_backbone": "mmprm.models.loading",
    "add_step_token": "mmprm.models.loading",
    "vision_tower_parameters": "mmprm.models.loading",
    "is_multimodal": "mmprm.models.loading",
    "TINY_ARCHS": "mmprm.models.tiny",
    "build_tiny_model": "mmprm.models.tiny",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mmprm.models' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
