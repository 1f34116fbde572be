"""The PRM scorer fills its forwards: rows of many questions per forward under a token budget, the
prompt's KV cache shared without a copy, inputs prepared on a background thread. Scores stay those
of scoring each question alone."""

import threading

import pytest
import torch
from PIL import Image
from transformers import DynamicCache

import mmprm.models.prm as prm_module
from mmprm.models.loading import load_backbone
from mmprm.models.prm import PRMScorer, PRMSpec, batch_chunks, build_prm

ARCHS = ["qwen2_vl", "qwen2_5_vl", "internvl", "llava"]


def _prm(tiny_models, arch, head="value"):
    backbone, processor = load_backbone(tiny_models(arch))
    torch.manual_seed(0)
    return build_prm(backbone, processor, PRMSpec(head=head)), processor


def _examples() -> list[dict]:
    """Four questions (two with an image, two text-only, prompts of different lengths) of 2-3
    candidates each, and two single examples, interleaved."""
    red, blue = Image.new("RGB", (56, 42), (200, 30, 30)), Image.new("RGB", (42, 56), (30, 30, 200))
    questions = [
        ("Add the tiles.", [red]),
        ("How many blue tiles are in the second row of the picture, counted from the left?", [blue]),
        ("What is 3 + 4?", []),
        ("A long question with no image: the sum of the first four odd numbers is what?", []),
    ]
    cands = [
        ["Tile 1 is 3.", "3 + 4 = 7."],
        ["Tile 1 is 5.", "5 + 4 = 9.", "So 9."],
        ["7."],
        ["a", "b", "c", "d"],
        ["Tile 1 is 3.", "3 + 4 = 8."],
    ]
    out = []
    for q, (question, images) in enumerate(questions):
        for c in range(2 + q % 2):
            out.append({"id": f"q{q}c{c}", "question": question, "images": images, "steps": cands[(q + c) % 5]})
    out.insert(3, {"id": "s0", "question": "Alone with an image.", "images": [red], "steps": ["One.", "Two."]})
    out.append({"id": "s1", "question": "Alone, text.", "images": [], "steps": ["x = 1.", "So 1."]})
    return out


def _per_question(scorer: PRMScorer, examples: list[dict], share_prefix: bool) -> list[list[float]]:
    """Each question's examples scored in a call of their own, in the input's order."""
    by_question: dict[str, list[int]] = {}
    for i, ex in enumerate(examples):
        by_question.setdefault(ex["question"], []).append(i)
    out: list[list[float]] = [[] for _ in examples]
    for idx in by_question.values():
        for i, s in zip(idx, scorer.score([examples[i] for i in idx], share_prefix=share_prefix)):
            out[i] = s
    return out


def _worst(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(s) for s in a] == [len(s) for s in b]
    return max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))


