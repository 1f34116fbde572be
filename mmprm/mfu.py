"""Model FLOPs utilization: the training FLOPs a token costs, and what the device can do at peak.

The convention is PaLM's (appendix B), as nanoGPT and torchtitan use it: a training token costs
6N FLOPs in the weight matmuls (forward 2N, backward 4N) plus 12 * L * H * S in attention scores
and values, where N counts every weight a token passes through (the vision tower's too), L is the
number of decoder layers, H their hidden size and S the sequence length.
"""

from __future__ import annotations

from typing import Any

# bf16 dense tensor-core peak, TFLOP/s, per the vendors' data sheets; the first name found in
# torch.cuda.get_device_name() wins, so the PCIe/NVL variants come before the bare name.
PEAK_BF16_TFLOPS: dict[str, float] = {
    "H200": 989.5,
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.5,
    "A100": 312.0,
}


def flops_per_token(n_params: int, n_layers: int, hidden: int, seq_len: float) -> float:
    """Training FLOPs (forward and backward) of one token: 6 * n_params + 12 * n_layers * hidden * seq_len.

    Args:
        n_params: weights a token passes through (the input embedding, a lookup, left out).
        n_layers: decoder layers.
        hidden: the decoder's hidden size.
        seq_len: the length of the sequence the token attends within.
    """
    return 6.0 * n_params + 12.0 * n_layers * hidden * seq_len


def _hf_model(model: Any) -> Any:
    """The first (outermost) submodule carrying a transformers config."""
    for module in model.modules():
        if hasattr(getattr(module, "config", None), "get_text_config"):
            return module
    raise ValueError(f"no transformers config in {type(model).__name__}: cannot count its FLOPs per token")


def _numel(p: Any) -> int:
    # under ZeRO-3 a partitioned parameter is empty here and keeps its full size in ds_numel
    return int(getattr(p, "ds_numel", p.numel()))


def model_shape(model: Any) -> tuple[int, int, int]:
    """(n_params, n_layers, hidden) of a transformers model, or a wrapper holding one (a PRM head).

    n_params counts every parameter, frozen or trained, the vision tower's included, less the input
    embedding unless the LM head shares it. Call it before the model is sharded or partitioned.
    """
    hf = _hf_model(model)
    text = hf.config.get_text_config()
    embed = hf.get_input_embeddings()
    out = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    skip = set() if embed is None else {id(p) for p in embed.parameters()}
    if out is not None:
        skip -= {id(p) for p in out.parameters()}  # tied: the LM head's matmul is real work
    n = sum(_numel(p) for p in {id(p): p for p in model.parameters()}.values() if id(p) not in skip)
    return n, int(text.num_hidden_layers), int(text.hidden_size)


def peak_flops(peak_tflops: float | None, device_name: str | None) -> float | None:
    """Peak FLOP/s of one device: `peak_tflops` when set, else the table's bf16 figure for a known
    GPU name, else None (a CPU, or a GPU not in `PEAK_BF16_TFLOPS`)."""
    if peak_tflops is not None:
        return peak_tflops * 1e12
    if device_name is None:
        return None
    for name, tflops in PEAK_BF16_TFLOPS.items():
        if name in device_name:
            return tflops * 1e12
    return None
