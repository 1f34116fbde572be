"""THE step format and step tokenization of mmprm.

Two renderings live here and nowhere else:

1. **Policy format** - what a policy writes and what annotation parses (`render_solution`,
   `parse_solution`)::

       <step>Read the bar: A is 7.</step>
       <step>7 + 5 = 12.</step>
       <answer>12</answer>

2. **PRM input** - what training, scoring and export feed a PRM (`tokenize_steps`): the
   chat-templated prompt with its images, then the assistant turn with the dedicated special
   `STEP_TOKEN` after every step. The PRM head is read at those tokens and nowhere else.

Chat messages are built here only (`chat_messages`), in the form the model's own template reads:
string content for text-only models, typed parts for vision-language processors.

`prm_steps` joins the two: the steps of a parsed solution with its final answer attached to the
last step, so a PRM sees the answer it is asked to judge.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

STEP_TOKEN = "<|prm_step|>"
STEP_OPEN, STEP_CLOSE = "<step>", "</step>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"

# `<image>` (LLaVA style) or MATH-V's numbered `<image1>`, `<image2>`, ...
IMAGE_PLACEHOLDER = re.compile(r"<image(\d*)>")

_STEP_RE = re.compile(re.escape(STEP_OPEN) + r"(.*?)" + re.escape(STEP_CLOSE), re.S)
_ANSWER_RE = re.compile(re.escape(ANSWER_OPEN) + r"(.*?)" + re.escape(ANSWER_CLOSE), re.S)
_BLANK_LINES = re.compile(r"\n\s*\n")


@dataclass
class ParsedSolution:
    """Steps and final answer read from a policy's text.

    `complete` is True when an answer was found; `steps` may be empty when nothing parsed.
    """

    steps: list[str]
    answer: str | None
    complete: bool


def render_solution(steps: Sequence[str], answer: str | None = None) -> str:
    """Policy format of a solution: one `<step>` per step, then `<answer>` when given.

    >>> render_solution(["2 + 3 = 5."], "5")
    '<step>2 + 3 = 5.</step>\\n<answer>5</answer>'
    """
    lines = [f"{STEP_OPEN}{s.strip()}{STEP_CLOSE}" for s in steps]
    if answer is not None:
        lines.append(f"{ANSWER_OPEN}{answer.strip()}{ANSWER_CLOSE}")
    return "\n".join(lines)


def render_prefix(steps: Sequence[str]) -> str:
    """Policy-format text of a partial solution, ready for the policy to continue."""
    return "".join(f"{STEP_OPEN}{s.strip()}{STEP_CLOSE}\n" for s in steps)


def parse_solution(text: str, mode: Literal["tags", "blank_lines"] = "tags") -> ParsedSolution:
    """Read steps and the final answer from a policy's text.

    mode="tags" reads `<step>` blocks (an SFT'd policy); mode="blank_lines" splits on blank
    lines (any policy) and takes the answer from the last step with `mmprm.answers`.
    A trailing unclosed `<step>` (generation cut off) is not a step.
    """
    if mode == "tags":
        steps = [m.group(1).strip() for m in _STEP_RE.finditer(text)]
        steps = [s for s in steps if s]
        m = _ANSWER_RE.search(text)
        answer = m.group(1).strip() if m else None
        return ParsedSolution(steps, answer or None, bool(answer))
    if mode == "blank_lines":
        from mmprm.answers import extract_answer

        steps = [s.strip() for s in _BLANK_LINES.split(text) if s.strip()]
        answer = extract_answer(text)
        return ParsedSolution(steps, answer, answer is not None)
    raise ValueError(f"unknown step segmentation mode {mode!r}: use 'tags' or 'blank_lines'")


def prm_steps(steps: Sequence[str], answer: str | None = None) -> list[str]:
    """Steps as a PRM sees them: the final answer (if any) is appended to the last step."""
    out = [s.strip() for s in steps]
    if answer is not None and out:
        out[-1] = f"{out[-1]}\n{ANSWER_OPEN}{answer.strip()}{ANSWER_CLOSE}"
    elif answer is not None:
        out = [f"{ANSWER_OPEN}{answer.strip()}{ANSWER_CLOSE}"]
    return out


def count_image_placeholders(question: str) -> int:
    return len(IMAGE_PLACEHOLDER.findall(question))


def user_content(question: str, num_images: int) -> list[dict[str, Any]]:
    """Chat content parts of the user turn: images before the question, or at its placeholders.

    With placeholders (`<image>`, `<image1>`, ...) each one becomes an image part in place; their
    count must equal `num_images` (the loader checks this with a clear error first).
    """
    if IMAGE_PLACEHOLDER.search(question) is None:
        return [{"type": "image"} for _ in range(num_images)] + [{"type": "text", "text": question}]
    parts: list[dict[str, Any]] = []
    pos = 0
    for m in IMAGE_PLACEHOLDER.finditer(question):
        if m.start() > pos:
            parts.append({"type": "text", "text": question[pos : m.start()]})
        parts.append({"type": "image"})
        pos = m.end()
    if pos < len(question):
        parts.append({"type": "text", "text": question[pos:]})
    if sum(p["type"] == "image" for p in parts) != num_images:
        raise ValueError(
            f"question has {count_image_placeholders(question)} image placeholders but {num_images} images"
        )
    return parts


def is_text_only(processor: Any) -> bool:
    """True when `processor` is a plain tokenizer (a text-only model), False for a VLM processor.

    This decides the chat message format: text-only templates (SmolLM2, Llama 3, Mistral,
    Qwen2.5, ...) concatenate `message['content']` as a string, while VLM templates iterate typed
    parts (LLaVA's even ignore a string). `mmprm.models.load_processor` returns the tokenizer
    itself for text-only checkpoints and a processor with an image processor otherwise.
    """
    return getattr(processor, "image_processor", None) is None


def build_messages(
    question: str, num_images: int, system: str | None = None, assistant: str | None = None, *, text_only: bool = False
) -> list[dict[str, Any]]:
    """Chat messages for one problem; `assistant` adds a (partial) assistant turn.

    text_only: every content is a plain string (what text-only chat templates concatenate);
    otherwise typed parts (`{"type": "text", ...}`, `{"type": "image"}`) as VLM processors expect.
    Use `chat_messages` to decide this from the processor.
    """

    def content(text: str) -> Any:
        return text if text_only else [{"type": "text", "text": text}]

    messages: list[dict[str, Any]] = []
    if system:
        messages.append({"role": "system", "content": content(system)})
    if text_only:
        if num_images or IMAGE_PLACEHOLDER.search(question):
            raise ValueError(
                f"question has {count_image_placeholders(question)} image placeholders and {num_images} "
                "images, but the model is text-only: use a vision-language model or text-only problems"
            )
        messages.append({"role": "user", "content": question})
    else:
        messages.append({"role": "user", "content": user_content(question, num_images)})
    if assistant is not None:
        messages.append({"role": "assistant", "content": content(assistant)})
    return messages


def chat_messages(
    processor: Any, question: str, num_images: int, system: str | None = None, assistant: str | None = None
) -> list[dict[str, Any]]:
    """`build_messages` in the content format `processor`'s chat template expects (`is_text_only`)."""
    return build_messages(question, num_images, system, assistant, text_only=is_text_only(processor))


def prompt_text(processor: Any, question: str, num_images: int, system: str | None = None) -> str:
    """Chat-templated prompt text up to the start of the assistant turn (the generation prompt)."""
    return processor.apply_chat_template(
        chat_messages(processor, question, num_images, system), add_generation_prompt=True, tokenize=False
    )


# Assistant text that marks where a template puts the assistant's own words (see assistant_start).
_PROBE = "mmprm-assistant-probe"


def assistant_start(processor: Any, question: str, num_images: int, system: str | None = None) -> tuple[str, str]:
    """(generation prompt, lead): the prompt text and what the template writes before the answer.

    The lead is "" for most templates and " " for LLaVA-1.5 ("ASSISTANT:" then " answer") and
    Mistral ("[/INST]" then " answer"). It is read from the template itself: render an assistant
    turn holding a probe and take what lies between the generation prompt and the probe. When the
    assistant turn does not extend the generation prompt (Mistral moves the system prompt once an
    assistant turn follows), the same conversation without the system prompt is asked; when that
    fails too (LLaVA-OneVision renders "assistant \n" but prompts with "assistant\n"), the lead
    is "": the generation prompt is what the model answers after.
    """
    from jinja2 import TemplateError

    gen = processor.apply_chat_template(
        chat_messages(processor, question, num_images, system), add_generation_prompt=True, tokenize=False
    )
    for sys in dict.fromkeys([system, None]):
        try:
            ask = (
                gen
                if sys == system
                else processor.apply_chat_template(
                    chat_messages(processor, question, num_images, sys), add_generation_prompt=True, tokenize=False
                )
            )
            turn = processor.apply_chat_template(
                chat_messages(processor, question, num_images, sys, assistant=_PROBE), tokenize=False
            )
        except TemplateError:  # the template rejects this conversation (its raise_exception): ask the next
            continue
        head, found, _ = turn.partition(_PROBE)
        if found and head.startswith(ask):
            return gen, head[len(ask) :]
    return gen, ""


def needs_special_tokens(tokenizer: Any, text: str) -> bool:
    """Whether to let the tokenizer add its special tokens (BOS) to chat-templated `text`.

    Templates that write the BOS themselves (Llama 3, Mistral) would get a second one from
    tokenizers that add it (`add_bos_token`); templates that do not (LLaVA-1.5) rely on it.
    Same rule as transformers' own `apply_chat_template`.
    """
    bos = getattr(tokenizer, "bos_token", None)
    return not (bos and text.startswith(bos))


def continue_assistant(processor: Any, question: str, num_images: int, text: str, system: str | None = None) -> str:
    """Prompt whose assistant turn already holds `text`, for the model to continue.

    The generation prompt, then the template's lead and `text` as the template writes an assistant
    turn ("ASSISTANT: " + text for LLaVA-1.5), so the tokens are those the model would have produced
    after the generation prompt. Empty `text` gives the generation prompt alone: the model writes the
    lead itself.
    """
    prompt, lead = assistant_start(processor, question, num_images, system)
    return prompt + lead + text if text else prompt


def continuation_prompt(
    processor: Any, question: str, num_images: int, prefix_steps: Sequence[str], system: str | None = None
) -> str:
    """Prompt text that continues a partial solution in policy format (for rollouts and generation).

    The steps so far are the start of the assistant turn itself (`continue_assistant`), not
    restated in the user turn, so the policy sees exactly what it would have written.
    """
    return continue_assistant(processor, question, num_images, render_prefix(prefix_steps), system)


@dataclass
class TokenizedSteps:
    """One example as the PRM sees it.

    input_ids: token ids of prompt + steps, each step followed by the step token.
    step_positions: index in `input_ids` of every step token, one per kept step.
    labels: the kept labels (same length as step_positions), or None when unlabelled.
    dropped_steps: trailing steps removed to fit `max_length` (their labels went with them).
    model_inputs: extra processor outputs (pixel_values, image_grid_thw, ...), batch dim 1.
    prompt_length: tokens before the assistant's words, when `lead` + steps tokenize the same
        alone (then `extend_steps` reuses them); None otherwise.
    lead: what the chat template writes between the prompt and the first step (`assistant_start`).
    """

    input_ids: list[int]
    step_positions: list[int]
    labels: list[float] | None
    dropped_steps: int = 0
    model_inputs: dict[str, Any] = field(default_factory=dict)
    prompt_length: int | None = None
    lead: str = ""


class StepTokenError(ValueError):
    """Text that would confuse step positions (a literal step token) or cannot fit at all."""


@dataclass(frozen=True)
class StepFormat:
    """How a PRM's input lays out the question and the steps, and where each step is read.

    mmprm's own PRMs use the default. Released PRMs each have their authors' layout
    (`mmprm.models.spec.RELEASED_CONVENTIONS`):

    layout:
        "assistant" - the question in the user turn of the chat template, the steps in the
            assistant turn, each followed by `step_token` (mmprm; Qwen2.5-Math-PRM's `<extra_0>`).
        "plain" - no chat template: question, `question_join`, then the steps (Math-Shepherd:
            "question step 1 ки\nstep 2 ки").
        "turns" - each step is a user turn the assistant answers with `reply` (RLHFlow's "+"); the
            first turn holds the question, `question_join` and the first step. The step is read at
            the last token before the reply: where the model predicts it.
    step_token: the tag after each step ("assistant" and "plain" layouts).
    step_join: text between a step's tag and the next step.
    tag_prefix: text between a step and its tag (" " in Math-Shepherd's "step ки").
    question_format: the text that carries the question (`format_question`): "{question}" for
        most; VisualPRM's "### Question:\n{images}{question}". In the "plain" layout it is the
        whole prompt (MM-PRM writes its chat markup itself), images at `<image>` placeholders.
    image_text: what one image is in `{images}` ("<image>"; MM-PRM's "<image>\n").
    """

    layout: Literal["assistant", "plain", "turns"] = "assistant"
    step_token: str = STEP_TOKEN
    step_join: str = "\n"
    tag_prefix: str = ""
    question_join: str = " "
    reply: str = "+"
    question_format: str = "{question}"
    image_text: str = "<image>"


LAYOUTS = ("assistant", "plain", "turns")


def format_question(fmt: StepFormat, question: str, num_images: int) -> str:
    """`question` inside `fmt.question_format`, where `{images}` becomes one `fmt.image_text` per
    image, or nothing when the question places its images itself (`<image>` placeholders)."""
    if fmt.question_format == "{question}":
        return question
    images = "" if IMAGE_PLACEHOLDER.search(question) else fmt.image_text * num_images
    head, _, tail = fmt.question_format.partition("{question}")
    return head.replace("{images}", images) + question + tail.replace("{images}", images)


def place_images(processor: Any, text: str, num_images: int) -> str:
    """`text` with each `<image>` placeholder written as the processor's image token, for a prompt
    that no chat template lays out (the "plain" layout)."""
    image_token = getattr(processor, "image_token", None)
    found = count_image_placeholders(text)
    if image_token is None or found != num_images:
        raise StepTokenError(
            f"the 'plain' layout places images at <image> placeholders: found {found} for {num_images} "
            "images" + ("" if image_token else " and the processor has no image token (a text-only model?)")
        )
    return IMAGE_PLACEHOLDER.sub(lambda _: image_token, text)


def assistant_body(steps: Sequence[str], step_token: str = STEP_TOKEN, fmt: StepFormat | None = None) -> str:
    """Text of the steps in a PRM input: each step followed by its tag, one step per line (or as
    `fmt` joins them)."""
    fmt = fmt or StepFormat(step_token=step_token)
    return fmt.step_join.join(f"{s.strip()}{fmt.tag_prefix}{fmt.step_token}" for s in steps)


def tokenize_steps(
    processor: Any,
    question: str,
    steps: Sequence[str],
    images: Sequence[Any] = (),
    labels: Sequence[float] | None = None,
    max_length: int | None = None,
    step_token: str = STEP_TOKEN,
    system: str | None = None,
    fmt: StepFormat | None = None,
) -> TokenizedSteps | None:
    """Tokenize one example for a PRM and return the position of every step token.

    The prompt is the processor's chat template (`chat_messages`: string content for a text-only
    model, typed parts with images before the question or at its placeholders for a VLM); the
    assistant turn is the template's lead (`assistant_start`) then `assistant_body(steps)`. BOS
    is added only when the template did not write it. Positions are read back from
    the ids, so they are right whatever the image expansion did. Truncation to `max_length`
    drops whole trailing steps together with their labels; if not even the first step fits,
    returns None (the caller counts it). A literal step token in the question or a step raises
    StepTokenError. `fmt` lays out a released PRM's input the way its authors score it
    (`StepFormat`); without it, mmprm's own format with `step_token`.

    Example (the tiny Qwen2 of `mmprm tiny-model --arch qwen2`, step token added as id 1024)::

        question="1+1?", steps=["1+1=2.", "So 2."], labels=[1.0, 0.7]
        text      = "<|im_start|>user\\n1+1?<|im_end|>\\n<|im_start|>assistant\\n"
                    "1+1=2.<|prm_step|>\\nSo 2.<|prm_step|>"
        input_ids = [1, 363, 265, 201, 19, 13, 19, 33, 2, 201, 1, 415, 626, 201,   # prompt
                     19, 13, 19, 31, 20, 16, 1024, 201, 53, 81, 223, 20, 16, 1024]
        step_positions = [20, 27]  # input_ids[20] == input_ids[27] == 1024, after each step
        labels    = [1.0, 0.7]     # floats, never cast
    """
    if labels is not None and len(labels) != len(steps):
        raise ValueError(f"{len(steps)} steps but {len(labels)} labels")
    fmt = fmt or StepFormat(step_token=step_token)
    check_special_tokens(processor, question, steps, fmt.step_token)
    question = format_question(fmt, question, len(images))
    if fmt.layout == "turns":
        enc, ids, positions = _encode_turns(processor, question, steps, images, system, fmt)
        lead, prompt_length = "", None
    else:
        enc, ids, positions, lead, prompt_length = _encode_tagged(processor, question, steps, images, system, fmt)
    if len(positions) != len(steps):
        raise StepTokenError(
            f"found {len(positions)} step tokens for {len(steps)} steps: the chat template or a step "
            "text changed the step token; report this with the model name"
        )
    kept = len(positions)
    if max_length is not None:
        kept = sum(1 for p in positions if p < max_length)
        if kept == 0:
            return None
    end = positions[kept - 1] + 1 if kept else len(ids)
    return TokenizedSteps(
        input_ids=ids[:end],
        step_positions=positions[:kept],
        labels=[float(x) for x in labels[:kept]] if labels is not None else None,
        dropped_steps=len(steps) - kept,
        model_inputs=_cut_model_inputs(enc, end),
        prompt_length=prompt_length,
        lead=lead,
    )


def _encode_turns(
    processor: Any, question: str, steps: Sequence[str], images: Sequence[Any], system: str | None, fmt: StepFormat
) -> tuple[Any, list[int], list[int]]:
    """(encoding, ids, step positions) of the "turns" layout: each step a user turn, read at the
    last token before the assistant's reply."""
    messages = turn_messages(processor, question, steps, len(images), system, fmt)
    text = processor.apply_chat_template(messages, tokenize=False)
    enc = _encode(processor, text, images)
    ids = enc["input_ids"][0].tolist()
    return enc, ids, _turn_positions(processor, messages, text, ids, fmt.reply)


def _encode_tagged(
    processor: Any, question: str, steps: Sequence[str], images: Sequence[Any], system: str | None, fmt: StepFormat
) -> tuple[Any, list[int], list[int], str, int | None]:
    """(encoding, ids, step positions, lead, prompt_length) of the "assistant" and "plain"
    layouts: the prompt, then each step followed by its step token, read where that token sits.

    prompt_length counts the tokens before the lead when lead + steps tokenize the same alone
    (`extend_steps` then reuses the prompt's tokens); None otherwise.
    """
    tokenizer = getattr(processor, "tokenizer", processor)
    step_id = step_token_id(tokenizer, fmt)
    lead = ""
    if fmt.layout == "plain":
        prompt = question + fmt.question_join
        if images:
            prompt = place_images(processor, prompt, len(images))
    else:
        prompt, lead = assistant_start(processor, question, len(images), system)
    tail = lead + assistant_body(steps, fmt=fmt)
    enc = _encode(processor, prompt + tail, images)
    ids = enc["input_ids"][0].tolist()
    tail_ids = tokenizer(tail, add_special_tokens=False)["input_ids"]
    prompt_length = len(ids) - len(tail_ids) if ids[len(ids) - len(tail_ids) :] == tail_ids else None
    positions = [i for i, t in enumerate(ids) if t == step_id]
    return enc, ids, positions, lead, prompt_length


def _cut_model_inputs(enc: Any, end: int) -> dict[str, Any]:
    """The processor's extra outputs (pixels, grids, ...) without ids and mask, per-token ones cut
    to the first `end` tokens like the ids."""
    model_inputs = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
    if "mm_token_type_ids" in model_inputs:
        model_inputs["mm_token_type_ids"] = model_inputs["mm_token_type_ids"][:, :end]
    if "token_type_ids" in model_inputs:
        model_inputs["token_type_ids"] = model_inputs["token_type_ids"][:, :end]
    return model_inputs


def _encode(processor: Any, text: str, images: Sequence[Any]) -> Any:
    """`text` (with `images`) as the model reads it; BOS only where the template did not write it."""
    tokenizer = getattr(processor, "tokenizer", processor)
    special = needs_special_tokens(tokenizer, text)
    if images:
        return processor(text=[text], images=list(images), return_tensors="pt", add_special_tokens=special)
    return tokenizer([text], return_tensors="pt", add_special_tokens=special)


def step_token_id(tokenizer: Any, fmt: StepFormat) -> int:
    """The id of `fmt`'s step tag as it follows a step (`tag_prefix` + `step_token`).

    A tag that is not a single token after its prefix (mmprm's own before `add_step_token`, or a
    released PRM's with the wrong convention) is an error: its positions would be guesses.
    """
    ids = tokenizer.encode(fmt.tag_prefix + fmt.step_token, add_special_tokens=False)
    if ids and tokenizer.decode(ids[-1:]).strip() == fmt.step_token.strip():
        return ids[-1]
    if fmt.step_token == STEP_TOKEN:
        raise StepTokenError(
            f"tokenizer has no {STEP_TOKEN!r} token: call mmprm.models.add_step_token(processor, model) first"
        )
    raise StepTokenError(
        f"the step tag {fmt.step_token!r} is not one token of this tokenizer: is the PRM convention the "
        "one this checkpoint was trained with?"
    )


def turn_messages(
    processor: Any, question: str, steps: Sequence[str], num_images: int, system: str | None, fmt: StepFormat
) -> list[dict[str, Any]]:
    """The "turns" layout: each step a user turn answered by `fmt.reply`, the question (and images)
    opening the first."""
    text_only = is_text_only(processor)
    first = question + fmt.question_join + steps[0].strip() if steps else question
    messages = build_messages(first, num_images, system, fmt.reply, text_only=text_only)
    for step in steps[1:]:
        for role, text in (("user", step.strip()), ("assistant", fmt.reply)):
            messages.append({"role": role, "content": text if text_only else [{"type": "text", "text": text}]})
    return messages


def _turn_positions(processor: Any, messages: list[dict[str, Any]], text: str, ids: list[int], reply: str) -> list[int]:
    """Where each step of a "turns" input is read: the last token of the prompt that asks for its
    reply. Each turn's prompt must be a prefix of the whole conversation and the reply must start
    right after it, else the template moves text between turns and the positions would be wrong."""
    tokenizer = getattr(processor, "tokenizer", processor)
    reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
    asks = [i + 1 for i, m in enumerate(messages) if m["role"] == "user"]
    positions = []
    for k, end in enumerate(asks):
        prompt = processor.apply_chat_template(messages[:end], add_generation_prompt=True, tokenize=False)
        tail_ids = (
            tokenizer(text[len(prompt) :], add_special_tokens=False)["input_ids"] if text.startswith(prompt) else []
        )
        start = len(ids) - len(tail_ids)
        if not tail_ids or ids[start:] != tail_ids or tail_ids[: len(reply_ids)] != reply_ids:
            raise StepTokenError(
                f"step {k}: the chat template does not put the reply {reply!r} right after the prompt of its "
                "turn, so the step cannot be read there; this template does not fit the 'turns' layout"
            )
        positions.append(start - 1)
    return positions


def check_special_tokens(
    processor: Any, question: str, steps: Sequence[str], step_token: str, answer: str | None = None
) -> None:
    """Reject any special token of the model inside user text (it would be read as structure)."""
    texts = [*((f"steps[{i}]", s) for i, s in enumerate(steps)), *([("answer", answer)] if answer else [])]
    for where, text in [("question", question), *texts]:
        if step_token in text:
            raise StepTokenError(f"{where} contains the reserved step token {step_token!r}: remove it")
    tokenizer = getattr(processor, "tokenizer", processor)
    reserved = set(tokenizer.all_special_tokens) | {
        t for t in (getattr(processor, "image_token", None), getattr(processor, "video_token", None)) if t
    }
    reserved.discard(step_token)
    for where, text in [("question", IMAGE_PLACEHOLDER.sub("", question)), *texts]:
        for t in reserved:
            if t and t in text:
                raise StepTokenError(f"{where} contains the special token {t!r} of this model: remove it")


def extend_steps(
    processor: Any,
    base: TokenizedSteps,
    steps: Sequence[str],
    labels: Sequence[float] | None = None,
    max_length: int | None = None,
    step_token: str = STEP_TOKEN,
    fmt: StepFormat | None = None,
) -> TokenizedSteps | None:
    """Tokenize other steps for the same prompt and images as `base`, reusing its prompt tokens.

    Equal to `tokenize_steps` on the same question and images (a test checks every
    architecture); it only runs the tokenizer on the new assistant body, so Best-of-N candidates
    do not repeat the chat template and image preprocessing. Returns None when `base` has no
    reusable prompt (its body did not tokenize the same alone): call `tokenize_steps` then.
    """
    if base.prompt_length is None:
        return None
    if labels is not None and len(labels) != len(steps):
        raise ValueError(f"{len(steps)} steps but {len(labels)} labels")
    fmt = fmt or StepFormat(step_token=step_token)
    check_special_tokens(processor, "", steps, fmt.step_token)
    tokenizer = getattr(processor, "tokenizer", processor)
    step_id = step_token_id(tokenizer, fmt)
    body = tokenizer(base.lead + assistant_body(steps, fmt=fmt), add_special_tokens=False)["input_ids"]
    n = base.prompt_length
    ids = base.input_ids[:n] + body
    positions = [n + i for i, t in enumerate(body) if t == step_id]
    if len(positions) != len(steps):
        raise StepTokenError(f"found {len(positions)} step tokens for {len(steps)} steps")
    kept = len(positions) if max_length is None else sum(1 for p in positions if p < max_length)
    if kept == 0:
        return None
    end = positions[kept - 1] + 1
    model_inputs = dict(base.model_inputs)
    for key in ("mm_token_type_ids", "token_type_ids"):
        if key in model_inputs:  # body tokens are text (type 0)
            prompt_part = model_inputs[key][:, :n]
            model_inputs[key] = torch_cat_zeros(prompt_part, end - n)
    return TokenizedSteps(
        input_ids=ids[:end],
        step_positions=positions[:kept],
        labels=[float(x) for x in labels[:kept]] if labels is not None else None,
        dropped_steps=len(steps) - kept,
        model_inputs=model_inputs,
        prompt_length=n,
        lead=base.lead,
    )


def torch_cat_zeros(prefix: Any, extra: int) -> Any:
    """`prefix` (1, n) followed by `extra` zeros, same dtype."""
    import torch

    return torch.cat([prefix, torch.zeros((prefix.shape[0], extra), dtype=prefix.dtype)], dim=1)
