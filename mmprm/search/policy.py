"""The search's step proposer over a rollout backend (HF generate or vLLM): one step per sample.

    backend = HFBackend.from_pretrained("runs/policy", SamplingConfig(max_new_tokens=64))
    proposer = BackendProposer(backend, step_mode="tags")
    proposals = proposer.propose([StepRequest("p1", question, images, ["Tile 1 is 3."], n=4)])

The prompt continues the partial assistant message exactly as annotation rollouts do
(`mmprm.generation.base.rollout_prompt`); generation stops at the end of ONE step
(`</step>`, or `</answer>` when the policy answers instead; a blank line in blank_lines mode).
All requests of a search round go to the backend in one `generate` call, so HF batches them in
chunks of `batch_size` rows and vLLM schedules them together with prefix caching.

Generated tokens are counted by tokenizing each continuation's text with the policy's tokenizer
(special tokens such as EOS not counted), for both backends and for Best-of-N samples alike, so the
equal-budget comparison counts every method the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mmprm.generation.base import RolloutBackend, RolloutRequest, StepMode, problems_per_call
from mmprm.search.core import StepProposal, StepRequest
from mmprm.steps import ANSWER_CLOSE, STEP_CLOSE, parse_solution

STEP_STOPS: dict[str, list[str]] = {"tags": [STEP_CLOSE, ANSWER_CLOSE], "blank_lines": ["\n\n"]}
"""Where one step ends in each step mode (a blank line separates blank_lines steps)."""


def parse_step(text: str, step_mode: StepMode = "tags") -> tuple[str, str | None]:
    """(step, answer) of one continuation that should hold a single step.

    tags: the first `<step>` block; with none, an `<answer>` alone finishes the solution
    (step ""); anything else (cut off, free text) is ("", None): a dead continuation.
    blank_lines: the text up to the blank line is the step; its final answer, if it states one
    (`mmprm.answers.extract_answer`), finishes the solution.

    >>> parse_step("<step>Tile 1 is 3.</step>")
    ('Tile 1 is 3.', None)
    >>> parse_step("\\n<answer>7</answer>")
    ('', '7')
    """
    if step_mode == "tags":
        parsed = parse_solution(text, "tags")
        if parsed.steps:
            return parsed.steps[0], None
        return "", parsed.answer
    if step_mode == "blank_lines":
        from mmprm.answers import extract_answer

        step = text.split("\n\n")[0].strip()
        return step, (extract_answer(step) if step else None)
    raise ValueError(f"unknown step mode {step_mode!r}: use 'tags' or 'blank_lines'")


def backend_tokenizer(backend: Any) -> Any:
    """The policy tokenizer of an HF or vLLM backend (to count generated tokens)."""
    tok = getattr(backend, "tokenizer", None)
    if tok is None:
        processor = getattr(backend, "processor", None)
        tok = getattr(processor, "tokenizer", processor)
    if tok is None:
        raise ValueError(f"{type(backend).__name__} has neither a tokenizer nor a processor: pass tokenizer=")
    return tok


def count_tokens(tokenizer: Any, texts: Sequence[str]) -> list[int]:
    """Tokens of each generated text (no special tokens added)."""
    if not texts:
        return []
    return [len(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


class BackendProposer:
    """`StepProposer` over a `RolloutBackend`: one backend call per search round.

    Args:
        backend: `HFBackend` or `VLLMBackend` (their `step_mode` must equal `step_mode`).
        step_mode: "tags" (`<step>` blocks) or "blank_lines".
        tokenizer: to count generated tokens; defaults to the backend's.
    """

    def __init__(self, backend: RolloutBackend, step_mode: StepMode = "tags", tokenizer: Any = None):
        if getattr(backend, "step_mode", step_mode) != step_mode:
            raise ValueError(f"backend step_mode {backend.step_mode!r} != search step_mode {step_mode!r}")
        self.backend = backend
        self.step_mode = step_mode
        self.tokenizer = tokenizer or backend_tokenizer(backend)

    def propose(self, requests: list[StepRequest]) -> list[list[StepProposal]]:
        if not requests:
            return []
        stop = STEP_STOPS[self.step_mode]
        texts = self.backend.generate(
            [RolloutRequest(r.problem_id, r.question, r.images, list(r.prefix_steps), r.n, stop=stop) for r in requests]
        )
        out = []
        for outs in texts:
            tokens = count_tokens(self.tokenizer, outs)
            out.append([StepProposal(*parse_step(t, self.step_mode), tokens=k, text=t) for t, k in zip(outs, tokens)])
        return out


def sample_solutions(
    backend: RolloutBackend,
    problems: Sequence[Any],
    n: int,
    step_mode: StepMode = "tags",
    batch_size: int = 64,
    tokenizer: Any = None,
) -> list[list[dict[str, Any]]]:
    """N whole solutions per problem (Best-of-N's candidates), with their generated tokens.

    Returns per problem a list of `{"text", "steps", "answer", "complete", "tokens"}`, steps as
    the PRM scores them (`prm_steps`: the answer attached to the last step).
    """
    from mmprm.steps import prm_steps

    tokenizer = tokenizer or backend_tokenizer(backend)
    per_call = problems_per_call(backend, n, batch_size)
    out: list[list[dict[str, Any]]] = []
    for lo in range(0, len(problems), per_call):
        chunk = problems[lo : lo + per_call]
        texts = backend.generate(
            [
                RolloutRequest(str(_get(p, "id")), _get(p, "question"), list(_get(p, "images") or []), [], n)
                for p in chunk
            ]
        )
        for outs in texts:
            cands = []
            for text, k in zip(outs, count_tokens(tokenizer, outs)):
                parsed = parse_solution(text, step_mode)
                cands.append(
                    {
                        "text": text,
                        "steps": prm_steps(parsed.steps, parsed.answer),
                        "answer": parsed.answer,
                        "complete": parsed.complete,
                        "tokens": k,
                    }
                )
            out.append(cands)
    return out


def _get(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key)
