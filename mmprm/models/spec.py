"""What a PRM directory holds besides the HF files (`PRMSpec`), and the example fields scorers read.

Shared by the HF scorer (`mmprm.models.prm`) and the vLLM scorer (`mmprm.models.vllm_prm`), so
that neither imports the other.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmprm.steps import STEP_TOKEN

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
