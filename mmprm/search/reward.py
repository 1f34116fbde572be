"""The PRM as an RL reward: a reward function in the form TRL's `GRPOTrainer` takes.

    from trl import GRPOConfig, GRPOTrainer
    from mmprm import load_prm
    from mmprm.search.reward import PRMReward

    reward = PRMReward(load_prm("runs/prm"), aggregator="min")
    trainer = GRPOTrainer(model=policy, reward_funcs=[reward], args=GRPOConfig(...), train_dataset=ds)

TRL calls `reward(prompts=..., completions=..., completion_ids=..., **columns)` with every other
dataset column as a keyword list (one entry per completion), and wants one float per completion.
The question comes from the `question` column (else the prompt's last user text), the images
from `images` (a list per row) or `image` (one per row): paths or PIL images. Each completion is
parsed in the policy's step format (`parse_solution`), its answer attached to its last step
(`prm_steps`, exactly as Best-of-N scores candidates), scored by the PRM in one `score` call
- the G completions of a prompt share the question and images, so the scorer's shared-prefix path
encodes the image+question prompt once per group - and reduced to one number by an aggregator
of `mmprm.scoring.AGGREGATORS`. A completion with no step at all gets `empty_reward`, and so does
one the PRM scored only in part (steps past its `max_length`): as in Best-of-N, which ranks such a
candidate last, a partial score must not pay (`last` would read a middle step), or the policy
learns to write past the PRM's context.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from mmprm.generation.base import StepMode
from mmprm.scoring.aggregators import AGGREGATORS
from mmprm.search.core import PrefixScorer
from mmprm.steps import parse_solution, prm_steps


def completion_text(completion: Any) -> str:
    """Text of a TRL completion: a string, or conversational messages (their assistant contents)."""
    if isinstance(completion, str):
        return completion
    parts = []
    for message in completion:
        content = message.get("content", "") if isinstance(message, dict) else message
        if isinstance(content, list):  # typed parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(str(content))
    return "".join(parts)


def _question_of(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    return completion_text([users[-1]]) if users else completion_text(prompt)


class PRMReward:
    """Reward = aggregated PRM step probabilities of a step-formatted completion.

    Args:
        scorer: a `PRMScorer` (`mmprm.load_prm`) or any `PrefixScorer`.
        aggregator: name in `mmprm.scoring.AGGREGATORS` ("min" by default, as Best-of-N).
        step_mode: how completions are split into steps ("tags" or "blank_lines").
        question_column, images_column: dataset columns holding the question and images.
        empty_reward: reward of a completion with no parsable step (e.g. cut off before `</step>`)
            or with steps the PRM cut (its `max_length`); keep it at or below every reward a complete
            completion can get. None: the aggregator's score of no steps, 0.0, the floor of the
            probability-scale ones; sum_logpr / sum_logodds have no finite floor and need a value.
    """

    def __init__(
        self,
        scorer: PrefixScorer,
        aggregator: str = "min",
        step_mode: StepMode = "tags",
        question_column: str = "question",
        images_column: str = "images",
        empty_reward: float | None = None,
    ):
        if aggregator not in AGGREGATORS:
            raise ValueError(f"aggregator {aggregator!r} is not one of {list(AGGREGATORS)}")
        if empty_reward is None:
            empty_reward = AGGREGATORS[aggregator]([])
            if not math.isfinite(empty_reward):
                raise ValueError(
                    f"PRMReward: aggregator {aggregator!r} scores completions on an unbounded log scale: give "
                    "empty_reward, the reward of an empty or truncated completion, below any reward you expect "
                    "(e.g. -100.0), or use a probability-scale aggregator such as 'min'"
                )
        self.scorer, self.aggregator, self.step_mode = scorer, aggregator, step_mode
        self.question_column, self.images_column = question_column, images_column
        self.empty_reward = empty_reward
        self.__name__ = f"prm_{aggregator}"  # TRL logs each reward under its function's name
        self.calls = 0
        self.truncated = 0  # completions the PRM cut at its max_length, all calls together

    def __call__(
        self,
        prompts: Sequence[Any] | None = None,
        completions: Sequence[Any] = (),
        completion_ids: Any = None,
        **columns: Any,
    ) -> list[float]:
        n = len(completions)
        questions = columns.get(self.question_column) or [_question_of(p) for p in (prompts or [""] * n)]
        images = columns.get(self.images_column)
        if images is None and columns.get("image") is not None:
            images = [[im] if im is not None else [] for im in columns["image"]]
        images = images or [[] for _ in range(n)]
        if not len(questions) == len(images) == n:
            raise ValueError(
                f"PRMReward: {n} completions but {len(questions)} questions and {len(images)} image "
                f"lists (columns {self.question_column!r}/{self.images_column!r})"
            )
        examples, where = [], []
        for i, c in enumerate(completions):
            parsed = parse_solution(completion_text(c), self.step_mode)
            steps = prm_steps(parsed.steps, parsed.answer)
            if steps:
                examples.append({"question": questions[i], "images": list(images[i] or []), "steps": steps})
                where.append(i)
        rewards = [float(self.empty_reward)] * n
        if examples:
            for i, probs in zip(where, self.scorer.score(examples)):
                if any(math.isnan(p) for p in probs):  # NaN: a step cut by the PRM's max_length
                    self.truncated += 1
                    continue  # keeps empty_reward: the lowest, as Best-of-N ranks it last
                rewards[i] = float(AGGREGATORS[self.aggregator](probs))
        self.calls += 1
        return rewards
