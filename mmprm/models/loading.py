"""Load a backbone and its processor from a directory, exactly as a real checkpoint loads.

    model, processor = load_backbone("Qwen/Qwen2.5-VL-7B-Instruct")   # or a tiny preset dir
    step_id = add_step_token(processor, model)                       # before PRM training

The same functions serve real checkpoints and the tiny presets of `mmprm.models.tiny`, so a test
exercises the very classes a user trains. Two environment facts shape this file:

- Qwen2-VL, Qwen2.5-VL, InternVL and LLaVA-OneVision processors carry a video processor, which
  needs torchvision; a PRM never sees video, so without torchvision those model types load through
  image-only subclasses below. Where torchvision imports (GPU machines, the vLLM environment) a
  checkpoint that has its video processor loads whole, so what we save from it stays loadable by vLLM.
- Without torchvision, transformers' `AutoImageProcessor` falls back to the PIL backend
  (`*ImageProcessorPil`) on its own; nothing here forces a backend.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any, get_args

import torch
from tokenizers import AddedToken
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    InternVLProcessor,
    LlavaOnevisionProcessor,
    PreTrainedConfig,
    Qwen2_5_VLProcessor,
    Qwen2VLProcessor,
)

from mmprm.models.attention import use_grouped_query_sdpa
from mmprm.models.sharding import full_shape
from mmprm.models.spec import AttnImplementation
from mmprm.steps import STEP_TOKEN

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "IMAGE_ONLY_PROCESSORS",
    "VISION_TOWER_PATTERN",
    "InternVLImageOnlyProcessor",
    "LlavaOnevisionImageOnlyProcessor",
    "Qwen2VLImageOnlyProcessor",
    "Qwen2_5_VLImageOnlyProcessor",
    "add_step_token",
    "is_multimodal",
    "load_backbone",
    "load_processor",
    "resolve_attn_implementation",
    "vision_tower_parameters",
]


def _upstream_name(cls: type) -> str:
    """Name of the first transformers class `cls` derives from (e.g. "Qwen2VLProcessor")."""
    return next(c.__name__ for c in cls.__mro__ if c.__module__.startswith("transformers."))


class _ImageOnlyMixin:
    """Saves under transformers' own class name, so plain `AutoProcessor` opens the directory
    anywhere (the subclass exists only to skip the video processor)."""

    def save_pretrained(self, save_directory: str | Path, *args: Any, **kwargs: Any) -> Any:
        result = super().save_pretrained(save_directory, *args, **kwargs)  # type: ignore[misc]
        upstream = _upstream_name(type(self))
        for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
            file = Path(save_directory) / name
            if not file.is_file():
                continue
            data = json.loads(file.read_text(encoding="utf-8"))
            if data.get("processor_class") == type(self).__name__:
                data["processor_class"] = upstream
                file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        return result


class Qwen2VLImageOnlyProcessor(_ImageOnlyMixin, Qwen2VLProcessor):
    """`Qwen2VLProcessor` without its video processor (which would need torchvision)."""

    def __init__(
        self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None, **kwargs: Any
    ) -> None:
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


class Qwen2_5_VLImageOnlyProcessor(_ImageOnlyMixin, Qwen2_5_VLProcessor):
    """`Qwen2_5_VLProcessor` without its video processor (which would need torchvision)."""

    def __init__(
        self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None, **kwargs: Any
    ) -> None:
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


class InternVLImageOnlyProcessor(_ImageOnlyMixin, InternVLProcessor):
    """`InternVLProcessor` (HF format, e.g. InternVL3-*-hf) without its video processor."""

    def __init__(
        self,
        image_processor: Any = None,
        tokenizer: Any = None,
        image_seq_length: int = 256,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            image_processor, tokenizer, None, image_seq_length=image_seq_length, chat_template=chat_template, **kwargs
        )


class LlavaOnevisionImageOnlyProcessor(_ImageOnlyMixin, LlavaOnevisionProcessor):
    """`LlavaOnevisionProcessor` (llava-hf/llava-onevision-*-hf) without its video processor."""

    def __init__(
        self,
        image_processor: Any = None,
        tokenizer: Any = None,
        num_image_tokens: int | None = None,
        vision_feature_select_strategy: str | None = None,
        chat_template: str | None = None,
        image_token: str = "<image>",
        video_token: str = "<video>",
        vision_aspect_ratio: str = "anyres_max_9",
        **kwargs: Any,
    ) -> None:
        super().__init__(
            image_processor,
            tokenizer,
            None,
            num_image_tokens=num_image_tokens,
            vision_feature_select_strategy=vision_feature_select_strategy,
            chat_template=chat_template,
            image_token=image_token,
            video_token=video_token,
            vision_aspect_ratio=vision_aspect_ratio,
            **kwargs,
        )


# model_type (config.json) -> processor class used by `load_processor`.
IMAGE_ONLY_PROCESSORS: dict[str, type] = {
    "qwen2_vl": Qwen2VLImageOnlyProcessor,
    "qwen2_5_vl": Qwen2_5_VLImageOnlyProcessor,
    "internvl": InternVLImageOnlyProcessor,
    "llava_onevision": LlavaOnevisionImageOnlyProcessor,
}

# Top-level submodule names of vision encoders across HF VLMs (Qwen: `visual`; LLaVA, InternVL:
# `vision_tower`; others: `vision_model`). Projectors (`merger`, `multi_modal_projector`) are not
# part of the tower: they are usually trained together with the language model.
_VISION_TOWER_NAMES = ("visual", "vision_tower", "vision_model")
_PROJECTOR_NAMES = ("merger", "multi_modal_projector")
# A module or parameter name inside the vision tower and outside its projector, under re.fullmatch
# (the form peft's `exclude_modules` takes as a string).
VISION_TOWER_PATTERN = (
    rf"(?!(?:.*\.)?(?:{'|'.join(_PROJECTOR_NAMES)})(?:\.|$))(?:.*\.)?(?:{'|'.join(_VISION_TOWER_NAMES)})(?:\..*)?"
)


def _config_of(model_or_config: Any) -> PreTrainedConfig:
    if isinstance(model_or_config, (str, Path)):
        return AutoConfig.from_pretrained(str(model_or_config))
    if isinstance(model_or_config, PreTrainedConfig):
        return model_or_config
    config = getattr(model_or_config, "config", None)
    if not isinstance(config, PreTrainedConfig):
        raise TypeError(f"expected a model, a config or a checkpoint path, got {type(model_or_config).__name__}")
    return config


def is_multimodal(model_or_config: Any) -> bool:
    """True when the model (or config, or checkpoint dir) has a vision encoder.

    Args:
        model_or_config: a `PreTrainedModel`, a `PreTrainedConfig`, or a checkpoint directory.
    """
    return getattr(_config_of(model_or_config), "vision_config", None) is not None


def _read_json_field(file: Path, field: str) -> Any:
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text(encoding="utf-8")).get(field)
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e}); re-save the checkpoint") from e


def _image_only_class(path: Path, model_type: str | None) -> type | None:
    """The image-only processor for this checkpoint, by model_type or, in a processor-only
    directory (no config.json), by the processor class its files name."""
    if model_type is not None:
        return IMAGE_ONLY_PROCESSORS.get(model_type)
    by_name = {_upstream_name(cls): cls for cls in IMAGE_ONLY_PROCESSORS.values()}
    for name in ("processor_config.json", "preprocessor_config.json"):
        if (cls := by_name.get(_read_json_field(path / name, "processor_class"))) is not None:
            return cls
    return None


def _has_video_processor(path: Path) -> bool:
    """True when a checkpoint (a hub id: assumed) saved a video processor, in either file layout."""
    if not path.is_dir():
        return True
    return (path / "video_preprocessor_config.json").is_file() or _read_json_field(
        path / "processor_config.json", "video_processor"
    ) is not None


def load_processor(path: str | Path) -> Any:
    """Load the processor of a checkpoint directory (or hub id): tokenizer for text-only models.

    Qwen2-VL, Qwen2.5-VL, InternVL and LLaVA-OneVision load through their image-only subclasses
    unless torchvision imports and the checkpoint has its video processor (then whole, via
    `AutoProcessor`); other VLMs through `AutoProcessor`; text-only models (config without
    `vision_config`) return the
    tokenizer itself, which `mmprm.steps` accepts wherever it takes a processor.
    """
    from transformers.utils import is_torchvision_available

    local = Path(path)
    if local.is_dir():
        model_type = _read_json_field(local / "config.json", "model_type")
    else:
        model_type = AutoConfig.from_pretrained(str(path)).model_type
    image_only = _image_only_class(local, model_type)
    if image_only is not None and not (is_torchvision_available() and _has_video_processor(local)):
        return image_only.from_pretrained(str(path))
    if model_type is not None and not is_multimodal(str(path)):
        return AutoTokenizer.from_pretrained(str(path))
    return AutoProcessor.from_pretrained(str(path))


# Attention kernels a recipe may name in `model.attn_implementation`; "auto" picks flash-attn
# when it is installed and a GPU is present, else PyTorch's SDPA (which runs everywhere).
ATTN_IMPLEMENTATIONS = get_args(AttnImplementation)


_SAID: set[str] = set()


def _say_once(message: str) -> None:
    """Print a notice to stderr once per process: the recipes resolve the same key more than once."""
    if message not in _SAID:
        _SAID.add(message)
        print(message, file=sys.stderr, flush=True)


def resolve_attn_implementation(name: str, key: str = "model.attn_implementation") -> str:
    """The attention kernel to load with, checked before any weight is read.

    Args:
        name: one of `ATTN_IMPLEMENTATIONS`.
        key: the config key the value came from, named in errors.

    Raises:
        ConfigError: unknown name, or flash_attention_2 without flash-attn installed or without CUDA.
    """
    import importlib.util

    from mmprm.config import ConfigError

    if name not in ATTN_IMPLEMENTATIONS:
        raise ConfigError(f"{key}: {name!r} is not one of {list(ATTN_IMPLEMENTATIONS)}")
    has_flash = importlib.util.find_spec("flash_attn") is not None
    if name == "auto":
        chosen = "flash_attention_2" if has_flash and torch.cuda.is_available() else "sdpa"
        why = (
            "flash-attn installed, CUDA visible"
            if chosen != "sdpa"
            else "flash-attn is not installed (see docs/scaling.md: it builds with --no-build-isolation)"
            if not has_flash
            else "no CUDA GPU is visible"
        )
        _say_once(f"{key}=auto: {chosen} ({why})")
        return chosen
    if name == "flash_attention_2" and not has_flash:
        raise ConfigError(
            f"{key}=flash_attention_2 but flash-attn is not installed: on a CUDA machine with torch installed, "
            f"pip install 'mmprm[flash]' --no-build-isolation (flash-attn builds against the installed torch), "
            f"or set {key}=sdpa"
        )
    if name == "flash_attention_2" and not torch.cuda.is_available():
        raise ConfigError(f"{key}=flash_attention_2 needs a CUDA GPU and none is visible: set {key}=sdpa")
    return name


def resolve_device(device: str = "auto") -> str:
    """`device` as given, or for "auto" this process's accelerator: with several GPUs visible, the
    one of its node-local rank (LOCAL_RANK from torchrun/accelerate, SLURM_LOCALID from srun), so
    eight shards on a node do not all load onto cuda:0; with one visible (narrowed by the user or
    srun), that one; the CPU without CUDA. A local rank past the visible GPUs is an error."""
    if device != "auto":
        return device
    if not torch.cuda.is_available():
        return "cpu"
    count = torch.cuda.device_count()
    if count == 1:
        return "cuda:0"
    key = "LOCAL_RANK" if "LOCAL_RANK" in os.environ else "SLURM_LOCALID"
    local = int(os.environ.get(key, "0"))
    if local >= count:  # never two ranks silently sharing one GPU
        raise ValueError(
            f"{key}={local} but only {count} GPUs are visible: start at most {count} processes per node, "
            "or set the device explicitly"
        )
    return f"cuda:{local}"


def release_accelerator_memory() -> None:
    """Return the memory of models this process dropped to the device, so that the next model it
    loads (Best-of-N's PRM after its policy) finds it free."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def load_backbone(
    path: str | Path,
    dtype: torch.dtype | str | None = None,
    attn_implementation: str = "sdpa",
    attn_key: str = "model.attn_implementation",
    bare: bool = False,
) -> tuple[nn.Module, Any]:
    """Load model and processor from a checkpoint directory (or hub id) with `from_pretrained`.

    Args:
        path: checkpoint directory (real or a `mmprm.models.tiny` preset).
        dtype: e.g. `torch.bfloat16` or "auto"; None keeps transformers' default.
        attn_implementation: "sdpa" (default), "flash_attention_2", "eager" or "auto"; checked by
            `resolve_attn_implementation` before loading. Vision towers get the same kernel.
        attn_key: the config key of `attn_implementation`, named in errors.
        bare: load the decoder without an LM head (`AutoModel`), for a PRM with its own head.

    Returns:
        (model, processor): `AutoModelForImageTextToText` for VLMs, `AutoModelForCausalLM` for
        text-only models (`AutoModel` when bare); the processor as `load_processor` returns it.
    """
    kwargs: dict[str, Any] = {"attn_implementation": resolve_attn_implementation(attn_implementation, attn_key)}
    use_grouped_query_sdpa()  # sdpa without repeated key/value heads where nothing changes (its docstring)
    if dtype is not None:
        kwargs["dtype"] = dtype
    if bare:
        auto_cls = AutoModel
    else:
        auto_cls = AutoModelForImageTextToText if is_multimodal(str(path)) else AutoModelForCausalLM
    try:
        model = auto_cls.from_pretrained(str(path), **kwargs)
    except ValueError as e:
        if kwargs["attn_implementation"] == "flex_attention" and "flex_attention" in str(e):
            from mmprm.config import ConfigError

            raise ConfigError(
                f"{attn_key}=flex_attention: this architecture has no FlexAttention in the installed transformers "
                f"({str(e).split(' does not support')[0]}): set {attn_key}=sdpa"
            ) from None
        raise
    return model, load_processor(path)


