"""`mmprm.steps.tokenize_steps` on every tiny arch, checked token by token.

The classic PRM bug is a label one token off; these tests read the ids back and check that each
step token sits right after its own step's text, on real processors with real (small) images.
"""

from __future__ import annotations

import pytest
import torch

from mmprm.models import TINY_ARCHS, add_step_token, load_backbone, load_processor
from mmprm.steps import STEP_TOKEN, StepTokenError, tokenize_steps

VLM_ARCHS = [a for a in TINY_ARCHS if a != "qwen2"]
IMAGE_TOKEN = {
    "qwen2_vl": "<|image_pad|>",
    "qwen2_5_vl": "<|image_pad|>",
    "internvl": "<IMG_CONTEXT>",
    "llava": "<image>",
}
STEPS = [
    "Read the picture: there are 7 dots.",
    "Add the 5 hidden dots: 7 + 5 = 12.",
    "Check: 12 - 5 = 7, so it holds.",
    "The answer is 12.\n<answer>12</answer>",
]
LABELS = [1.0, 0.7, 0.0, 0.25]


@pytest.fixture(scope="module")
def loaded(tiny_models):
    """arch -> (model, processor, step_id): loaded once per module, step token added."""
    cache: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in cache:
            model, processor = load_backbone(tiny_models(arch))
            model.eval()
            cache[arch] = (model, processor, add_step_token(processor, model))
        return cache[arch]

    return get


def _tok(processor):
    return getattr(processor, "tokenizer", processor)


def _example(arch: str, mathv_images) -> tuple[str, list]:
    """A MATH-V question with its real image at the placeholder; text-only for qwen2."""
    if arch == "qwen2":
        return "Kim has 7 dots and finds 5 more. How many dots?", []
    return "How many different digits can you find in this picture? <image1>", mathv_images(["4"])


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_step_positions_token_by_token(loaded, mathv_images, arch):
    model, processor, step_id = loaded(arch)
    tok = _tok(processor)
    question, images = _example(arch, mathv_images)
    ts = tokenize_steps(processor, question, STEPS, images=images, labels=LABELS)
    assert ts is not None and ts.dropped_steps == 0
    ids, pos = ts.input_ids, ts.step_positions
    assert len(pos) == len(ts.labels) == len(STEPS)
    assert all(ids[p] == step_id for p in pos)
    assert sum(t == step_id for t in ids) == len(STEPS)  # no stray step tokens elsewhere
    assert pos == sorted(pos) and pos[-1] == len(ids) - 1
    # The ids right before each step token decode to exactly that step (after its separator).
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    turn = max(i for i, t in enumerate(ids[: pos[0]]) if t == im_start)
    assert tok.decode(ids[turn : pos[0]]) == "<|im_start|>assistant\n" + STEPS[0]
    for k in range(1, len(STEPS)):
        assert tok.decode(ids[pos[k - 1] + 1 : pos[k]]) == "\n" + STEPS[k]
    # Labels are the given floats, never cast or rounded.
    assert ts.labels == LABELS and all(type(x) is float for x in ts.labels)
    # The example runs through the model as is, and the head positions exist.
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), **ts.model_inputs).logits
    assert logits.shape[1] == len(ids) and torch.isfinite(logits[0, pos]).all()


def test_integer_labels_become_floats(loaded):
    _, processor, _ = loaded("qwen2")
    ts = tokenize_steps(processor, "1+1?", ["1 + 1 = 2.", "So 2."], labels=[1, 0])
    assert ts.labels == [1.0, 0.0] and all(type(x) is float for x in ts.labels)
    assert tokenize_steps(processor, "1+1?", ["1 + 1 = 2."]).labels is None


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_truncation_drops_whole_trailing_steps(loaded, mathv_images, arch):
    model, processor, step_id = loaded(arch)
    question, images = _example(arch, mathv_images)
    full = tokenize_steps(processor, question, STEPS, images=images, labels=LABELS)
    pos = full.step_positions
    for keep in range(1, len(STEPS) + 1):
        # Longest budget that still ends before the next step token, and the shortest that fits.
        longest = pos[keep] if keep < len(STEPS) else len(full.input_ids) + 10
        for max_length in (pos[keep - 1] + 1, longest):
            ts = tokenize_steps(processor, question, STEPS, images=images, labels=LABELS, max_length=max_length)
            assert len(ts.step_positions) == keep, (arch, max_length)
            assert ts.dropped_steps == len(STEPS) - keep
            assert ts.labels == LABELS[:keep]
            assert ts.step_positions == pos[:keep]
            assert ts.input_ids == full.input_ids[: pos[keep - 1] + 1]  # ends on the last kept step token
            assert ts.input_ids[-1] == step_id
            for key in ("mm_token_type_ids", "token_type_ids"):
                if key in ts.model_inputs:
                    assert ts.model_inputs[key].shape[-1] == len(ts.input_ids)
    # A budget that ends before the first step token: not even one step fits.
    assert tokenize_steps(processor, question, STEPS, images=images, labels=LABELS, max_length=pos[0]) is None
    # A kept-1-step example is still a valid model input (images and all).
    ts = tokenize_steps(processor, question, STEPS, images=images, labels=LABELS, max_length=pos[0] + 1)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ts.input_ids]), **ts.model_inputs).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", ["qwen2", "qwen2_vl", "llava"])
def test_literal_step_token_is_rejected(loaded, arch):
    _, processor, _ = loaded(arch)
    with pytest.raises(StepTokenError, match="question"):
        tokenize_steps(processor, f"What is 1+1?{STEP_TOKEN}", ["2."])
    with pytest.raises(StepTokenError, match=r"steps\[1\]"):
        tokenize_steps(processor, "What is 1+1?", ["1 + 1 = 2.", f"So 2.{STEP_TOKEN}"])


