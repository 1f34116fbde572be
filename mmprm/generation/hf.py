"""Rollouts with transformers `generate` (CPU or one GPU), left-padded batches.

    backend = HFBackend.from_pretrained("runs/policy", SamplingConfig(), batch_size=64)
    texts = backend.generate(requests)

The prompt continues the partial assistant message (`rollout_prompt`), never a user turn that
restates the steps. All requests of a call are flattened into `n` rows each and generated in
chunks of `batch_size` rows, so the engine's large batches keep the device busy; a request's
prompt (and its images) is encoded and prefilled once for its rows in a chunk.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from mmprm.generation.base import (
    Completion,
    GenerationStats,
    ImageCache,
    RolloutInputError,
    RolloutRequest,
    SamplingConfig,
    StepMode,
    request_prompt,
    request_stops,
    stop_strings,
    torch_cpu_seed,
)
from mmprm.steps import needs_special_tokens


def penalize_repeats(input_ids: torch.Tensor, scores: torch.Tensor, penalty: float, pad_id: int | None) -> torch.Tensor:
    """Scores with every token seen in its row (prompt and rollout so far) penalized: a positive
    logit divided by `penalty`, a negative one multiplied, as vLLM and transformers do. A row's
    leading `pad_id` tokens are left padding, not seen tokens.

    input_ids (B, S), scores (B, V) -> (B, V). With ids [[pad, 5, 7]], logits 2.0 at 5 and
    -1.0 at 7 and penalty 2: 5 -> 1.0, 7 -> -2.0, the pad token's logit unchanged.
    """
    real = (
        (input_ids != pad_id).cumsum(dim=-1) > 0 if pad_id is not None else torch.ones_like(input_ids, dtype=torch.bool)
    )
    # Padding points at the row's last token (always real), so every write marks a seen token.
    ids = torch.where(real, input_ids, input_ids[:, -1:])
    seen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, ids, True)  # (B, V)
    penalized = torch.where(scores > 0, scores / penalty, scores * penalty)
    return torch.where(seen, penalized, scores)


class InverseCDFSampler:
    """A logits processor that samples: temperature, top-k and top-p as `generate` applies them,
    then one token per row by inverse CDF (one uniform draw, a cumulative sum, a binary search).
    Each row comes back as -inf except the drawn token, which greedy decoding then takes.

    Why: `generate`'s sampler, `torch.multinomial`, draws one exponential per vocabulary entry per
    row, a real share of a tiny model's decode step on CPU; one uniform per row costs next to
    nothing (`benchmarks/hf_sampling.py`; figures in docs/performance.md). The distribution is the
    same; the random stream is not, so the same seed draws other tokens than `do_sample=True` would.
    The draws use torch's global generator (`torch.manual_seed` makes them reproducible).
    `temperature` is one value, or a (rows, 1) tensor of each row's own. `repetition_penalty`
    (1.0: off) applies first, as in `generate`, to the tokens of each row after its left padding
    (`pad_id`), so a row samples the same in a padded batch as alone.
    """

    def __init__(
        self,
        temperature: float | torch.Tensor,
        top_k: int,
        top_p: float,
        repetition_penalty: float = 1.0,
        pad_id: int | None = None,
    ):
        from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        self.warpers = []
        if repetition_penalty != 1.0:
            self.warpers.append(lambda ids, scores: penalize_repeats(ids, scores, repetition_penalty, pad_id))
        if isinstance(temperature, torch.Tensor):
            self.warpers.append(lambda _ids, scores: scores / temperature.to(scores.device, scores.dtype))
        else:
            self.warpers.append(TemperatureLogitsWarper(temperature))
        if top_k > 0:
            self.warpers.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for warp in self.warpers:
            scores = warp(input_ids, scores)
        cdf = torch.softmax(scores.float(), dim=-1).cumsum(dim=-1)
        # u * total, not u: the float cumulative sum may end a hair below 1.
        u = torch.rand(cdf.shape[0], 1, device=cdf.device) * cdf[:, -1:]
        # right=True: a token of probability 0 (a flat stretch of the CDF) is never drawn.
        token = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1)
        return torch.full_like(scores, float("-inf")).scatter_(-1, token, 0.0)


def _select_rows(kwargs: dict[str, Any], row_keys: set[str], rows: torch.Tensor, n_rows: int) -> dict[str, Any]:
    """KWARGS with its per-row tensors cut to ROWS: those named in ROW_KEYS and `position_ids`
    (batch dimension 1 when 3D, as M-RoPE's), where that dimension has all N_ROWS (a shape of 1
    broadcasts). The rest (images, the cache, `cache_position`) as is."""
    out = dict(kwargs)
    for key in row_keys | {"position_ids"}:
        value = kwargs.get(key)
        dim = 1 if key == "position_ids" and value is not None and value.ndim == 3 else 0
        if value is not None and value.shape[dim] == n_rows:
            out[key] = value.index_select(dim, rows.to(value.device))
    return out


@contextlib.contextmanager
def prompt_prefilled_once(model: Any, row_prompt: torch.Tensor, row_keys: set[str]) -> Iterator[None]:
    """Within it, `model.generate` runs each distinct prompt's prefill once and decodes every row.

    Give `generate` one row per sequence to sample for the tensors named in ROW_KEYS (input ids,
    attention mask, token types), but the images of the distinct prompts only, once each in order.
    `row_prompt[r]` is row r's prompt among the distinct ones: rows of a prompt are neighbours,
    numbered in order, as in [0, 0, 1, 1, 1, 2]. The prefill, and the position ids computed before
    it, run on the first row of each prompt with those images; their logits, KV cache and M-RoPE
    offsets are then copied to every row of the prompt. Why: n rollouts of a prompt would otherwise
    run the vision tower and the prompt's prefill n times. Each row's numbers are those of an
    unshared prefill (no row's computation reads another's; tests/test_mcts_engine.py checks the
    rollouts bitwise on every tiny preset; `benchmarks/shared_prefill.py` measures the saving).

    Wraps two of `GenerationMixin`'s methods on this instance (`_prefill`,
    `_prepare_position_ids_for_generation`), restored on exit.
    """
    firsts = torch.ones_like(row_prompt, dtype=torch.bool)
    firsts[1:] = row_prompt[1:] != row_prompt[:-1]
    first_rows, n_rows = firsts.nonzero().squeeze(1), len(row_prompt)
    prefill, positions = model._prefill, model._prepare_position_ids_for_generation

    def spread_rope_offsets() -> None:
        # M-RoPE models (Qwen2-VL, Qwen2.5-VL) keep each row's text position offset for decoding.
        base = model.base_model
        deltas = getattr(base, "rope_deltas", None)
        if isinstance(deltas, torch.Tensor) and deltas.shape[0] == len(first_rows):
            base.rope_deltas = deltas[row_prompt.to(deltas.device)]

    def first_row_of_each(input_ids: torch.Tensor, model_kwargs: dict[str, Any]) -> tuple[torch.Tensor, dict]:
        kept = _select_rows({**model_kwargs, "input_ids": input_ids}, row_keys | {"input_ids"}, first_rows, n_rows)
        return kept.pop("input_ids"), kept

    def prompt_positions(inputs_tensor: torch.Tensor, model_kwargs: dict[str, Any]) -> torch.Tensor:
        out = positions(*first_row_of_each(inputs_tensor, model_kwargs))
        spread_rope_offsets()
        return _select_rows({"position_ids": out}, set(), row_prompt, len(first_rows))["position_ids"]

    def shared_prefill(input_ids: torch.Tensor, generation_config: Any, model_kwargs: dict[str, Any], **kw: Any):
        ids, kept = first_row_of_each(input_ids, model_kwargs)
        out = prefill(ids, generation_config, kept, **kw)
        spread = row_prompt.to(out.logits.device)
        out.logits = out.logits[spread]
        out.past_key_values.batch_select_indices(spread)
        spread_rope_offsets()
        return out

    model._prefill, model._prepare_position_ids_for_generation = shared_prefill, prompt_positions
    try:
        yield
    finally:
        del model._prefill, model._prepare_position_ids_for_generation


class HFBackend:
    """`RolloutBackend` over a transformers model and its processor.

    Args:
        model: a causal LM or image-text-to-text model (eval mode is set here).
        processor: its processor, or tokenizer for text-only models.
        sampling: temperature / top_k / top_p / repetition_penalty / max_new_tokens / seed.
        step_mode: prompt and stop format ("tags" stops at `</answer>`).
        batch_size: rows (sequences) per `generate` call.
        system: optional system prompt for every rollout.
    """

    def __init__(
        self,
        model: Any,
        processor: Any,
        sampling: SamplingConfig,
        step_mode: StepMode = "tags",
        batch_size: int = 64,
        system: str | None = None,
    ):
        sampling.validate()
        self.model = model.eval()
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        # Decoder-only generation appends after the last column: pad on the left.
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            # Llama 3 and others ship without a pad token; padded columns are masked out, so EOS serves.
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.sampling = sampling
        self.step_mode = step_mode
        self.batch_size = batch_size
        self.system = system
        self.multimodal = processor is not self.tokenizer
        self.stats = GenerationStats()
        eos = model.generation_config.eos_token_id
        self._stop_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self._stop_ids.add(self.tokenizer.eos_token_id)
        self._image = ImageCache()

    def close(self) -> None:
        """Release the model (and the accelerator memory it held) for the next one this process
        loads, as `VLLMBackend.close` does; generating afterwards is an error."""
        if self.__dict__.pop("model", None) is not None:
            from mmprm.models.loading import release_accelerator_memory

            release_accelerator_memory()

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        sampling: SamplingConfig,
        dtype: str | None = None,
        device: str | None = None,
        attn_implementation: str = "sdpa",
        **kwargs: Any,
    ) -> HFBackend:
        """Load with `mmprm.models.loading.load_backbone`; device defaults to this process's
        accelerator (`mmprm.models.loading.resolve_device("auto")`: its local rank's GPU, else the CPU).

        `attn_implementation` is the recipe's `model.attn_implementation` (sdpa, flash_attention_2,
        eager or auto), checked before loading.
        """
        from mmprm.models.loading import load_backbone, resolve_device

        torch_dtype = None if dtype in (None, "auto") else getattr(torch, dtype)
        model, processor = load_backbone(path, dtype=torch_dtype, attn_implementation=attn_implementation)
        device = device or resolve_device("auto")
        return cls(model.to(device), processor, sampling, **kwargs)

    def _prompt(self, index: int, req: RolloutRequest) -> tuple[str, list[Any]]:
        if req.images and not self.multimodal:
            raise RolloutInputError(
                index, f"problem {req.problem_id}: {len(req.images)} image(s) given but the model is text-only"
            )
        return request_prompt(index, req, self.processor, self._image, self.step_mode, self.system)

    @torch.no_grad()
    def generate(self, requests: list[RolloutRequest]) -> list[list[Completion]]:
        start = time.perf_counter()
        prompts = [self._prompt(i, r) for i, r in enumerate(requests)]
        rows = [(i, *prompts[i]) for i, r in enumerate(requests) for _ in range(r.n)]
        # A static batch runs as long as its longest row: group rows of similar depth (a deep
        # prefix leaves a short continuation) so short rollouts do not wait on long ones.
        rows.sort(key=lambda row: -len(requests[row[0]].prefix_steps))
        out: list[list[str]] = [[] for _ in requests]
        temperatures = [self.sampling.temperature if r.temperature is None else r.temperature for r in requests]
        for lo in range(0, len(rows), self.batch_size):
            chunk = rows[lo : lo + self.batch_size]
            row_t = [temperatures[i] for i, _, _ in chunk]
            # One value when the chunk shares it (always, unless requests set their own).
            t = row_t[0] if len(set(row_t)) == 1 else torch.tensor(row_t).unsqueeze(1)
            sampler = InverseCDFSampler(
                t,
                self.sampling.top_k,
                self.sampling.top_p,
                self.sampling.repetition_penalty,
                self.tokenizer.pad_token_id,
            )
            # A request's rows are neighbours (the sort above is stable): its prompt is encoded and
            # prefilled once (`prompt_prefilled_once`), its rows sampled apart.
            row_prompt, once = [], []
            for k, row in enumerate(chunk):
                if k == 0 or row[0] != chunk[k - 1][0]:
                    once.append(row)
                row_prompt.append(len(once) - 1)
            texts = [t for _, t, _ in once]
            special = needs_special_tokens(self.tokenizer, texts[0])  # one template: same for every row
            if self.multimodal and any(imgs for _, _, imgs in once):
                enc = self.processor(
                    text=texts,
                    images=[imgs for _, _, imgs in once],
                    padding=True,
                    return_tensors="pt",
                    add_special_tokens=special,
                )
            else:
                enc = self.tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=special)
            row_index = torch.tensor(row_prompt)
            # Token-aligned (ids, mask, token types), not images: integer tensors of the ids' shape.
            row_keys = {
                k
                for k, v in enc.items()
                if isinstance(v, torch.Tensor) and v.shape == enc["input_ids"].shape and not v.is_floating_point()
            }
            inputs = {k: (v[row_index] if k in row_keys else v).to(self.model.device) for k, v in enc.items()}
            # One seed per chunk: reruns of the same work sample the same rollouts.
            torch.manual_seed(torch_cpu_seed(self.sampling.seed + 1_000_003 * self.stats.calls + lo))
            with prompt_prefilled_once(self.model, row_index, row_keys):
                gen = self.model.generate(
                    **inputs,
                    # Sampling happens in InverseCDFSampler; the checkpoint's own sampling defaults
                    # (generation_config.json) are turned off so that they do not apply twice.
                    do_sample=False,
                    temperature=None,
                    top_k=None,
                    top_p=None,
                    logits_processor=[sampler],
                    max_new_tokens=self.sampling.max_new_tokens,
                    pad_token_id=self.tokenizer.pad_token_id,
                    stop_strings=request_stops(self.step_mode, requests) or None,
                    tokenizer=self.tokenizer,
                )
            new = gen[:, enc["input_ids"].shape[1] :].tolist()  # (rows, new tokens)
            for (i, _, _), ids in zip(chunk, new):
                stops = stop_strings(self.step_mode) + (requests[i].stop or [])
                ended = next((k + 1 for k, t in enumerate(ids) if t in self._stop_ids), None)
                self.stats.generated_tokens += ended or len(ids)
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                # No EOS and no stop string, yet the full budget used: cut at max_new_tokens.
                cut = ended is None and len(ids) >= self.sampling.max_new_tokens and not any(x in text for x in stops)
                out[i].append(Completion(text, truncated=cut))
        self.stats.calls += 1
        self.stats.sequences += len(rows)
        self.stats.seconds += time.perf_counter() - start
        return out
