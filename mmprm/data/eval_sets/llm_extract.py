"""LLM answer extraction as MathVista and MathVerse run it: their prompts and few-shot demos, asked
of an OpenAI-compatible endpoint through `mmprm.chat.ChatClient` (its cache and retries).

    client = ChatClient(ChatConfig(url="http://127.0.0.1:8000/v1", model="Qwen2.5-72B-Instruct"))
    verdict = llm_answer_correct(client, reply_text, problem)   # problem: a mathvista/mathverse row
    verdict.correct, verdict.extraction, verdict.judgement

MathVista (github:lupantech/MathVista@53d525874bdde205128e6b160b7357a88277d479:
evaluation/extract_answer.py, demos in evaluation/prompts/ext_ans.py): an empty reply extracts
"", a multiple-choice reply equal to a choice is that choice, an integer or float reply parses as
itself; otherwise the five demos, the question's `query` and the reply are sent and the LLM's
reply is the extraction, then normalised and compared as calculate_score.py does
(`mathvista_prediction`). Temperature 0, at most 1024 tokens, one user turn.

MathVerse (github:ZrrSkywalker/MathVerse@937b090597aeafb8e82b35d310a4bc5b9e2ea29d:
evaluation/extract_answer_s1.py, evaluation/score_answer_s2.py, prompts in evaluation/prompts.py):
step 1 extracts with its six demos (a leading "Extracted Answer: " dropped), step 2 asks whether
that extraction matches the standard answer of the raw question (five judged demos) and reads
"0" or "1". Temperature 0, at most 256 tokens. The official loop re-asks an unreadable judgement
forever; here it is asked again `parse_retries` times (`ChatClient.ask`) and then counts as wrong.

The prompt texts below are the benchmarks' own, character for character (tests pin their hashes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mmprm.chat import ChatClient
from mmprm.data.eval_sets.mathvista import mathvista_prediction

# fmt: off
MATHVISTA_DEMO_PROMPT = """
Please read the following example. Then extract the answer from the model response and type it at the end of the prompt.

Hint: Please answer the question requiring an integer answer and provide the final value, e.g., 1, 2, 3, at the end.
Question: Which number is missing?

Model response: The number missing in the sequence is 14.

Extracted answer: 14

Hint: Please answer the question requiring a floating-point number with one decimal place and provide the final value, e.g., 1.2, 1.3, 1.4, at the end.
Question: What is the fraction of females facing the camera?

Model response: The fraction of females facing the camera is 0.6, which means that six out of ten females in the group are facing the camera.

Extracted answer: 0.6

Hint: Please answer the question requiring a floating-point number with two decimal places and provide the final value, e.g., 1.23, 1.34, 1.45, at the end.
Question: How much money does Luca need to buy a sour apple candy and a butterscotch candy? (Unit: $)

Model response: Luca needs $1.45 to buy a sour apple candy and a butterscotch candy.

Extracted answer: 1.45

Hint: Please answer the question requiring a Python list as an answer and provide the final list, e.g., [1, 2, 3], [1.2, 1.3, 1.4], at the end.
Question: Between which two years does the line  graph saw its maximum peak?

Model response: The line graph saw its maximum peak between 2007 and 2008.

Extracted answer: [2007, 2008]

Hint: Please answer the question and provide the correct option letter, e.g., A, B, C, D, at the end.
Question: What fraction of the shape is blue?\nChoices:\n(A) 3/11\n(B) 8/11\n(C) 6/11\n(D) 3/5

Model response: The correct answer is (B) 8/11.

Extracted answer: B
"""

MATHVERSE_EXTRACT_PROMPT = """
I am providing you a response from a model to a math problem, termed 'Model Response'. You should extract the answer from the response as 'Extracted Answer'. Directly output the extracted answer with no explanation.

1.
Model response: 'Rounded to two decimal places, the perimeter of the sector is approximately:\n\n(-2, 1)'
Extracted Answer: (-2, 1)