def test_missing_step_token_says_what_to_do(tiny_models):
    processor = load_processor(tiny_models("qwen2_vl"))  # fresh: add_step_token not called
    with pytest.raises(StepTokenError, match="add_step_token"):
        tokenize_steps(processor, "1+1?", ["2."])


def test_label_count_must_match_steps(loaded):
    _, processor, _ = loaded("qwen2")
    with pytest.raises(ValueError, match="2 steps but 1 labels"):
        tokenize_steps(processor, "1+1?", ["a.", "b."], labels=[1.0])


@pytest.mark.parametrize("arch", VLM_ARCHS)
def test_images_before_question_without_placeholders(loaded, mathv_images, arch):
    _, processor, _ = loaded(arch)
    tok = _tok(processor)
    question = "How many bricks are missing in the wall?"
    ts = tokenize_steps(processor, question, ["Two rows lack 3 bricks.", "So 6."], images=mathv_images(["7"]))
    text = tok.decode(ts.input_ids)
    assert text.index("<|im_start|>user\n") < text.index(IMAGE_TOKEN[arch])
    assert text.rindex(IMAGE_TOKEN[arch]) < text.index(question)
    # Same at the id level: the question follows the last image token.
    image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN[arch])
    last_image = max(i for i, t in enumerate(ts.input_ids) if t == image_id)
    assert question in tok.decode(ts.input_ids[last_image + 1 :])


@pytest.mark.parametrize("arch", VLM_ARCHS)
def test_images_at_numbered_placeholders(loaded, mathv_images, arch):
    model, processor, _ = loaded(arch)
    tok = _tok(processor)
    image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN[arch])
    images = mathv_images(["4", "7"])
    question = "Compare <image1> with <image2>: which has more digits?"
    ts = tokenize_steps(processor, question, ["The first has 6.", "So the first."], images=images, labels=[1.0, 1.0])
    ids = ts.input_ids
    # Two separate runs of image tokens, each in place of its placeholder.
    runs, prev = [], None
    for i, t in enumerate(ids):
        if t == image_id and prev != image_id:
            runs.append([i, i])
        if t == image_id:
            runs[-1][1] = i
        prev = t
    assert len(runs) == 2
    between = tok.decode(ids[runs[0][1] + 1 : runs[1][0]])
    assert " with " in between and "Compare" not in between
    # Image markup (Qwen: vision_start/end, InternVL: <img>..</img>) hugs the placeholder's place.
    assert tok.decode(ids[: runs[0][0]]).endswith(("Compare ", "Compare <|vision_start|>", "Compare <img>"))
    assert tok.decode(ids[runs[1][1] + 1 :]).startswith(
        tuple(m + ": which has more digits?" for m in ("", "<|vision_end|>", "</img>"))
    )
    assert "<image1>" not in tok.decode(ids) and "<image2>" not in tok.decode(ids)
    # The expanded image tokens match what the vision tower produces: the forward runs.
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), **ts.model_inputs).logits
    assert torch.isfinite(logits[0, ts.step_positions]).all()


def test_placeholder_count_must_match_images(loaded, mathv_images):
    _, processor, _ = loaded("qwen2_vl")
    with pytest.raises(ValueError, match="2 image placeholders but 1 images"):
        tokenize_steps(processor, "Compare <image1> with <image2>.", ["Same."], images=mathv_images(["4"]))


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "internvl", "llava", "qwen2"])
def test_extend_steps_equals_full_tokenization(tiny_models, arch):
    """Best-of-N candidates reuse the first candidate's prompt tokens: identical ids and inputs."""
    import torch
    from PIL import Image

    from mmprm.models.loading import add_step_token, load_backbone
    from mmprm.steps import extend_steps, tokenize_steps

    model, processor = load_backbone(tiny_models(arch))
    add_step_token(processor, model)
    images = [] if arch == "qwen2" else [Image.new("RGB", (56, 42), (10, 200, 30))]
    base = tokenize_steps(processor, "Add the tiles.", ["Tile 1 is 3."], images)
    assert base.prompt_length is not None
    for steps, max_length in [(["3 + 4 = 7.", "So 7."], None), (["x"] * 5, None), (["a b c", "d e f", "g"], 0)]:
        if max_length == 0:
            max_length = base.prompt_length + 6
        full = tokenize_steps(processor, "Add the tiles.", steps, images, max_length=max_length)
        ext = extend_steps(processor, base, steps, max_length=max_length)
        assert ext.input_ids == full.input_ids and ext.step_positions == full.step_positions
        assert ext.dropped_steps == full.dropped_steps
        assert ext.model_inputs.keys() == full.model_inputs.keys()
        for k in full.model_inputs:
            assert torch.equal(ext.model_inputs[k], full.model_inputs[k]), k


def test_docstring_example_is_what_tokenize_steps_returns(tiny_models):
    """The ids in `tokenize_steps`'s docstring are real: keep them so."""
    from mmprm.models.loading import add_step_token, load_backbone
    from mmprm.steps import tokenize_steps

    model, processor = load_backbone(tiny_models("qwen2"))
    assert add_step_token(processor, model) == 1024
    tok = tokenize_steps(processor, "1+1?", ["1+1=2.", "So 2."], labels=[1.0, 0.7])
    assert tok.input_ids == [
        1,
        363,
        265,
        201,
        19,
        13,
        19,
        33,
        2,
        201,
        1,
        415,
        626,
        201,
        19,
        13,
        19,
        31,
        20,
        16,
        1024,
        201,
        53,
        81,
        223,
        20,
        16,
        1024,
    ]
    assert tok.step_positions == [20, 27] and tok.labels == [1.0, 0.7]
