"""What a PRM directory holds besides the HF files (`PRMSpec`), and how a scorer reads examples:
their fields, their groups by shared prompt, their tokenization.

Shared by the HF scorer (`mmprm.models.prm`) and the vLLM scorer (`mmprm.models.vllm_prm`), so
that neither imports the other and both tokenize exactly alike.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, get_args

from mmprm.steps import LAYOUTS, STEP_TOKEN, StepFormat, TokenizedSteps, extend_steps, tokenize_steps

SPEC_FILE = "mmprm_prm.json"
VALUE_HEAD_FILE = "value_head.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass
class PRMSpec:
    """What a PRM directory needs besides the HF files to score exactly like training did.

    head: "token_pair" (the LM's logits of two reward tokens, positive first), "value" (mmprm's
        linear head) or "classifier" (a released PRM's class head at the step token, read from its
        checkpoint; `positive_label` is the class that means "correct").
    convention: "mmprm" for a PRM mmprm wrote; otherwise the released PRM family it follows
        (`RELEASED_CONVENTIONS`), whose input is laid out as its authors score it.
    layout, step_join, tag_prefix, question_join, reply, question_format, image_text: the input
        layout (`mmprm.steps.StepFormat`).
    """

    head: str = "token_pair"
    step_token: str = STEP_TOKEN
    reward_tokens: list[str] = field(default_factory=lambda: ["+", "-"])
    system_prompt: str | None = None
    convention: str = "mmprm"
    layout: str = "assistant"
    step_join: str = "\n"
    tag_prefix: str = ""
    question_join: str = " "
    reply: str = "+"
    question_format: str = "{question}"
    image_text: str = "<image>"
    positive_label: int = 0

    def validate(self) -> None:
        if self.head not in HEADS:
            raise ValueError(f"head: {self.head!r} is not one of {list(HEADS)}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout: {self.layout!r} is not one of {list(LAYOUTS)}")
        if len(self.reward_tokens) != 2 or self.reward_tokens[0] == self.reward_tokens[1]:
            raise ValueError("reward_tokens: give two different tokens, positive first (e.g. ['+', '-'])")
        if self.positive_label not in (0, 1):
            raise ValueError(f"positive_label: {self.positive_label!r} is not 0 or 1 (a two-class head)")

    @property
    def step_format(self) -> StepFormat:
        return StepFormat(
            layout=self.layout,  # type: ignore[arg-type]
            step_token=self.step_token,
            step_join=self.step_join,
            tag_prefix=self.tag_prefix,
            question_join=self.question_join,
            reply=self.reply,
            question_format=self.question_format,
            image_text=self.image_text,
        )


HEADS = ("token_pair", "value", "classifier")
# The attention kernels a model loads with (`mmprm.models.loading.resolve_attn_implementation`).
AttnImplementation = Literal["sdpa", "flash_attention_2", "flex_attention", "eager", "auto"]
ReleasedConvention = Literal["math_shepherd", "qwen2_5_math_prm", "rlhflow", "mm_prm", "visualprm"]

# The system message of InternVL's "internvl2_5" conversation template, which InternVL chat models
# (and the PRMs fine-tuned from them) write before every conversation.
INTERNVL_SYSTEM = (
    "你是书生·万象，英文名是InternVL，是由上海人工智能实验室、清华大学及多家合作单位联合开发的多模态大语言模型。"
)

# Released PRMs, each scored as its authors' published code scores it (tests/test_released_prms.py
# writes each procedure out on a tiny checkpoint of the same shape; docs/released-prms.md lists
# the checkpoints each covers).
RELEASED_CONVENTIONS: dict[str, PRMSpec] = {
    # Math-Shepherd: "question step 1 ки\nstep 2 ки", no chat template; "+"/"-" logits at each tag.
    "math_shepherd": PRMSpec(convention="math_shepherd", layout="plain", step_token="ки", tag_prefix=" "),
    # Qwen2.5-Math-PRM: the chat template with its system prompt, steps joined by <extra_0>; a
    # two-class head at each <extra_0>, class 1 = correct.
    "qwen2_5_math_prm": PRMSpec(
        convention="qwen2_5_math_prm",
        head="classifier",
        step_token="<extra_0>",
        step_join="",
        positive_label=1,
        system_prompt="Please reason step by step, and put your final answer within \\boxed{}.",
    ),
    # RLHFlow: each step a user turn (question + " " + step first) answered "+"; "+"/"-" logits
    # where the assistant writes its reply.
    "rlhflow": PRMSpec(convention="rlhflow", layout="turns"),
    # MM-PRM (InternVL): its own prompt, not the chat template - an empty user turn left open, the
    # image, "Question: ...\nProcess: " and the steps each followed by <prm>, all in the assistant
    # turn; "Yes"/"No" logits at each <prm>.
    "mm_prm": PRMSpec(
        convention="mm_prm",
        layout="plain",
        step_token="<prm>",
        step_join="",
        reward_tokens=["Yes", "No"],
        question_join="",
        question_format=(
            f"<|im_start|>system\n{INTERNVL_SYSTEM}<|im_end|>\n<|im_start|>user\n<|im_start|>assistant\n"
            "{images}Question: {question}\nProcess: "
        ),
        image_text="<image>\n",
    ),
    # VisualPRM (InternVL): each step a user turn answered "+", the first "### Question:\n", the
    # image, the question and "\n\n### Solution Process:\n" before the step; "+"/"-" logits where
    # the assistant writes its reply.
    "visualprm": PRMSpec(
        convention="visualprm",
        layout="turns",
        system_prompt=INTERNVL_SYSTEM,
        question_format="### Question:\n{images}{question}",
        question_join="\n\n### Solution Process:\n",
    ),
}


assert set(get_args(ReleasedConvention)) == set(RELEASED_CONVENTIONS), "one name per released convention"


TrainLayout = Literal["mmprm", "mm_prm"]
"""The input layouts mmprm trains a PRM in: its own, or MM-PRM's (that of the mm_prm convention)."""


