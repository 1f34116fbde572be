"""Config sections several recipes share, each defined once with its help (`Attributes:`).

A recipe's config composes these with sections of its own; `mmprm.config.load_config` reads them
like any other. The sampling section is `mmprm.generation.base.SamplingConfig`, the one the
generation backends take. Every recipe that samples a policy composes `PolicyConfig` under
`policy`, and every one that scores with a PRM composes `PRMScorerConfig` under `prm`; their
`build()` is the one place a recipe gets a rollout backend or a PRM scorer from.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from mmprm.generation.base import SamplingConfig, StepMode
from mmprm.models.spec import AttnImplementation, ReleasedConvention

__all__ = [
    "AttnImplementation",
    "ModelLoadConfig",
    "PRMScorerConfig",
    "PolicyConfig",
    "ShardConfig",
    "TrainFilesConfig",
    "VLLMConfig",
]


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


@dataclass
class TrainFilesConfig:
    """A training recipe's rows and their tokenization (each recipe adds its own data settings).

    Attributes:
        train_file: training rows (JSONL); required
        eval_file: held-out rows for evaluation; null skips evaluation
        max_length: tokens per example
        num_proc: tokenization workers; null: the CPUs, at most 16
        cache_dir: tokenized-data cache (Arrow); null: $MMPRM_CACHE, else ~/.cache/mmprm/tokenized
    """

    train_file: str = ""
    eval_file: str | None = None
    max_length: int = 2048
    num_proc: int | None = None
    cache_dir: str | None = None


@dataclass
class VLLMConfig:
    """The vLLM engine's settings (backend=vllm).

    Attributes:
        gpu_memory_utilization: share of GPU memory the engine may take; null: vLLM's default (0.9)
        max_model_len: context length (prompt + generated); null takes the model's
        kwargs: more vllm.LLM arguments, e.g. {enforce_eager: true}; a key named above too wins
    """

    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class PolicyConfig:
    """The policy that generates (solutions, search steps, rollouts).

    Attributes:
        path: policy model directory (e.g. recipes/policy_sft.py's output) or hub id
        backend: hf (transformers generate, CPU or GPU) | vllm (one engine per GPU)
        dtype: torch dtype name (e.g. bfloat16) or auto; null keeps the checkpoint's
        batch_size: hf: sequences per generate call (vllm schedules its own batches)
        step_mode: how steps are written and read: tags (SFT'd policy) | blank_lines; unset (null)
            takes the policy's saved spec (mmprm_policy.json from recipes/policy_sft.py), else tags
        system_prompt: system prompt sent to the policy; unset (null) takes the saved spec, "" sends none
        sampling: sampling settings (section)
        vllm: backend=vllm: the engine (section)
    """

    path: str = ""
    backend: Literal["hf", "vllm"] = "hf"
    dtype: str | None = None
    batch_size: int = 64
    step_mode: StepMode | None = None
    system_prompt: str | None = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)

    def validate(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"policy.batch_size: {self.batch_size} must be >= 1")

    def build(
        self,
        attn_implementation: AttnImplementation = "sdpa",
        *,
        sampling: SamplingConfig | None = None,
        saved_prompt: bool = True,
        key: str = "policy",
    ) -> Any:
        """The policy's rollout backend (`mmprm.generation.make_rollout_backend`).

        Args:
            attn_implementation: the HF model's attention kernel (`model.attn_implementation`).
            sampling: these settings instead of `sampling` (e.g. a shard's own seed).
            saved_prompt: prompt the policy as its SFT saved it (`mmprm_policy.json`) unless
                `system_prompt` / `step_mode` say otherwise (then with a warning); False sends
                `system_prompt` as it is (null: none) and writes `step_mode` (null: blank_lines).
            key: where this section sits in the recipe's config, for error messages.
        """
        from mmprm.config import ConfigError
        from mmprm.generation import make_rollout_backend
        from mmprm.generation.policy import resolve_prompt_format

        if saved_prompt:
            try:
                system, step_mode = resolve_prompt_format(self.path, self.system_prompt, self.step_mode, where=key)
            except ValueError as e:  # a broken mmprm_policy.json
                raise ConfigError(f"{key}.path: {e}") from None
        else:
            system, step_mode = self.system_prompt, self.step_mode or "blank_lines"
        return make_rollout_backend(
            self.path,
            sampling if sampling is not None else self.sampling,
            step_mode,
            system,
            backend=self.backend,
            batch_size=self.batch_size,
            dtype=self.dtype,
            attn_implementation=attn_implementation,
            gpu_memory_utilization=self.vllm.gpu_memory_utilization,
            max_model_len=self.vllm.max_model_len,
            vllm_kwargs=self.vllm.kwargs,
        )

    def sampling_for(self, worker: int, **changes: Any) -> SamplingConfig:
        """`sampling` with worker WORKER's own seed stream (`worker_seed`: a shard or rank samples
        its own, and a rerun of it the same) and CHANGES."""
        from mmprm.generation.base import worker_seed

        return replace(self.sampling, seed=worker_seed(self.sampling.seed, worker), **changes)


@dataclass
class PRMScorerConfig:
    """The PRM that scores steps (`mmprm.load_prm`).

    Attributes:
        path: PRM directory written by recipes/prm_train.py (or a released PRM, with convention); null: none
        convention: a released PRM that mmprm did not write, scored as its authors do:
            math_shepherd | qwen2_5_math_prm | rlhflow | mm_prm | visualprm (docs/released-prms.md);
            null: one mmprm trained
        backend: hf (the PRM in this process) | vllm (a vLLM engine, pip install 'mmprm[vllm]'; the
            same scores, served the way large runs serve reward models)
        device: hf: auto (cuda when available, else cpu), cpu, cuda or cuda:N
        batch_size: sequences per forward
        max_length: tokens per scored sequence; steps past it are not scored (NaN); null: no truncation
        max_batch_tokens: hf: padded tokens per forward (rows of several questions share one, longest
            first, up to batch_size rows); null: batch_size rows whatever their length
        compile: hf: torch.compile each decoder layer (`mmprm.models.compile_layers`); the same scores
        vllm: backend=vllm: the engine (section)
    """

    path: str | None = None
    convention: ReleasedConvention | None = None
    backend: Literal["hf", "vllm"] = "hf"
    device: str = "auto"
    batch_size: int = 8
    max_length: int | None = None
    max_batch_tokens: int | None = 65536  # mmprm.models.prm.MAX_BATCH_TOKENS, without importing torch
    compile: bool = False
    vllm: VLLMConfig = field(default_factory=VLLMConfig)

    def validate(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"prm.batch_size: {self.batch_size} must be >= 1")
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            raise ValueError(f"prm.max_batch_tokens: {self.max_batch_tokens} must be >= 1 (null: no token budget)")
        if self.compile and self.backend != "hf":
            raise ValueError("prm.compile: applies to backend hf only (vLLM compiles its model itself)")

    def build(self, attn_implementation: AttnImplementation = "sdpa") -> Any:
        """The PRM scorer (`mmprm.models.prm.load_prm`): HF in this process or a vLLM engine.

        Args:
            attn_implementation: the HF model's attention kernel (`model.attn_implementation`).
        """
        from mmprm.models.loading import resolve_device
        from mmprm.models.prm import load_prm

        engine: dict[str, Any] = {}
        if self.vllm.gpu_memory_utilization is not None:
            engine["gpu_memory_utilization"] = self.vllm.gpu_memory_utilization
        if self.vllm.max_model_len:
            engine["max_model_len"] = self.vllm.max_model_len
        return load_prm(
            self.path,
            device=resolve_device(self.device),
            batch_size=self.batch_size,
            max_length=self.max_length,
            max_batch_tokens=self.max_batch_tokens,
            compile=self.compile,
            attn_implementation=attn_implementation,
            backend=self.backend,
            vllm_kwargs={**engine, **self.vllm.kwargs},
            convention=self.convention,
        )
