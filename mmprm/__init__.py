"""mmprm: multimodal process reward models.

`import mmprm` stays light: torch, transformers and the optional engines (vllm, deepspeed,
flash-attn) load only when a function that needs them is called.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "load_prm"]


def load_prm(path, **kwargs):
    """Load a trained PRM directory as a scorer (see `mmprm.models.prm.load_prm`)."""
    from mmprm.models.prm import load_prm as _load_prm

    return _load_prm(path, **kwargs)