2.
Model response: 'at those points.\n\nTherefore, the correct option that represents the meaning of the intersection points of the graphs is:\n\nD. They give the solutions to the equation $f(t)=g(t)$.",'
Extracted Answer: D

3.
Model response: ' at 1 (there's a closed circle at y = 1), the range in interval notation is \\((-4, 1]\\).\n\nFinal values:\nDomain: \\((-3, 3]\\)\nRange: \\((-4, 1]\\)'
Extracted Answer: Domain: \\((-3, 3]\\)\nRange: \\((-4, 1]\\)

4.
Model response: 'As it stands, I cannot provide the correct option letter because there isn't enough information to solve for 'y'.'
Extracted Answer: null

5.
Model response: 'Given that AB = 17.6 meters, we can now substitute into the equation:\n\nd = 17.6 / cos(38\u00b0)\n\nTherefore, to one decimal place, the distance d between Ned and Bart is approximately 22.3 meters.'
Extracted answer: 22.3

6.
Model response:  have all the coefficients for the quadratic function:\n\\( f(x) = ax^2 + bx + c \\)\n\\( f(x) = -1x^2 - 2x + 1 \\)\n\nTherefore, the equation for the graphed function \\( f \\) is:\n\\( f(x) = -x^2 - 2x + 1 \\)"'
Extracted answer: f(x) = -x^2 - 2x + 1

7.
"""

MATHVERSE_SCORE_PROMPT = """
Below are two answers to a math question. Question is [Question], [Standard Answer] is the standard answer to the question, and [Model_answer] is the answer extracted from a model's output to this question.  Determine whether these two answers are consistent.
Please note that only when the [Model_answer] completely matches the [Standard Answer] means they are consistent. For non-multiple-choice questions, if the meaning is expressed in the same way, it is also considered consistent, for example, 0.5m and 50cm.
If they are consistent, Judement is 1; if they are different, Judement is 0.

[Question]: Write the set of numbers represented on the number line in interval notation.
[Standard Answer]: (-2,1]
[Model_answer] : Extracted Answer: \\((-2, 1)\\)
Judgement: 0

[Question]: As shown in the figure, circle O has a radius 1.0, if angle BAC = 60.0, then the length of BC is ()\nChoices:\nA:2\nB:2\u221a{{3}}\nC:\u221a{{3}}\nD:2\u221a{{2}}
[Standard Answer]: C
[Model_answer] : B:2\u221a{{3}}
Judgement: 0

[Question]: Find the domain and range of the function f using interval notation.
[Standard Answer]: domain: [-4, 0) and range: (-3, 1]
[Model_answer] : Range: \\((-4, 1]\\)
Judgement: 0

[Question]: As shown in the figure, circle O has a radius 1.0, if angle BAC = 60.0, then the length of BC is ()\nChoices:\nA:2\nB:2\u221a{{3}}\nC:\u221a{{3}}\nD:2\u221a{{2}}
[Standard Answer]: C
[Model_answer] : null
Judgement: 0

[Question]: Given the graph of the ellipse that intersects with x-axis at 9 and -9 and with y-axis at 3 and -3, determine its equation.A. \\frac{{x^2}}{{81}} + \\frac{{y^2}}{{9}} = 1 B. Can not determine.\n
[Standard Answer]: A
[Model_answer] : \\frac{{x^2}}{{81}} + \\frac{{y^2}}{{9}} = 1
Judgement: 1

