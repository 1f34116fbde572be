"""`torch.compile` per decoder layer (`train.compile`, `load_prm(compile=True)`).

Only the language model's decoder layers are compiled, never the whole model: they hold most of
the compute and share one graph (one compile serves every layer), while the vision tower (a
variable number of images), the head and the loss stay eager and cannot force a recompile.

    compile_decoder_layers(model)   # in place; before accelerate.prepare, after LoRA wrapping

Compiling in place (`nn.Module.compile`) leaves the module tree and `state_dict` keys as they
are (no `_orig_mod.` prefix), so checkpoints load into an uncompiled model and back.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

__all__ = ["compile_decoder_layers", "decoder_layers"]


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The language model's decoder layers: every `nn.ModuleList` named `...layers` outside the
    vision tower (Qwen2-VL, Qwen2.5-VL, InternVL, LLaVA: `model.language_model.layers`; text-only
    LMs: `model.layers`; under a PRM wrapper or peft the same lists, deeper).

    Raises:
        ValueError: no such list (an architecture whose layers are named otherwise).
    """
    from mmprm.models.loading import VISION_TOWER_PATTERN

    layers = [
        layer
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList)
        and name.rsplit(".", 1)[-1] == "layers"
        and not re.fullmatch(VISION_TOWER_PATTERN, name)
        for layer in module
    ]
    if not layers:
        raise ValueError(
            f"compile: found no decoder layers (an nn.ModuleList named 'layers' outside the vision tower) in "
            f"{type(model).__name__}; turn compile off for this architecture"
        )
    return layers


def compile_decoder_layers(model: nn.Module, backend: str = "inductor") -> int:
    """Compile each decoder layer of `model` in place; returns how many were compiled.

    Shapes are dynamic from the first call, so a new sequence length does not recompile. A call
    that carries a KV cache (generation, the scorer's shared-prefix path) runs the layer eagerly:
    the cache is indexed by the layer's number, which would compile one graph per layer.

    Args:
        model: a backbone, a `ProcessRewardModel` or a peft model, not yet wrapped by
            accelerate (DDP, FSDP2): wrap after compiling.
        backend: a `torch.compile` backend; "aot_eager" traces without generating kernels.
    """
    layers = decoder_layers(model)
    for layer in layers:
        eager = layer._call_impl
        compiled = torch.compile(eager, backend=backend, dynamic=True)

        def call(*args: Any, _eager: Any = eager, _compiled: Any = compiled, **kwargs: Any) -> Any:
            return _eager(*args, **kwargs) if kwargs.get("past_key_values") is not None else _compiled(*args, **kwargs)

        # what nn.Module.compile sets: __call__ runs it in place of _call_impl (hooks included)
        layer._compiled_call_impl = call
    return len(layers)