def train_step_format(layout: str, step_token: str = STEP_TOKEN) -> StepFormat | None:
    """The `StepFormat` a PRM is trained in: None (mmprm's own, with `step_token`) or, for
    "mm_prm", MM-PRM's input as its evaluation scripts build it (`RELEASED_CONVENTIONS["mm_prm"]`:
    InternVL's system message, an empty user turn, then the image and
    `Question: q\\nProcess: s1<prm>s2<prm>` in the assistant turn, read at each `<prm>`)."""
    if layout == "mmprm":
        return None
    if layout != "mm_prm":
        raise ValueError(f"prm.layout: {layout!r} is not one of {list(get_args(TrainLayout))}")
    return RELEASED_CONVENTIONS["mm_prm"].step_format


def trained_spec(head: str, reward_tokens: Sequence[str], system_prompt: str | None, layout: str = "mmprm") -> PRMSpec:
    """The spec of a PRM mmprm trains in `layout` (`train_step_format`); it is saved with the PRM,
    so scoring lays out its input exactly as training did."""
    fmt = train_step_format(layout)
    spec = PRMSpec(head=head, reward_tokens=list(reward_tokens), system_prompt=system_prompt)
    if fmt is None:
        return spec
    if system_prompt is not None:
        raise ValueError("prm.system_prompt: the mm_prm layout writes InternVL's system message itself; leave it null")
    fields = (
        "layout",
        "step_token",
        "step_join",
        "tag_prefix",
        "question_join",
        "reply",
        "question_format",
        "image_text",
    )
    return replace(spec, **{f: getattr(fmt, f) for f in fields})


def released_spec(convention: str) -> PRMSpec:
    """The spec of a released PRM family, by name (`RELEASED_CONVENTIONS`)."""
    if convention not in RELEASED_CONVENTIONS:
        raise ValueError(
            f"convention: {convention!r} is not one of {sorted(RELEASED_CONVENTIONS)} "
            "(a PRM mmprm trained needs none: it carries its own spec)"
        )
    return RELEASED_CONVENTIONS[convention]


def weight_files(model_dir: Path) -> dict[str, str]:
    """Weight name -> safetensors file of the checkpoint in `model_dir`: its index, else every
    safetensors file's header but the value head's (headers only are read)."""
    from safetensors import safe_open

    index = model_dir / INDEX_FILE
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    names: dict[str, str] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        if f.name != VALUE_HEAD_FILE:
            with safe_open(str(f), framework="pt") as st:
                names.update({k: f.name for k in st.keys()})
    return names


def reward_token_ids(tokenizer: Any, tokens: Sequence[str]) -> list[int]:
    """Ids of the reward tokens; each must be a single token of the vocabulary."""
    ids = []
    for tok in tokens:
        enc = tokenizer.encode(tok, add_special_tokens=False)
        if len(enc) != 1:
            raise ValueError(
                f"reward token {tok!r} is {len(enc)} tokens for this tokenizer: pick single-token "
                "reward tokens (set prm.reward_tokens)"
            )
        ids.append(enc[0])
    return ids


def read_spec(path: str | Path) -> PRMSpec:
    """The spec of the PRM directory `path`; a directory mmprm did not write is named as such."""
    spec_file = Path(path) / SPEC_FILE
    if not spec_file.exists():
        raise FileNotFoundError(
            f"{path}: no {SPEC_FILE}; this is not a PRM directory written by mmprm: for a released PRM "
            f"give its convention (one of {sorted(RELEASED_CONVENTIONS)}; docs/released-prms.md), or "
            "train one with recipes/prm_train.py"
        )
    spec = PRMSpec(**json.loads(spec_file.read_text()))
    spec.validate()
    return spec


def example_field(ex: Any, key: str, default: Any = None) -> Any:
    """A field of an example given as a dict or as an object (StepExample, Problem)."""
    return ex.get(key, default) if isinstance(ex, dict) else getattr(ex, key, default)


def example_steps(ex: Any) -> list[str]:
    return list(example_field(ex, "steps"))


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="scoring", unit="sol")


