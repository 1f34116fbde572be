"""Optional LLM judge for answer equivalence, over an OpenAI-compatible chat endpoint.

    judge = LLMJudge("http://localhost:8000/v1", "Qwen2.5-72B-Instruct")   # key: $OPENAI_API_KEY
    verify = judged_verifier(judge)        # rule-based first, the judge only when rules say no

The rule-based checker (`mmprm.answers`) is the default and decides most answers; a judge helps
with free-form answers rules cannot match ("two thirds" vs "2/3"). It is asked only about answers
the rules rejected, once per distinct answer (the engine caches verdicts per problem), and a
failing endpoint raises after `retries` tries instead of silently counting rollouts as wrong.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from typing import Callable

PROMPT = """Decide whether a model's final answer to a problem is equivalent to the reference answer.
Ignore formatting (LaTeX, \\boxed{{}}, units written or not, option letter vs. option text when the
options are given). Reply with exactly one word: Yes or No.

Problem:
{question}

Options: {choices}
Reference answer: {gold}
Model's answer: {pred}"""


class JudgeError(RuntimeError):
    """The judge endpoint failed or answered something other than yes/no."""


class LLMJudge:
    """`(pred, gold, choices) -> bool` by asking a chat model.

    Args:
        url: base URL of an OpenAI-compatible API (…/v1); `/chat/completions` is appended.
        model: model name the endpoint serves.
        api_key_env: environment variable holding the key (unset: no Authorization header).
        timeout_s: per request.
        retries: tries per question before raising JudgeError.
    """

    def __init__(self, url: str, model: str, api_key_env: str = "OPENAI_API_KEY", timeout_s: float = 60.0,
                 retries: int = 3):
        if not url or not model:
            raise ValueError("verify.judge_url and verify.judge_model must be set to use the LLM judge")
        self.endpoint = url.rstrip("/") + "/chat/completions"
        self.model = model
        self.api_key = os.environ.get(api_key_env)
        self.timeout_s = timeout_s
        self.retries = retries
        self.calls = 0

    def __call__(self, pred: str | None, gold: str, choices: list[str] | None = None, question: str = "") -> bool:
        if pred is None:
            return False
        content = PROMPT.format(question=question or "(not given)", choices=", ".join(choices) if choices else "none",
                                gold=gold, pred=pred)
        body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": content}],
                           "temperature": 0.0, "max_tokens": 4}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        last = ""
        for attempt in range(self.retries):
            self.calls += 1
            try:
                req = urllib.request.Request(self.endpoint, data=body, headers=headers, method="POST")
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    reply = json.loads(resp.read())["choices"][0]["message"]["content"]
            except (urllib.error.URLError, OSError, KeyError, IndexError, ValueError) as e:
                last = f"{type(e).__name__}: {e}"
                time.sleep(min(2.0 ** attempt, 10.0) * 0.1)
                continue
            word = reply.strip().strip(".!").lower()
            if word in ("yes", "no"):
                return word == "yes"
            last = f"unexpected reply {reply!r}"
        raise JudgeError(f"judge at {self.endpoint} failed {self.retries} times: {last} "
                         "(check verify.judge_url / judge_model and that the server is up)")


def judged_verifier(judge: LLMJudge,
                    rules: Callable[[str | None, str, list[str] | None], bool] | None = None
                    ) -> Callable[[str | None, str, list[str] | None], bool]:
    """Verifier that trusts the rule-based checker's "yes" and asks `judge` about its "no"."""
    if rules is None:
        from mmprm.annotate.engine import rule_verifier as rules

    def verify(pred: str | None, gold: str, choices: list[str] | None = None) -> bool:
        if pred is None:
            return False
        return rules(pred, gold, choices) or judge(pred, gold, choices)

    return verify
