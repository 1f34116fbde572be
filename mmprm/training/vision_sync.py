"""Every rank runs the vision tower in every forward, so sharded training survives text-only rows.

Under ZeRO-3 (and FSDP) a module's weights are gathered from all ranks when its forward starts, so
all ranks must run the same modules in the same order. A rank whose micro-batch has no image
skips the vision tower while another rank runs it: their collectives pair up wrongly and the job
hangs (NCCL) or aborts with "Received data size doesn't match" (gloo); DeepSpeed issue 7170. The
fix, for a batch without an image, runs the tower on one blank image right after the token
embeddings (where the model's own forward runs it) and adds 0 x its features to the embeddings:

    sync = vision_sync(accelerator, backbone, processor)    # before accelerator.prepare
    with sync(batch):                                       # no-op for a batch with images
        logits = model(**batch)

The features count 0, but every rank gathers the tower's weights and reduces its gradients.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from mmprm.config import ConfigError

__all__ = ["VisionSync", "dummy_image_inputs", "no_vision_sync", "shards_parameters", "vision_sync"]

# The processors resize it up to their smallest input (28-56 px Qwen, a 336/448 px tile CLIP/InternViT).
_BLANK_SIZE = (28, 28)


def shards_parameters(accelerator: Any) -> bool:
    """True under DeepSpeed ZeRO-3 or FSDP: weights are gathered per module forward by all ranks."""
    state = accelerator.state
    ds = getattr(state, "deepspeed_plugin", None)
    if ds is not None:  # the stage the config file names, which is what DeepSpeed runs
        return int(ds.deepspeed_config.get("zero_optimization", {}).get("stage", ds.zero_stage)) == 3
    return getattr(state, "fsdp_plugin", None) is not None


def _image_features_call(model: nn.Module) -> Callable[..., Any] | None:
    return getattr(model, "get_image_features", None)


def dummy_image_inputs(processor: Any, model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of one blank 28 x 28 image, as `model.get_image_features` takes them.

    The processor's image processor makes them, so they have the shapes a real image would
    (Qwen2-VL: pixel_values (4, 1176) + image_grid_thw [[1, 2, 2]] at 56 px; LLaVA and InternVL:
    pixel_values (1, 3, H, W)); outputs the call does not take (InternVL's num_patches) are dropped.

    Raises:
        ValueError: the processor has no image processor, or the model no `get_image_features`.
    """
    from PIL import Image

    image_processor = getattr(processor, "image_processor", None)
    call = _image_features_call(model)
    if image_processor is None or call is None:
        raise ValueError(
            f"{type(model).__name__} with {type(processor).__name__}: no image processor or no "
            "get_image_features, so a text-only batch cannot run the vision tower"
        )
    encoded = image_processor(images=[Image.new("RGB", _BLANK_SIZE)], return_tensors="pt")
    takes = inspect.signature(call).parameters
    return {k: v for k, v in encoded.items() if k in takes and isinstance(v, torch.Tensor)}


def _features_sum(features: Any) -> torch.Tensor:
    """Sum of `get_image_features`' output: a tensor, a tuple/list of them, or a model output."""
    features = getattr(features, "pooler_output", features)
    if isinstance(features, torch.Tensor):
        return features.sum()
    return torch.stack([f.sum() for f in features]).sum()


class VisionSync:
    """Runs `backbone`'s vision tower on a blank image in the forward of a batch without images.

    Call it with the batch the next forward gets, as a context manager around that forward (or
    `generate()`, with generate=True). The tower runs once per context, where the model runs it for
    a batch with images: inside the first token-embedding call of a forward; for `generate()` of a
    transformers model that encodes images before the prefill (`mm_encoder_outputs`), on entry.
    """

    def __init__(self, backbone: nn.Module, dummy: Mapping[str, torch.Tensor]):
        self.backbone, self.dummy = backbone, dict(dummy)

    @contextlib.contextmanager
    def __call__(self, batch: Mapping[str, Any], generate: bool = False) -> Iterator[None]:
        if "pixel_values" in batch:  # the model's own forward runs the tower
            yield
            return
        # transformers 5's generate() encodes the images first, then embeds the prompt (mm_encoder_outputs)
        if generate and getattr(self.backbone, "_supports_mm_encoder_outputs", lambda: False)():
            self._features_sum(self.backbone.get_input_embeddings().weight.device)
            yield
            return
        fired = False

        def run_tower(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
            nonlocal fired
            if fired:
                return None
            fired = True
            total = self._features_sum(output.device)
            return output + 0.0 * total.to(output.dtype)  # (B, S, H), unchanged

        handle = self.backbone.get_input_embeddings().register_forward_hook(run_tower)
        try:
            yield
        finally:
            handle.remove()

    def _features_sum(self, device: torch.device) -> torch.Tensor:
        inputs = {k: v.to(device) for k, v in self.dummy.items()}
        return _features_sum(_image_features_call(self.backbone)(**inputs))


def no_vision_sync(batch: Mapping[str, Any], generate: bool = False) -> contextlib.AbstractContextManager:
    """What `vision_sync` returns where every rank keeps whole weights: nothing to do."""
    return contextlib.nullcontext()


def vision_sync(
    accelerator: Any, backbone: nn.Module, processor: Any
) -> Callable[..., contextlib.AbstractContextManager]:
    """`VisionSync` for a multimodal backbone under ZeRO-3 or FSDP; otherwise a no-op per batch
    (DDP and ZeRO-2 keep whole weights on every rank, and text-only models have no tower).

    Raises:
        ConfigError: sharded training of a multimodal model whose vision tower cannot be run alone.
    """
    multimodal = getattr(getattr(backbone, "config", None), "vision_config", None) is not None
    if not (multimodal and shards_parameters(accelerator)):
        return no_vision_sync
    try:
        dummy = dummy_image_inputs(processor, backbone)
    except ValueError as e:
        raise ConfigError(
            f"{e}. Under ZeRO-3 or FSDP a rank whose batch has no image would hang the others: train "
            "this model with ZeRO-2 or DDP (accelerate launch --config_file launch/accelerate/deepspeed_zero2.yaml "
            "or ddp.yaml), or give every row of data.train_file and data.eval_file an image"
        ) from None
    return VisionSync(backbone, dummy)