def check_examples(examples: Any) -> None:
    """Refuse what a scorer cannot read, before any work: a ValueError naming each bad example by
    index (and id) and field. A string of steps would otherwise be scored one character a step."""
    if isinstance(examples, (str, bytes, dict)) or not isinstance(examples, Sequence):
        raise ValueError(
            f"score() takes a list of examples ({{question, steps, images}}), got a {type(examples).__name__}: "
            "wrap a single example in a list"
        )
    bad: list[str] = []
    for i, ex in enumerate(examples):
        where = example_name(examples, i)
        question, steps, images = (example_field(ex, k) for k in ("question", "steps", "images"))
        if not isinstance(question, str):
            bad.append(f"{where}.question: {type(question).__name__}, where text is expected")
        if not isinstance(steps, (list, tuple)):
            bad.append(f"{where}.steps: {type(steps).__name__}, where a list of step texts is expected")
        else:
            bad += [
                f"{where}.steps[{j}]: {type(t).__name__}, where text is expected"
                for j, t in enumerate(steps)
                if not isinstance(t, str)
            ]
        if images is not None and (isinstance(images, (str, Path)) or not isinstance(images, (list, tuple))):
            bad.append(f"{where}.images: {type(images).__name__}, where a list of image paths is expected")
    if bad:
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        raise ValueError("; ".join(bad[:5]) + more)


def example_name(examples: Sequence[Any], i: int) -> str:
    """`examples[i]`, with its id where it has one: how scorers name an example in errors."""
    rid = example_field(examples[i], "id")
    return f"examples[{i}]" + (f" (id={rid})" if rid is not None else "")


def tokenize_named_group(
    processor: Any, spec: PRMSpec, examples: Sequence[Any], idx: Sequence[int], max_length: int | None, tokenize: Any
) -> list[TokenizedSteps]:
    """The examples `idx`, which share a prompt, tokenized (`tokenize` on the first, `tokenize_group`
    for the rest); an error (a special token in the text, a prompt past max_length) names the
    example it came from."""
    try:
        first = tokenize(examples[idx[0]])
        return tokenize_group(processor, spec, first, [examples[i] for i in idx[1:]], max_length, tokenize)
    except ValueError as e:
        raise naming_the_example(e, examples, idx, tokenize) from None


def naming_the_example(error: ValueError, examples: Sequence[Any], idx: Sequence[int], tokenize: Any) -> ValueError:
    """`error`, raised while tokenizing the group `idx`, with the example it came from named: the
    first that fails tokenized alone by `tokenize` (the group's first when none does)."""
    culprit = idx[0]
    for i in idx:
        try:
            tokenize(examples[i])
        except ValueError:
            culprit = i
            break
    try:
        return type(error)(f"{example_name(examples, culprit)}: {error}")
    except TypeError:  # an error class that takes other arguments
        return ValueError(f"{example_name(examples, culprit)}: {error}")


def group_by_prompt(examples: Sequence[Any], share_prefix: bool) -> tuple[list[list[int]], list[int]]:
    """Indices of the examples that share a question and images (one group each when not
    `share_prefix`), in order, and the indices of those with no steps (nothing to score).
    Malformed examples are refused first (`check_examples`)."""
    check_examples(examples)
    groups: dict[Any, list[int]] = {}
    empty: list[int] = []
    for i, ex in enumerate(examples):
        if not example_steps(ex):
            empty.append(i)
            continue
        # PIL images are unhashable: group those by object identity, paths by value
        imgs = tuple(x if isinstance(x, (str, Path)) else id(x) for x in (example_field(ex, "images") or ()))
        groups.setdefault((example_field(ex, "question"), imgs) if share_prefix else i, []).append(i)
    return list(groups.values()), empty


def tokenize_example(
    processor: Any, spec: PRMSpec, ex: Any, images: Sequence[Any], max_length: int | None
) -> TokenizedSteps:
    """`ex` as the PRM of `spec` sees it (`tokenize_steps`); a prompt whose first step does not fit
    in `max_length` is an error naming the example."""
    tok = tokenize_steps(
        processor,
        example_field(ex, "question"),
        example_steps(ex),
        images,
        max_length=max_length,
        system=spec.system_prompt,
        fmt=spec.step_format,
    )
    if tok is None:
        raise ValueError(
            f"id={example_field(ex, 'id', '?')}: the prompt and the first step do not fit in "
            f"max_length={max_length}; raise max_length or shorten the question"
        )
    return tok


def tokenize_group(
    processor: Any,
    spec: PRMSpec,
    first: TokenizedSteps,
    others: Sequence[Any],
    max_length: int | None,
    tokenize: Any,
) -> list[TokenizedSteps]:
    """`first` and the examples `others` that share its prompt and images: only their new steps are
    tokenized (`extend_steps`), or the whole example by `tokenize` where the prompt cannot be reused."""
    toks = [first]
    for ex in others:
        ext = extend_steps(processor, first, example_steps(ex), max_length=max_length, fmt=spec.step_format)
        toks.append(ext if ext is not None else tokenize(ex))
    return toks
