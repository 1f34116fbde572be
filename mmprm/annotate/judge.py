"""Optional LLM judge for answer equivalence, over an OpenAI-compatible chat endpoint.

    client = ChatClient(ChatConfig(url="http://localhost:8000/v1", model="Qwen2.5-72B-Instruct"),
                        config_key="verify.judge_chat", cache_path="runs/mcts/judge_cache.jsonl")
    verify = judged_verifier(LLMJudge(client))  # rule-based first, the judge only when rules say no

The rule-based checker (`mmprm.answers`) is the default and decides most answers; a judge helps
with free-form answers rules cannot match ("two thirds" vs "2/3"). It is asked only about answers
the rules rejected, once per distinct answer (the engine caches verdicts per problem, the client
caches replies on disk). Retries, backoff and the outage error are `mmprm.chat.ChatClient`'s: a
dead endpoint raises `EndpointUnavailable` instead of silently counting rollouts as wrong, and a
reply that is not yes/no after the client's parse retries raises `ChatError`.
"""

from __future__ import annotations

from collections.abc import Callable

from mmprm.chat import ChatClient, ChatError, messages_for

PROMPT = """Decide whether a model's final answer to a problem is equivalent to the reference answer.
Ignore formatting (LaTeX, \\boxed{{}}, units written or not, option letter vs. option text when the
options are given). Reply with exactly one word: Yes or No.

Problem:
{question}

Options: {choices}
Reference answer: {gold}
Model's answer: {pred}"""


def parse_yes_no(reply: str) -> bool | None:
    """True for "yes", False for "no" (case, spaces and a trailing period ignored), else None."""
    word = reply.strip().strip(".!").lower()
    return {"yes": True, "no": False}.get(word)


class LLMJudge:
    """`(pred, gold, choices) -> bool` by asking a chat model through `client`.

    Args:
        client: the endpoint (`mmprm.chat.ChatClient`).
        parse_retries: extra asks when a reply is not yes/no, before raising `ChatError`.
    """

    def __init__(self, client: ChatClient, parse_retries: int = 2):
        self.client = client
        self.parse_retries = parse_retries
        self.calls = 0

    def __call__(self, pred: str | None, gold: str, choices: list[str] | None = None, question: str = "") -> bool:
        if pred is None:
            return False
        content = PROMPT.format(
            question=question or "(not given)", choices=", ".join(choices) if choices else "none", gold=gold, pred=pred
        )
        self.calls += 1
        verdict, replies = self.client.ask(messages_for(content), parse_yes_no, self.parse_retries, max_tokens=4)
        if verdict is None:
            raise ChatError(
                f"judge at {self.client.url} answered {replies[-1].text[:80]!r} {len(replies)} times "
                "instead of Yes/No; use an instruction-following model ("
                f"{self.client.config_key}.model)"
            )
        return verdict


def judged_verifier(
    judge: LLMJudge, rules: Callable[[str | None, str, list[str] | None], bool] | None = None
) -> Callable[[str | None, str, list[str] | None], bool]:
    """Verifier that trusts the rule-based checker's "yes" and asks `judge` about its "no"."""
    if rules is None:
        from mmprm.annotate.engine import rule_verifier as rules

    def verify(pred: str | None, gold: str, choices: list[str] | None = None) -> bool:
        if pred is None:
            return False
        return rules(pred, gold, choices) or judge(pred, gold, choices)

    return verify
