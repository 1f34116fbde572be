"""The rollout backend interface: prompt pieces in, `n` sampled continuations out.

    texts = backend.generate([RolloutRequest("p1", question, images, prefix_steps=["..."], n=16)])
    # texts[0] is a list of 16 strings, each the policy's continuation of the partial answer;
    # each is a `Completion` whose `.truncated` says the sampler cut it at max_new_tokens

A backend only generates text. Parsing steps, checking answers and the search live elsewhere, so
HF, vLLM and the simulated policy are interchangeable (and the engine can batch many problems'
requests into one call).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from mmprm.data import schema
from mmprm.steps import ANSWER_CLOSE, continuation_prompt, continue_assistant

StepMode = Literal["tags", "blank_lines"]


@dataclass
class RolloutRequest:
    """Sample `n` continuations of a partial solution.

    images are absolute paths; prefix_steps are the steps so far (the start of the assistant turn).
    stop: extra stop strings (PRM-guided search stops at the end of one step); the requests of one
    `generate` call must share them.
    temperature: this request's sampling temperature; None samples at the backend's
        `sampling.temperature` (the annotation engine sets `sampling.prefix_temperature` here).
    seed: this request's seed offset: sample j is seeded `sampling.seed + seed + j` however the
        request is batched (the annotation engine keys it on the problem and its probe, see
        `probe_seed`); None: derived from the call (`request_seeds`). vLLM and the simulated
        policy honour it; the HF backend seeds each call.
    """

    problem_id: str
    question: str
    images: list[str]
    prefix_steps: list[str]
    n: int
    stop: list[str] | None = None
    temperature: float | None = None
    seed: int | None = None


@dataclass
class SamplingConfig:
    """Sampling of rollouts; defaults are MM-PRM's.

    Attributes:
        temperature: 1.0 - sample the policy as it is, so MC values estimate its real success rate.
        prefix_temperature: the temperature of the rollouts that continue a step prefix (the
            binary search's probes, whose MC values label the steps); None: `temperature`. The
            root's rollouts, the solutions the search looks for errors in, keep `temperature`.
            Below 1 a rollout follows the prefix as the policy most often would: a wrong step's
            MC value is less often lifted by a rollout that happens to repair it, and a right
            step's less often lowered by a fresh slip, so the labels sit closer to the steps'
            own correctness and the binary search lands on the first error more often; the MC
            value then estimates a sharpened policy's success, not the policy's own.
        top_k: keep the k most likely tokens (0 turns it off); 50 cuts the long tail that only
            produces garbage steps.
        top_p: nucleus sampling mass; 0.9, with top_k, cuts that tail too.
        repetition_penalty: every token already in the prompt or the rollout has its logit divided
            by this where positive and multiplied where negative (vLLM's and transformers' rule);
            1.0 turns it off. MM-PRM's rollouts use 1.05 (its data_pipeline/llm_utils.py).
        max_new_tokens: 4096 (MM-PRM's value), the cap per rollout. A rollout cut there is
            unfinished: it counts as not correct in MC estimates but is never searched for an
            error (`mmprm.annotate.omega`); records count such rollouts as `truncated_rollouts`.
        seed: base seed; each backend call derives its own, so reruns are reproducible.
        seed_each_request: give every vLLM request its own seed, so a rerun repeats each sample.
            Seeded requests take vLLM's per-request sampling path instead of its fast batched
            top-k/top-p kernel (vLLM issue 42472), which costs throughput at large batches; false
            seeds the engine once with `seed`: the same distribution, not the same samples. The HF
            backend seeds each call either way.
    """

    temperature: float = 1.0
    prefix_temperature: float | None = None
    top_k: int = 50
    top_p: float = 0.9
    repetition_penalty: float = 1.0
    max_new_tokens: int = 4096
    seed: int = 0
    seed_each_request: bool = True

    def validate(self) -> None:
        if self.temperature <= 0:
            raise ValueError("sampling.temperature must be > 0 (rollouts are sampled, not greedy)")
        if self.prefix_temperature is not None and self.prefix_temperature <= 0:
            raise ValueError("sampling.prefix_temperature must be > 0 or null (null: sampling.temperature)")
        if not 0 < self.top_p <= 1 or self.top_k < 0 or self.max_new_tokens < 1:
            raise ValueError("sampling: need 0 < top_p <= 1, top_k >= 0 (0 = off), max_new_tokens >= 1")
        if self.repetition_penalty <= 0:
            raise ValueError("sampling.repetition_penalty must be > 0 (1.0 turns it off)")


class Completion(str):
    """A sampled continuation: the text, plus whether the sampler cut it at `max_new_tokens`.

    A str, so callers that only need the text use it as one; a plain str counts as not cut.
    """

    truncated: bool

    def __new__(cls, text: str, truncated: bool = False) -> Completion:
        obj = super().__new__(cls, text)
        obj.truncated = truncated
        return obj


def was_truncated(text: str) -> bool:
    """Whether a backend's output was cut at max_new_tokens (plain strings never are)."""
    return bool(getattr(text, "truncated", False))


# Seeds one worker (annotation rank, Best-of-N shard) can use: 2**40 = a million calls of a
# million samples each.
STREAM_SEED_STRIDE = 1 << 40


def worker_seed(base: int, worker: int) -> int:
    """Base seed of worker `worker` (rank or shard), so that workers' request seeds never overlap.

    Seeds `base + worker` would give worker 1's first request seeds `base + 1 ..`, the same as
    worker 0's samples 1.. of its first request: rollouts of different problems, correlated.

    >>> worker_seed(0, 2)
    2199023255552
    """
    return base + worker * STREAM_SEED_STRIDE


def torch_cpu_seed(seed: int) -> int:
    """SEED as torch's CPU generator can tell it apart: it keeps a seed's low 32 bits only, so
    `worker_seed` streams (workers 2**40 apart) would all draw worker 0's numbers. A seed below
    2**32 is kept as it is; a larger one is hashed to 32 bits (two of them collide with odds
    about 2**-32).

    >>> torch_cpu_seed(7), torch_cpu_seed(worker_seed(7, 1)) == 7
    (7, False)
    """
    if 0 <= seed < 1 << 32:
        return seed
    digest = hashlib.blake2b(seed.to_bytes(16, "big", signed=True), digest_size=4).digest()
    return int.from_bytes(digest, "big")


def request_seeds(base: int, call: int, ns: Sequence[int]) -> list[int]:
    """Per-request sampling seeds for one backend call, spaced so no two samples share a seed.

    vLLM seeds sample j of a request with `seed + j`, so request i gets `seed_i .. seed_i + n_i - 1`.
    Seeds s and s + 1 for consecutive requests would share n - 1 samples' seeds and correlate
    different problems' rollouts; here each request starts where the previous one's range ends,
    and call c starts at `base + 1_000_003 * c` (a call carries far fewer samples than that).

    >>> request_seeds(7, 0, [4, 4, 2])
    [7, 11, 15]
    """
    seeds, offset = [], base + 1_000_003 * call
    for n in ns:
        seeds.append(offset)
        offset += n
    return seeds


def probe_seed(problem_id: str, rollouts_before: int) -> int:
    """Seed offset of a search's probe: a 56-bit hash of the problem id plus the rollouts its
    search drew before it, so a probe samples the same rollouts whether it went out alone, in a
    round with other problems' probes, or continuously, and after a resume.

    A probe's n samples take offsets `rollouts_before .. rollouts_before + n - 1`, the next probe
    starts after them; two problems' ranges overlap with odds of about (rollouts / 2**56) per pair.

    >>> probe_seed("p1", 16) - probe_seed("p1", 0)
    16
    """
    digest = hashlib.blake2b(problem_id.encode("utf-8"), digest_size=7).digest()
    return int.from_bytes(digest, "big") + rollouts_before


@dataclass
class GenerationStats:
    """Running totals a backend keeps, for progress bars and the throughput benchmark."""

    calls: int = 0
    sequences: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class ImageCache:
    """Decoded images by path, the `size` most recently used kept.

    A problem's image is sent with every rollout call of its search (tens of probes): it is
    decoded once, and memory stays bounded as problems finish.
    """

    def __init__(self, size: int = 256):
        self.size = size
        self._items: OrderedDict[str, Any] = OrderedDict()

    def __call__(self, path: str) -> Any:
        image = self._items.pop(path, None)
        if image is None:
            image = schema.load_image(path)
        self._items[path] = image
        if len(self._items) > self.size:
            self._items.popitem(last=False)
        return image


def problems_per_call(backend: Any, n: int, batch_size: int) -> int:
    """Problems (of `n` samples each) to send in one `generate` call of whole solutions.

    A backend that schedules its own batches (vLLM: `sequences_per_call`) gets many: a call that
    ends waits for its longest samples with the engine emptying, so short calls leave it idle; a
    call's results are still written as soon as it returns, so a kill loses at most one call. Any
    other backend runs `batch_size` rows at a time, and gets that many sequences per call.
    """
    return max(1, getattr(backend, "sequences_per_call", batch_size) // n)


class RolloutInputError(ValueError):
    """One request cannot be turned into a prompt (unreadable image, placeholder mismatch).

    The engine marks that problem as an error and retries the rest of the batch.
    """

    def __init__(self, index: int, message: str):
        self.index = index
        super().__init__(message)


class RolloutBackend(Protocol):
    """What the engine needs from a generation backend."""

    stats: GenerationStats

    def generate(self, requests: list[RolloutRequest]) -> list[list[str]]:
        """Return, per request, its `n` sampled continuations (text after the prefix)."""
        ...

    def close(self) -> None:
        """Free the model and the memory it holds; generating afterwards is an error."""
        ...


class ContinuousBackend(RolloutBackend, Protocol):
    """A backend that also takes requests one at a time while others are still generating.

        ticket = backend.submit(request)        # queued; the engine keeps decoding the others
        for ticket, texts in backend.poll():    # one engine step; the requests it finished
            ...

    The annotation engine uses it (`engine.continuous`) so that a search whose probe returns
    sends its next probe at once, instead of waiting for the longest rollout of a round.
    """

    def submit(self, request: RolloutRequest) -> int:
        """Queue one request; its prompt errors raise `RolloutInputError` (index 0) here."""
        ...

    def poll(self) -> list[tuple[int, list[str]]]:
        """Advance generation; return (ticket, n continuations) of each request that finished."""
        ...

    def cancel(self, tickets: Collection[int] | None = None) -> None:
        """Drop these submitted requests (one that took too long), or every one still in flight
        (the caller stops midway)."""
        ...


def is_continuous(backend: Any) -> bool:
    """Whether `backend` takes requests continuously (`ContinuousBackend`)."""
    return all(callable(getattr(backend, name, None)) for name in ("submit", "poll", "cancel"))


def rollout_prompt(
    processor: Any,
    question: str,
    num_images: int,
    prefix_steps: Sequence[str],
    step_mode: StepMode = "tags",
    system: str | None = None,
) -> str:
    """Chat prompt whose assistant turn already holds the prefix, for the policy to continue.

    tags: `<step>...</step>` per step (`mmprm.steps.continuation_prompt`); blank_lines: steps
    separated by blank lines, the format such a policy writes itself.
    """
    if step_mode == "tags":
        return continuation_prompt(processor, question, num_images, prefix_steps, system)
    return continue_assistant(
        processor, question, num_images, "".join(f"{s.strip()}\n\n" for s in prefix_steps), system
    )


def request_prompt(
    index: int,
    req: RolloutRequest,
    processor: Any,
    image: ImageCache,
    step_mode: StepMode,
    system: str | None,
) -> tuple[str, list[Any]]:
    """Request `index`'s prompt text (`rollout_prompt`) and its decoded images, as every backend
    builds them. What is the problem's own fault (an undecodable image, a placeholder mismatch)
    is its `RolloutInputError`; a failed read is an outage that a rerun retries, so it propagates."""
    try:
        images = [image(p) for p in req.images]
        text = rollout_prompt(processor, req.question, len(images), req.prefix_steps, step_mode, system)
    except schema.ImageReadError:
        raise
    except (OSError, ValueError) as e:
        raise RolloutInputError(index, f"problem {req.problem_id}: {e}") from e
    return text, images


def stop_strings(step_mode: StepMode) -> list[str]:
    """Text that ends a rollout early: the closing answer tag (tags mode); EOS otherwise."""
    return [ANSWER_CLOSE] if step_mode == "tags" else []


def request_stops(step_mode: StepMode, requests: Sequence[RolloutRequest]) -> list[str]:
    """Stop strings of one batched call: the mode's plus the requests' shared extra ones."""
    extra = {tuple(r.stop or ()) for r in requests}
    if len(extra) > 1:
        raise ValueError("requests of one generate call have different stop strings: send them in separate calls")
    return stop_strings(step_mode) + list(extra.pop() if extra else ())
