"""The policy's prompt format, saved with the policy so every caller sends what it was taught.

`recipes/policy_sft.py` trains a policy on one prompt (system prompt, chat template, user turn)
and one solution format (`<step>` tags). Annotation and Best-of-N generation must send exactly
that prompt, or they sample a policy that never saw it. So SFT writes `mmprm_policy.json`
beside the weights, and both read it::

    save_policy_spec("runs/policy", PolicySpec(system_prompt="Solve step by step."))
    system, mode = resolve_prompt_format("runs/policy", system_prompt=None, step_mode=None,
                                         where="mcts_annotate")
    # -> ("Solve step by step.", "tags"): the saved spec fills what the config left unset

A value the config does set wins (a deliberate override), with a warning when it differs from
the saved spec. A policy without the file (a hub model, one trained elsewhere) gets the config's
values, or no system prompt and `tags`.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, get_args

from mmprm.generation.base import StepMode

POLICY_SPEC_FILE = "mmprm_policy.json"
SPEC_VERSION = 1


@dataclass
class PolicySpec:
    """What a policy's prompt needs besides its chat template (saved with the processor).

    Attributes:
        system_prompt: the system turn it was trained with; None means no system turn.
        step_mode: how it writes a solution: "tags" (`<step>`, `<answer>`: an SFT'd policy) or
            "blank_lines" (paragraphs, a `\\boxed{}` answer).
    """

    system_prompt: str | None = None
    step_mode: StepMode = "tags"

    def to_json(self) -> dict[str, Any]:
        return {"format": "mmprm-policy", "version": SPEC_VERSION, **asdict(self)}


def save_policy_spec(model_dir: str | Path, spec: PolicySpec) -> Path:
    """Write `mmprm_policy.json` into a policy directory."""
    path = Path(model_dir) / POLICY_SPEC_FILE
    path.write_text(json.dumps(spec.to_json(), indent=2) + "\n", encoding="utf-8")
    return path


def load_policy_spec(model_dir: str | Path) -> PolicySpec | None:
    """The spec saved with a policy, or None when it has none (a hub id, a model trained elsewhere).

    Raises:
        ValueError: the file exists but is not a spec this version reads (names file and field).
    """
    path = Path(model_dir) / POLICY_SPEC_FILE
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e}); delete it or rewrite it from the SFT config") from None
    if not isinstance(raw, dict) or raw.get("version") != SPEC_VERSION:
        raise ValueError(
            f"{path}: version: expected {SPEC_VERSION}, got {raw.get('version') if isinstance(raw, dict) else raw!r}"
        )
    system, mode = raw.get("system_prompt"), raw.get("step_mode", "tags")
    if system is not None and not isinstance(system, str):
        raise ValueError(f"{path}: system_prompt: must be a string or null, got {system!r}")
    if mode not in get_args(StepMode):
        raise ValueError(f"{path}: step_mode: {mode!r} is not one of {list(get_args(StepMode))}")
    return PolicySpec(system_prompt=system, step_mode=mode)


def resolve_prompt_format(
    model_dir: str | Path,
    system_prompt: str | None,
    step_mode: StepMode | None,
    where: str,
) -> tuple[str | None, StepMode]:
    """(system prompt, step mode) to prompt a policy with: config values, else its saved spec.

    Args:
        model_dir: the policy (a directory; a hub id has no spec).
        system_prompt: the config's value; None = not set (use the spec). An empty string sends
            no system turn even when the spec has one.
        step_mode: the config's value; None = not set.
        where: the config section, for the warning (e.g. "model.system_prompt").
    """
    spec = load_policy_spec(model_dir) if Path(model_dir).is_dir() else None
    if spec is None:
        return (system_prompt or None), (step_mode or "tags")
    for key, ours, saved in (
        ("system_prompt", system_prompt, spec.system_prompt),
        ("step_mode", step_mode, spec.step_mode),
    ):
        if ours is not None and (ours or None) != saved:
            warnings.warn(
                f"{where}: {key}={ours!r} overrides {saved!r} saved with the policy in "
                f"{Path(model_dir) / POLICY_SPEC_FILE}: the policy was trained on a different prompt",
                stacklevel=2,
            )
    system = spec.system_prompt if system_prompt is None else (system_prompt or None)
    return system, (step_mode or spec.step_mode)
