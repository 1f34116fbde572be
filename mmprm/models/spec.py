"""What a PRM directory holds besides the HF files (`PRMSpec`), and how a scorer reads examples:
their fields, their groups by shared prompt, their tokenization.

Shared by the HF scorer (`mmprm.models.prm`) and the vLLM scorer (`mmprm.models.vllm_prm`), so
that neither imports the other and both tokenize exactly alike.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmprm.steps import STEP_TOKEN, TokenizedSteps, extend_steps, tokenize_steps

SPEC_FILE = "mmprm_prm.json"
VALUE_HEAD_FILE = "value_head.safetensors"


@dataclass
class PRMSpec:
    """What a PRM directory needs besides the HF files to score exactly like training did."""

    head: str = "token_pair"
    step_token: str = STEP_TOKEN
    reward_tokens: list[str] = field(default_factory=lambda: ["+", "-"])
    system_prompt: str | None = None

    def validate(self) -> None:
        if self.head not in ("token_pair", "value"):
            raise ValueError(f"head: {self.head!r} is not one of ['token_pair', 'value']")
        if len(self.reward_tokens) != 2 or self.reward_tokens[0] == self.reward_tokens[1]:
            raise ValueError("reward_tokens: give two different tokens, positive first (e.g. ['+', '-'])")


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
            f"{path}: no {SPEC_FILE}; this is not a PRM directory written by mmprm "
            "(train one with recipes/prm_train.py, or use PRMSpec with build_prm)"
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


def group_by_prompt(examples: Sequence[Any], share_prefix: bool) -> tuple[list[list[int]], list[int]]:
    """Indices of the examples that share a question and images (one group each when not
    `share_prefix`), in order, and the indices of those with no steps (nothing to score)."""
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
        step_token=spec.step_token,
        system=spec.system_prompt,
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
        ext = extend_steps(processor, first, example_steps(ex), max_length=max_length, step_token=spec.step_token)
        toks.append(ext if ext is not None else tokenize(ex))
    return toks
