"""Generation: rollout backends behind one interface (`base.RolloutBackend`: HF generate, vLLM,
simulated) and the policy spec a trained policy carries (`mmprm.generation.policy`).

Annotation, Best-of-N generation, PRM-guided search and tree evaluation all sample through these.
Backends import their engine lazily, so `import mmprm.generation` needs neither torch generation
nor vllm. `make_rollout_backend` is how every recipe builds one.
"""

from __future__ import annotations

from typing import Any

from mmprm.generation.base import (
    GenerationStats,
    RolloutBackend,
    RolloutInputError,
    RolloutRequest,
    SamplingConfig,
    rollout_prompt,
)


def make_rollout_backend(
    path: str,
    sampling: SamplingConfig,
    step_mode: str,
    system: str | None,
    *,
    backend: str = "hf",
    batch_size: int = 32,
    dtype: str | None = None,
    attn_implementation: str = "sdpa",
    gpu_memory_utilization: float | None = None,
    max_model_len: int | None = None,
    vllm_kwargs: dict[str, Any] | None = None,
) -> RolloutBackend:
    """A policy's rollout backend on this process's own accelerator.

    With several processes on a node (torchrun/accelerate: LOCAL_RANK; srun: SLURM_LOCALID), each
    takes the GPU of its node-local rank: vLLM through CUDA_VISIBLE_DEVICES (set before the engine
    starts CUDA; one the user set wins), HF generate on `mmprm.models.loading.resolve_device("auto")`
    (HFBackend's default device).
    vLLM's engine gets `dtype` (None: "auto"), `gpu_memory_utilization` and `max_model_len` when
    set (None: vLLM's defaults, the model's context length), then `vllm_kwargs` (any other
    `vllm.LLM` argument; a key named here too wins). `attn_implementation` is the HF model's kernel
    (sdpa, flash_attention_2, eager, auto).
    """
    if backend == "vllm":
        from mmprm.generation.vllm import VLLMBackend, pin_local_gpu

        engine: dict[str, Any] = {"dtype": dtype or "auto"}
        if gpu_memory_utilization is not None:
            engine["gpu_memory_utilization"] = gpu_memory_utilization
        if max_model_len:
            engine["max_model_len"] = max_model_len
        engine.update(vllm_kwargs or {})
        pin_local_gpu(int(engine.get("tensor_parallel_size", 1)))
        return VLLMBackend(path, sampling, step_mode=step_mode, system=system, **engine)
    if backend != "hf":
        raise ValueError(f"backend: {backend!r} is not one of ['hf', 'vllm']")
    from mmprm.generation.hf import HFBackend

    return HFBackend.from_pretrained(
        path,
        sampling,
        dtype=dtype,
        step_mode=step_mode,
        batch_size=batch_size,
        system=system,
        attn_implementation=attn_implementation,
    )


__all__ = [
    "GenerationStats",
    "RolloutBackend",
    "RolloutInputError",
    "RolloutRequest",
    "SamplingConfig",
    "make_rollout_backend",
    "rollout_prompt",
]