def test_batch_chunks_cut_by_rows_and_padded_tokens():
    assert batch_chunks([1, 2, 3, 4, 5], batch_size=2, max_tokens=None) == [[0, 1], [2, 3], [4]]
    # padded size is rows x longest: 2 x 5 = 10 fits, 3 x 5 does not; a row over the budget runs alone
    assert batch_chunks([4, 5, 5, 30, 2], batch_size=8, max_tokens=10) == [[0, 1], [2], [3], [4]]
    # rows on prompt caches pad the prompt and the rest apart: (8 + 4) x 2 = 24, not 10 x 2
    assert batch_chunks([10, 6], batch_size=8, max_tokens=20, prefixes=[8, 2]) == [[0], [1]]
    assert batch_chunks([10, 6], batch_size=8, max_tokens=24, prefixes=[8, 2]) == [[0, 1]]
    assert batch_chunks([], batch_size=4, max_tokens=10) == []


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("sharing", ["trees", "prompt_cache", "plain"])
def test_rows_of_many_questions_score_as_each_question_alone(tiny_models, arch, sharing, monkeypatch):
    """One call over several questions (text and image rows) runs their rows together, by length;
    each candidate scores as when its question is scored alone, on every way of sharing."""
    monkeypatch.setattr(prm_module, "TREE_TOKEN_SHARE", 1.0)  # trees even where they share little
    if sharing == "prompt_cache":
        monkeypatch.setattr(prm_module, "_packs_trees", lambda backbone: False)
    questions_per_forward = []
    run_on_prompts = PRMScorer._run_on_prompts

    def recording(self, members):
        questions_per_forward.append(len({id(p) for p, _ in members}))
        return run_on_prompts(self, members)

    monkeypatch.setattr(PRMScorer, "_run_on_prompts", recording)
    scorer = PRMScorer(*_prm(tiny_models, arch), batch_size=8, max_batch_tokens=None)
    examples = _examples()
    share = sharing != "plain"
    batched = scorer.score(examples, share_prefix=share)
    if sharing == "prompt_cache":  # the candidates of several questions on their own caches, together
        assert max(questions_per_forward) > 1, questions_per_forward
    alone = _per_question(scorer, examples, share)
    worst = _worst(batched, alone)
    assert worst <= 1e-5, f"{arch} {sharing}: batched scores differ from per-question ones by {worst}"
    unshared = [scorer.score([ex], share_prefix=False)[0] for ex in examples]
    assert _worst(batched, unshared) <= 1e-5


@pytest.mark.parametrize("sharing", ["trees", "prompt_cache", "plain"])
def test_no_forward_passes_the_token_budget(tiny_models, sharing, monkeypatch):
    """`max_batch_tokens` bounds every forward's padded tokens (prompt cache included), a row longer
    than the budget running alone; the scores do not depend on it."""
    monkeypatch.setattr(prm_module, "TREE_TOKEN_SHARE", 1.0)
    if sharing == "prompt_cache":
        monkeypatch.setattr(prm_module, "_packs_trees", lambda backbone: False)
    model, processor = _prm(tiny_models, "qwen2_vl")
    examples = _examples()
    share = sharing != "plain"
    free = PRMScorer(model, processor, batch_size=16, max_batch_tokens=None).score(examples, share_prefix=share)
    budget = 160
    scorer = PRMScorer(model, processor, batch_size=16, max_batch_tokens=budget)
    sizes: list[tuple[int, int]] = []

    def record(module, args, kwargs):
        ids, cache = kwargs["input_ids"], kwargs.get("past_key_values")
        cached = cache.get_seq_length() if cache is not None else 0
        sizes.append((ids.shape[0], ids.shape[0] * (ids.shape[1] + cached)))

    handle = prm_module._decoder(model.backbone).register_forward_pre_hook(record, with_kwargs=True)
    try:
        scores = scorer.score(examples, share_prefix=share)
    finally:
        handle.remove()
    assert all(tokens <= budget or rows == 1 for rows, tokens in sizes), sizes
    assert any(rows > 1 for rows, _ in sizes), sizes  # the budget still lets rows share a forward
    assert _worst(scores, free) <= 1e-5


def test_prompt_cache_is_shared_without_a_copy(tiny_models, monkeypatch):
    """A question's candidates read one prompt cache: no deep copy of it per batch, and the cache
    is not changed by the batches that read it."""
    monkeypatch.setattr(prm_module, "_packs_trees", lambda backbone: False)
    model, processor = _prm(tiny_models, "qwen2_vl")
    scorer = PRMScorer(model, processor, batch_size=2)  # a question's 3 candidates: 2 batches
    examples = [ex for ex in _examples() if ex["question"].startswith("How many blue tiles")]
    assert len(examples) == 3
    expected = [scorer.score([ex], share_prefix=False)[0] for ex in examples]

    def no_copy(*args, **kwargs):
        raise AssertionError("the prompt cache was deep-copied")

    monkeypatch.setattr(DynamicCache, "__deepcopy__", no_copy, raising=False)
    toks = scorer.tokenize_group(examples, [0, 1, 2])
    prompt = scorer._encode_prompt(toks, 0)
    assert isinstance(prompt.cache, DynamicCache)
    before = [layer.keys.clone() for layer in prompt.cache.layers]
    got = [scorer._run_on_prompts([(prompt, 0), (prompt, 1)]), scorer._run_on_prompts([(prompt, 2)])]
    assert all(torch.equal(b, layer.keys) for b, layer in zip(before, prompt.cache.layers))
    assert _worst(got[0] + got[1], expected) <= 1e-5
    assert _worst(scorer.score(examples), expected) <= 1e-5