[Question]: {question}
[Standard Answer]: {gt}
[Model_answer] : {extraction}
Judgement: """
# fmt: on


@dataclass
class LLMVerdict:
    """One reply judged by a benchmark's LLM protocol.

    Attributes:
        correct: the benchmark's verdict.
        extraction: the answer the LLM (or MathVista's rules before it) extracted.
        judgement: MathVerse's step-2 reply ("0" / "1"), None where unreadable or not asked.
        requests: chat requests made for this reply (cache hits included).
    """

    correct: bool
    extraction: str
    judgement: str | None = None
    requests: int = 0


def mathvista_extract_prompt(query: str, response: str) -> str:
    """MathVista's `create_test_prompt`: the demos, the question's query and the model's response."""
    return f"{MATHVISTA_DEMO_PROMPT.strip()}\n\n{query}\n\n{response}\n\nExtracted answer: "


def mathverse_extract_prompt(response: str) -> str:
    """MathVerse's step-1 prompt (`extract_answer_s1.create_test_prompt`)."""
    return f"{MATHVERSE_EXTRACT_PROMPT.strip()}\n\nModel response: '{response}'\nExtracted Answer: "


def mathverse_score_prompt(question: str, answer: str, extraction: str) -> str:
    """MathVerse's step-2 prompt (`score_answer_s2.create_test_prompt`)."""
    return MATHVERSE_SCORE_PROMPT.strip().format(question=question, gt=answer, extraction=extraction)


def _get(problem: Any, key: str) -> Any:
    return problem.get(key) if isinstance(problem, dict) else getattr(problem, key, None)


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def _nonempty(text: str) -> str | None:
    # The official clients ask again while the reply is empty.
    return text.strip() or None


def mathvista_llm_correct(client: ChatClient, response: str, problem: Any) -> LLMVerdict:
    """MathVista's `extract_answer` (quick_extract off, its default), then its score."""
    meta = _get(problem, "meta") or {}
    choices = _get(problem, "choices") or []
    question_type, answer_type = meta["question_type"], meta["answer_type"]
    extraction, requests = None, 0
    if response == "":
        extraction = ""
    elif question_type == "multi_choice" and response in choices:
        extraction = response
    elif answer_type == "integer":
        try:
            extraction = str(int(response))
        except ValueError:
            pass
    elif answer_type == "float":
        try:
            extraction = str(float(response))
        except ValueError:
            pass
    if extraction is None:
        prompt = mathvista_extract_prompt(str(_get(problem, "question")), response)
        text, replies = client.ask(_user(prompt), _nonempty, max_tokens=1024)
        extraction, requests = text or "", len(replies)
    pred = mathvista_prediction(extraction, choices, question_type, answer_type, meta.get("precision"))
    return LLMVerdict(pred is not None and pred == str(_get(problem, "answer")), extraction, None, requests)


def _judgement(text: str) -> str | None:
    value = text.replace("Judgement:", "").strip()
    return value if value in ("0", "1") else None


def mathverse_llm_correct(client: ChatClient, response: str, problem: Any) -> LLMVerdict:
    """MathVerse's two steps: extract (extract_answer_s1.py), then judge (score_answer_s2.py)."""
    meta = _get(problem, "meta") or {}
    text, replies = client.ask(_user(mathverse_extract_prompt(response)), _nonempty, max_tokens=256)
    extraction = (text or "").replace("Extracted Answer: ", "").strip()
    # The judge sees the raw question (options included), not the CoT query the policy was asked.
    question = meta.get("question") or str(_get(problem, "question"))
    prompt = mathverse_score_prompt(question, str(_get(problem, "answer")), extraction)
    judgement, more = client.ask(_user(prompt), _judgement, max_tokens=256)
    return LLMVerdict(judgement == "1", extraction, judgement, len(replies) + len(more))


LLM_RULES: dict[str, Callable[[ChatClient, str, Any], LLMVerdict]] = {
    "mathvista": mathvista_llm_correct,
    "mathverse": mathverse_llm_correct,
}
"""Benchmark (`meta["source"]`) -> its authors' LLM extraction and verdict."""


def llm_answer_correct(client: ChatClient, response: str, problem: Any) -> LLMVerdict:
    """`response` (the model's whole reply) judged by the LLM protocol of `problem`'s benchmark.

    Raises:
        ValueError: the problem's benchmark has no LLM protocol here (named with its id).
    """
    source = (_get(problem, "meta") or {}).get("source")
    if source not in LLM_RULES:
        raise ValueError(
            f"id={_get(problem, 'id')}: extraction=llm follows {' and '.join(sorted(LLM_RULES))}'s own "
            f"protocols; this problem is from {source or 'no benchmark'}: use extraction=rules"
        )
    return LLM_RULES[source](client, response, problem)
