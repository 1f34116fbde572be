"""What code outside DeepSpeed must know about ZeRO-3 partitioned parameters.

Under ZeRO-3 (`zero.Init`, which accelerate turns on with `zero3_init_flag`) every parameter
above `stage3_param_persistence_threshold` elements keeps only its rank's slice: `param.shape`
is `(0,)`, the real shape is `param.ds_shape`, the slice is `param.ds_tensor`. DeepSpeed gathers
a parameter for you only inside the forward of the module that owns it; code that reads a weight
directly (an embedding's row count, a few rows of the LM head) must gather it itself:

    with gathered([emb.weight]):       # no-op unless the weight is partitioned
        rows = emb.weight.shape[0]

deepspeed is imported only when a parameter is partitioned (which means it is installed).
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "embedding_parameter_names",
    "full_shape",
    "gathered",
    "is_partitioned",
    "log_zero3_partitions",
    "merge_lora_copy",
    "partition_report",
    "partition_summary",
]


def is_partitioned(param: torch.Tensor) -> bool:
    """True for a ZeRO-3 parameter (it carries `ds_id`), whether or not it is gathered right now."""
    return hasattr(param, "ds_id")


def full_shape(param: torch.Tensor) -> torch.Size:
    """The parameter's real shape: `ds_shape` under ZeRO-3 (where `.shape` may be `(0,)`)."""
    return torch.Size(param.ds_shape) if is_partitioned(param) else param.shape


@contextlib.contextmanager
def gathered(params: Iterable[torch.Tensor], modifier_rank: int | None = None) -> Iterator[None]:
    """Gather partitioned ZeRO-3 parameters for the block; nothing happens for plain tensors.

    Args:
        params: parameters the block reads (or writes).
        modifier_rank: rank whose in-place changes are scattered back on exit; None for read-only.
    """
    sharded = [p for p in params if is_partitioned(p)]
    if not sharded:
        yield
        return
    import deepspeed  # present: only DeepSpeed sets ds_id

    with deepspeed.zero.GatheredParameters(sharded, modifier_rank=modifier_rank):
        yield


def merge_lora_copy(model: nn.Module, state_dict: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """A copy of a PEFT model with its LoRA adapters merged into the base weights, ready to save.

    Args:
        model: the trained PEFT model; left as it is (merging writes into the base weights).
        state_dict: its full weights gathered across ranks (`accelerator.get_state_dict`), keyed as
            its `named_parameters`: under ZeRO-3 the module holds only this rank's empty slices,
            so the copy takes these (cloned: the dict is not changed). None merges the module's own.
    """
    merged = copy.deepcopy(model)
    if state_dict is not None:
        for name, param in merged.named_parameters():
            param.data = state_dict[name].clone()
    return merged.merge_and_unload()


def partition_report(model: nn.Module) -> list[dict[str, Any]]:
    """One row per parameter: its full size against what this rank holds.

    Rows: name, shape (full), numel (full), local_numel (elements this rank keeps between forwards:
    its ZeRO-3 slice, or the whole tensor), partitioned (False for plain tensors and for ZeRO-3
    parameters under `stage3_param_persistence_threshold`, which every rank keeps whole).
    Over 2 ranks a partitioned weight has local_numel = ceil(numel / 2).
    """
    rows = []
    for name, param in model.named_parameters():
        partitioned = is_partitioned(param) and not getattr(param, "ds_persist", False)
        numel = int(param.ds_numel) if is_partitioned(param) else param.numel()
        local = int(param.ds_tensor.numel()) if partitioned else numel
        rows.append(
            {
                "name": name,
                "shape": list(full_shape(param)),
                "numel": numel,
                "local_numel": local,
                "partitioned": partitioned,
            }
        )
    return rows


def embedding_parameter_names(model: nn.Module) -> list[str]:
    """Names (in `model`) of the input embedding and LM head weights of the first HF model inside."""
    hf = next((m for m in model.modules() if hasattr(m, "get_input_embeddings")), None)
    if hf is None:
        return []
    wanted = [hf.get_input_embeddings(), hf.get_output_embeddings()]
    ids = {id(m.weight) for m in wanted if m is not None}
    return [name for name, p in model.named_parameters() if id(p) in ids]


def partition_summary(model: nn.Module, rows: list[dict[str, Any]] | None = None) -> str:
    """One log line: how much of the model this rank holds, the embeddings and LM head spelled out."""
    rows = partition_report(model) if rows is None else rows
    parts = [r for r in rows if r["partitioned"]]
    held = sum(r["local_numel"] for r in rows)
    total = sum(r["numel"] for r in rows)
    line = f"ZeRO-3: {len(parts)} of {len(rows)} parameters partitioned; this rank holds {held:,} of {total:,} elements"
    by_name = {r["name"]: r for r in rows}
    for name in embedding_parameter_names(model):
        r = by_name[name]
        state = "partitioned" if r["partitioned"] else "whole: under stage3_param_persistence_threshold"
        line += f"; {name} {r['shape']}: {r['local_numel']:,} of {r['numel']:,} here ({state})"
    return line


def log_zero3_partitions(accelerator: Any, model: nn.Module, out_dir: Path, log: Callable[[str], None]) -> None:
    """After `accelerator.prepare`: under ZeRO-3, log what this rank really holds (`partition_summary`)
    and write rank 0's `partition_report` to OUT_DIR/zero3_partitions.json. Nothing without DeepSpeed:
    then `unwrap_model` is not called, as it imports deepspeed whenever it is installed (half a
    second before the first step of every plain run)."""
    if accelerator.state.deepspeed_plugin is None:
        return
    unwrapped = accelerator.unwrap_model(model)
    partitions = partition_report(unwrapped)
    if not any(r["partitioned"] for r in partitions):
        return  # ZeRO-2, or every weight under the persistence threshold
    log(partition_summary(unwrapped, partitions))
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "zero3_partitions.json").write_text(
            json.dumps({"num_processes": accelerator.num_processes, "rank": 0, "parameters": partitions}, indent=1)
        )