def test_inputs_are_prepared_on_a_background_thread(tiny_models, monkeypatch):
    """Tokenization and image preprocessing run off the model's thread (`prefetch`), and an error
    there is raised to the caller, naming the example, with the thread gone."""
    import mmprm.models.spec as spec_module

    model, processor = _prm(tiny_models, "qwen2_vl")
    threads = set()
    tokenize = spec_module.tokenize_steps

    def tracked(*args, **kwargs):
        threads.add(threading.current_thread().name)
        return tokenize(*args, **kwargs)

    monkeypatch.setattr(spec_module, "tokenize_steps", tracked)
    examples = _examples()
    on = PRMScorer(model, processor, batch_size=4, prefetch=True).score(examples)
    assert threads == {"mmprm-score-prefetch"}
    threads.clear()
    off = PRMScorer(model, processor, batch_size=4, prefetch=False).score(examples)
    assert threads == {threading.current_thread().name}
    assert on == off
    bad = [*examples, {**examples[0], "id": "bad", "steps": ["a", f"b {processor.tokenizer.eos_token}"]}]
    with pytest.raises(ValueError, match=r"examples\[12\] \(id=bad\)"):
        PRMScorer(model, processor, batch_size=4, prefetch=True).score(bad)
    assert not [t for t in threading.enumerate() if t.name == "mmprm-score-prefetch"]


def test_scorer_refuses_a_batch_it_cannot_run(tiny_models):
    model, processor = _prm(tiny_models, "qwen2_vl")
    with pytest.raises(ValueError, match="max_batch_tokens=0"):
        PRMScorer(model, processor, max_batch_tokens=0)


@pytest.mark.slow  # scores many groups to watch memory: about 25 s each
def test_prefetch_holds_a_few_groups_ahead_not_all(tiny_models, tmp_path, monkeypatch):
    """The background thread runs at most `2 x batch_size` groups ahead of the model: inputs (pixel
    values included) held at once stay a few groups', however many the call scores."""
    import gc
    import weakref

    import mmprm.models.spec as spec_module

    model, processor = _prm(tiny_models, "qwen2_vl")
    scorer = PRMScorer(model, processor, batch_size=2, prefetch=True)
    examples = []
    for i in range(16):
        path = tmp_path / f"p{i}.png"
        Image.new("RGB", (56, 42), (10 * i, 30, 30)).save(path)
        examples += [{"question": f"Q{i}", "images": [str(path)], "steps": [f"Tile {j}.", "So."]} for j in range(3)]
    alive: list[weakref.ref] = []
    peak = [0]

    def tracked(fn):
        def wrapper(*args, **kwargs):
            gc.collect()
            peak[0] = max(peak[0], sum(r() is not None for r in alive))
            out = fn(*args, **kwargs)
            if out is not None:
                alive.append(weakref.ref(out))
            return out

        return wrapper

    monkeypatch.setattr(spec_module, "tokenize_steps", tracked(spec_module.tokenize_steps))
    monkeypatch.setattr(spec_module, "extend_steps", tracked(spec_module.extend_steps))
    scores = scorer.score(examples)
    assert len(alive) == 48 and all(len(s) == 2 for s in scores)
    # 4 groups queued, one being tokenized, one being scored: 3 inputs each
    assert peak[0] <= 18, peak[0]
