"""A simulated policy whose per-step error probabilities are known, as a rollout backend.

A problem has L steps and error probabilities e_1..e_L. Writing step i from a correct prefix,
the policy errs with probability e_i; once wrong it stays wrong, and a wrong solution ends in a
wrong answer. So the true Monte Carlo value of a prefix is exact:

    MC(prefix) = 0                              if any step of the prefix is wrong
               = prod_{i > len(prefix)} (1 - e_i)  otherwise

Steps say what they are ("s3 ok 81722" / "s3 bad 1044"; the number makes every rollout unique),
so tests can read the true first error off any solution. Used by the search tests, the kill/resume
test (`delay_s` keeps a subprocess busy) and the efficiency benchmark.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from mmprm.generation.base import GenerationStats, RolloutRequest, StepMode
from mmprm.steps import render_solution

GOLD = "42"
WRONG = "-1"


@dataclass
class SimProblem:
    """Error probability of each step (its length is the solution length)."""

    error_probs: list[float]
    answer: str = GOLD


def step_ok(step: str) -> bool:
    """Whether a simulated step is correct (read from its text)."""
    return step.split()[1] == "ok"


def first_wrong_step(steps: Sequence[str]) -> int | None:
    """1-based position of the first wrong simulated step, or None if all are right."""
    for i, s in enumerate(steps, start=1):
        if not step_ok(s):
            return i
    return None


def true_mc(problem: SimProblem, prefix: Sequence[str]) -> float:
    """Exact MC value of `prefix` (see module doc)."""
    if first_wrong_step(prefix) is not None:
        return 0.0
    return math.prod(1.0 - e for e in problem.error_probs[len(prefix) :])


def random_problems(
    n: int, min_steps: int = 8, max_steps: int = 16, seed: int = 0, mean_success: float = 0.4
) -> dict[str, SimProblem]:
    """`n` problems with 8-16 steps whose root success rates centre on `mean_success`.

    Per-step error rates are random but sum to about -ln(mean_success), so errors spread over
    the whole solution rather than piling up on one step.
    """
    rng = random.Random(seed)
    out = {}
    for i in range(n):
        length = rng.randint(min_steps, max_steps)
        weights = [rng.random() for _ in range(length)]
        hazard = -math.log(mean_success) * rng.uniform(0.5, 1.5)
        out[f"sim-{i}"] = SimProblem([min(0.9, hazard * w / sum(weights)) for w in weights])
    return out


class SimulatedPolicy:
    """`RolloutBackend` that writes simulated solutions for the problems it knows.

    Args:
        problems: problem id -> SimProblem.
        seed: base seed; each `generate` call draws from `Random((seed, call number))`, a request
            that carries its own `seed` from `Random((seed, request seed))`.
        step_mode: "tags" writes `<step>`/`<answer>`; "blank_lines" writes plain paragraphs, the
            last one ending in a `\\boxed{}` answer.
        delay_s: sleep per call (to make a subprocess slow enough to kill mid-run).
        unparsable: problem ids for which the policy writes prose with no steps at all.
        stuck: problem ids whose submitted requests never finish (an engine that loses a request).

    A request's `temperature` is ignored: the error rates are the policy's, at any temperature.
    It also takes requests continuously (`submit`, `poll`): a request finishes after one poll per
    4 steps of its longest rollout, so short probes come back before long ones, as on an engine.
    """

    def __init__(
        self,
        problems: Mapping[str, SimProblem],
        seed: int = 0,
        step_mode: StepMode = "tags",
        delay_s: float = 0.0,
        unparsable: Sequence[str] = (),
        stuck: Sequence[str] = (),
    ):
        self.problems = dict(problems)
        self.seed = seed
        self.step_mode = step_mode
        self.delay_s = delay_s
        self.unparsable = set(unparsable)
        self.stuck = set(stuck)
        self.stats = GenerationStats()
        self._pending: list[tuple[float, int, list[str]]] = []  # (polls left, ticket, texts)
        self._next_ticket = 0

    def sample(self, problem: SimProblem, prefix: Sequence[str], rng: random.Random) -> tuple[list[str], str]:
        """One continuation of `prefix`: (new steps, final answer)."""
        wrong = first_wrong_step(prefix) is not None
        steps = []
        for i in range(len(prefix), len(problem.error_probs)):
            wrong = wrong or rng.random() < problem.error_probs[i]
            steps.append(f"s{i + 1} {'bad' if wrong else 'ok'} {rng.randrange(10**6)}")
        return steps, (WRONG if wrong else problem.answer)

    def close(self) -> None:
        """Nothing to free: the task is simulated."""

    def generate(self, requests: list[RolloutRequest]) -> list[list[str]]:
        start = time.perf_counter()
        call_rng = random.Random(f"{self.seed}:{self.stats.calls}")
        out = []
        for req in requests:
            rng = call_rng if req.seed is None else random.Random(f"{self.seed}:request:{req.seed}")
            problem = self.problems.get(req.problem_id)
            if problem is None:
                raise KeyError(f"simulated policy has no problem {req.problem_id!r}")
            texts = []
            for _ in range(req.n):
                if req.problem_id in self.unparsable:
                    texts.append("I think the answer might be something, hard to say.")
                    continue
                steps, answer = self.sample(problem, req.prefix_steps, rng)
                if self.step_mode == "tags":
                    texts.append(render_solution(steps, answer))
                else:
                    # The answer sits in the last paragraph, so every paragraph is a simulated step.
                    steps[-1] += f" So the answer is $\\boxed{{{answer}}}$."
                    texts.append("\n\n".join(steps))
            out.append(texts)
            self.stats.sequences += req.n
            self.stats.generated_tokens += sum(len(t.split()) for t in texts)
        if self.delay_s:
            time.sleep(self.delay_s)
        self.stats.calls += 1
        self.stats.seconds += time.perf_counter() - start
        return out

    def submit(self, request: RolloutRequest) -> int:
        """Queue one request (`ContinuousBackend`); its rollouts are drawn now, returned by `poll`."""
        (texts,) = self.generate([request])
        polls = 1 + max((t.count("<step>") or t.count("\n\n") + 1 for t in texts), default=0) // 4
        if request.problem_id in self.stuck:
            polls = math.inf
        ticket = self._next_ticket
        self._next_ticket += 1
        self._pending.append((polls, ticket, texts))
        return ticket

    def poll(self) -> list[tuple[int, list[str]]]:
        """One simulated engine step: the requests whose time is up, in submission order."""
        if self.delay_s:
            time.sleep(self.delay_s)
        left = [(polls - 1, ticket, texts) for polls, ticket, texts in self._pending]
        self._pending = [x for x in left if x[0] > 0]
        return [(ticket, texts) for polls, ticket, texts in left if polls <= 0]

    def cancel(self, tickets: Collection[int] | None = None) -> None:
        """Drop these submitted requests, or every one not yet returned."""
        drop = None if tickets is None else set(tickets)
        self._pending = [] if drop is None else [x for x in self._pending if x[1] not in drop]


# -- a toy real policy -------------------------------------------------------------------------

TOY_QUESTION = "<image1> The bar shows 2 and then 3 more. What is the total?"
TOY_ANSWER = "5"


def toy_solution(rng: random.Random, error_rate: float = 0.35) -> tuple[list[str], str]:
    """A 3-step solution of the toy question; step 2 is wrong with prob `error_rate`, and a wrong
    step 2 carries through to a wrong answer (so the first error is planted at step 2)."""
    total = 5 if rng.random() >= error_rate else rng.choice([4, 6, 7])
    return ["The bar starts at 2.", f"Adding 3 gives 2 + 3 = {total}.", f"So the total is {total}."], str(total)


def train_toy_policy(model_dir: str, out_dir: str, steps: int = 150, seed: int = 0, lr: float = 3e-3) -> str:
    """Teach a tiny preset (`mmprm.models.tiny`) our step format on the toy question, then save it.

    A random-init tiny model writes no `<step>` tags, so an annotation run over it ends with
    `no_steps` everywhere. A few hundred CPU steps make it a real (weak) policy: it writes the
    format, and at temperature 1 errs at step 2 about as often as its training data does, which
    gives the search genuine mixed rollouts to localise. Used by tests and the benchmark.
    """
    import torch
    from PIL import Image

    from mmprm.models.loading import is_multimodal, load_backbone
    from mmprm.steps import prompt_text

    torch.manual_seed(seed)
    rng = random.Random(seed)
    model, processor = load_backbone(model_dir)
    tok = getattr(processor, "tokenizer", processor)
    tok.padding_side = "right"
    mm = is_multimodal(model)
    question = TOY_QUESTION if mm else TOY_QUESTION.replace("<image1> ", "")
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        texts, images = [], []
        for _ in range(8):
            sol_steps, answer = toy_solution(rng)
            prompt = prompt_text(processor, question, 1 if mm else 0)
            texts.append(prompt + render_solution(sol_steps, answer) + tok.eos_token)
            images.append([Image.new("RGB", (28 * rng.randint(1, 2), 28), (rng.randrange(256), 90, 160))])
        if mm:
            enc = processor(text=texts, images=images, padding=True, return_tensors="pt")
        else:
            enc = tok(texts, padding=True, return_tensors="pt", add_special_tokens=False)
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        loss = model(**enc, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    from mmprm.generation.policy import PolicySpec, save_policy_spec

    save_policy_spec(out_dir, PolicySpec(system_prompt=None, step_mode="tags"))  # what it was trained on
    return out_dir


def write_toy_problems(out_dir: str, n: int = 8, images: bool = True, seed: int = 0) -> str:
    """A problems file of `n` toy problems (the toy question over different bar images)."""
    import json
    from pathlib import Path

    from PIL import Image

    rng = random.Random(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        names = []
        if images:
            names = [f"toy_{i}.png"]
            Image.new("RGB", (28 * rng.randint(1, 2), 28), (rng.randrange(256), 90, 160)).save(out / names[0])
        question = TOY_QUESTION if images else TOY_QUESTION.replace("<image1> ", "")
        rows.append({"id": f"toy-{i}", "images": names, "question": question, "answer": TOY_ANSWER})
    path = out / "problems.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def cli_toy_policy(argv: list[str]) -> int:
    """`mmprm toy-policy --base TINY_DIR --out DIR [--problems-dir DIR]`: a tiny policy that writes
    our step format, plus a matching problems file, for CPU annotation demos and tests."""
    import argparse

    parser = argparse.ArgumentParser(prog="mmprm toy-policy", description=cli_toy_policy.__doc__)
    parser.add_argument("--base", required=True, help="a tiny preset dir (mmprm tiny-model)")
    parser.add_argument("--out", required=True, help="where to save the trained toy policy")
    parser.add_argument("--problems-dir", default=None, help="also write problems.jsonl (+ images) here")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--n", type=int, default=8, help="number of toy problems")
    args = parser.parse_args(argv)
    train_toy_policy(args.base, args.out, steps=args.steps)
    print(f"toy policy written to {args.out}")
    if args.problems_dir:
        from mmprm.models.loading import is_multimodal

        print(f"problems written to {write_toy_problems(args.problems_dir, args.n, images=is_multimodal(args.base))}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(cli_toy_policy(sys.argv[1:]))