def add_step_token(processor: Any, model: nn.Module | None, token: str = STEP_TOKEN) -> int:
    """Add `token` as a special token (never split, never normalized) and make room for it.

    Idempotent: a second call returns the same id and changes nothing. The embedding matrix
    grows only when the new id does not fit (real checkpoints often have spare rows).

    Args:
        processor: a processor with `.tokenizer`, or a tokenizer.
        model: the backbone whose input (and output) embeddings must cover the id; None to only
            update the tokenizer (e.g. a processor loaded beside an already-resized model).
        token: the step token, `mmprm.steps.STEP_TOKEN` by default.

    Returns:
        The token's id.
    """
    tokenizer = getattr(processor, "tokenizer", processor)
    if token not in tokenizer.get_vocab():
        added = AddedToken(token, special=True, normalized=False, lstrip=False, rstrip=False, single_word=False)
        tokenizer.add_special_tokens({"extra_special_tokens": [added]}, replace_extra_special_tokens=False)
    token_id = tokenizer.convert_tokens_to_ids(token)
    if model is not None:
        # full_shape: under ZeRO-3 `.shape` of a partitioned weight is (0,), which would resize
        # (and shrink) every checkpoint with spare rows; `ds_shape` is the real size.
        rows = full_shape(model.get_input_embeddings().weight)[0]
        if token_id >= rows:
            # mean_resizing: the new row starts at the mean embedding, not at random noise.
            model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
    return token_id


def vision_tower_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters of the vision encoder, for freezing; empty for text-only models.

    The multimodal projector (Qwen's `visual.merger`, LLaVA/InternVL `multi_modal_projector`) is
    excluded. Works through wrappers (PRM heads, PEFT) because it matches parameter names.
    """
    return [param for name, param in model.named_parameters() if re.fullmatch(VISION_TOWER_PATTERN, name)]
