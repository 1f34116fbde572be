"""The RPTS step judge: how well each conclusion of a premise tree holds, on a 0-1 scale.

Protocol (Wang et al., AAAI 2026, reference code wang-hao-feng/RPTS `evaluate/score_reasoning.py`),
in our own prompts:

1. **Image conclusions.** A step whose only premise is an image (``Image0 -> Conclusion0: ...``)
   says what the image shows. It is compared with the reference descriptions of that image: the
   conclusions the benchmark's gold reasoning draws from it (`image_facts`). No reference
   description -> 1.0 (nothing to compare with, as the reference); an image index past the
   record's images -> 0.0.
2. **Inferences.** Any other step is judged for the link from its premises (clue texts, earlier
   conclusions, the context; an image premise stands for its reference descriptions) to its
   conclusion.
3. **Correction pass.** An inference scoring below `correction_below` (0.5) is judged again with
   all text clues and all earlier conclusions added to its premises (the model may have cited the
   wrong ones). The re-judged score carries a penalty:
   ``final = max(first, round(penalty * second, 1))`` with penalty 0.8 (`corrected_score`).

Both the image comparison and the correction pass can be switched off (`RPTSJudgeConfig`).
Differences from the reference, on purpose: a reply is read as the first number in [0, 1] (the
reference needs a decimal point and crashes on "1"); an unreadable reply is asked again and, if
still unreadable, the node is reported unscored instead of crashing the run; the reference
descriptions of an image are listed once each plus, when there are several, all of them joined
(the reference lists every partial join, with repeats).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mmprm.chat import ChatClient, ChatReply, messages_for
from mmprm.treeval.scorers import JudgedTree, parse_verdict
from mmprm.treeval.tree import Tree

RPTS_SYSTEM = "You grade single reasoning steps. Reply with one number from 0.0 to 1.0 and nothing else."

IMAGE_PROMPT = """Below are reference descriptions of an image and a sentence someone wrote about the same image.
Rate how well the sentence agrees with the reference descriptions, from 0.0 to 1.0 in steps of 0.1:
1.0 it says what one of them says (a paraphrase is fine); 0.7-0.9 it agrees with small differences
in detail or emphasis; 0.5-0.6 it agrees only in part or loosely; 0.1-0.4 it misreads or mostly
disagrees; 0.0 it states the opposite of a description.

Reference descriptions:
{facts}

Sentence:
{sentence}

Score:"""

INFERENCE_PROMPT = """Below is a reasoning step: a context, the premises it uses, and the conclusion it draws.
Rate how validly the conclusion follows from the premises in this context, from 0.0 to 1.0 in steps
of 0.1: 1.0 it follows necessarily; 0.8-0.9 it follows with a small, safe leap; 0.6-0.7 it is
plausible but rests on an assumption; 0.5 the link is weak; below 0.5 the link is broken,
speculative or unrelated; 0.0 the premises contradict it.

Context:
{context}

Premises:
{premises}

Conclusion:
{conclusion}

Score:"""


@dataclass
class RPTSJudgeConfig:
    """Switches of the RPTS protocol (see the module docstring).

    Attributes:
        compare_images: judge image-only steps against the reference descriptions of the image
        correction: re-judge low inferences with every text clue and earlier conclusion as premises
        correction_below: a first score under this triggers the correction pass
        penalty: multiplies the re-judged score (kept: max(first, round(penalty * second, 1)))
        parse_retries: extra asks for a reply that holds no score
    """

    compare_images: bool = True
    correction: bool = True
    correction_below: float = 0.5
    penalty: float = 0.8
    parse_retries: int = 2

    def validate(self) -> None:
        if not 0.0 <= self.penalty <= 1.0 or not 0.0 <= self.correction_below <= 1.0:
            raise ValueError("rpts judge: penalty and correction_below must be in [0, 1]")


def corrected_score(first: float, second: float, penalty: float = 0.8) -> float:
    """Score after the correction pass: ``max(first, round(penalty * second, 1))``.

    Python's `round` (ties to even, on the float), as the reference. Examples: first 0.3, second
    0.9 -> round(0.72, 1) = 0.7 -> 0.7; first 0.4, second 0.4 -> 0.3 -> 0.4.
    """
    return max(first, round(second * penalty, 1))


_IMAGE = re.compile(r"image|图", re.I)
_INT = re.compile(r"\d+")


def image_facts(gold_reasoning: Sequence[str], num_images: int) -> list[list[str]]:
    """Reference descriptions per image: the conclusions of gold lines that cite that image.

    ``["Image0 -> A red car.", "Image0 + Text1 -> It is parked."]`` -> ``[["A red car.", "It is parked."]]``.
    """
    facts: list[list[str]] = [[] for _ in range(num_images)]
    for line in gold_reasoning:
        antecedent, arrow, consequent = line.partition("->")
        if not arrow:
            continue
        text = re.sub(r"^\s*(?:conclusion|结论)\s*\d+\s*[:：]\s*", "", consequent, flags=re.I).strip()
        for tok in antecedent.split("+"):
            m = _INT.search(tok)
            if _IMAGE.search(tok) and m and int(m.group()) < num_images and text not in facts[int(m.group())]:
                facts[int(m.group())].append(text)
    return facts


class RPTSJudge:
    """Scores the conclusions of an RPTS tree with an LLM judge behind `client` (module docstring).

    `judge(tree, record)` needs the RPTS-Eval record the tree answers (clues, context, gold
    reasoning for the image descriptions); the tree comes from `from_rpts_lines` over the model's
    lines with the record's clues, so node "T3" is ``textual_clue[3]`` and "C2" the model's line 2.
    """

    def __init__(self, client: ChatClient, config: RPTSJudgeConfig | None = None):
        self.client = client
        self.config = config or RPTSJudgeConfig()
        self.config.validate()

    def _score(self, prompt: str, replies: list[ChatReply]) -> float | None:
        value, got = self.client.ask(
            messages_for(prompt, system=RPTS_SYSTEM),
            lambda t: parse_verdict(t, "graded"),
            self.config.parse_retries,
            max_tokens=8,
        )
        replies.extend(got)
        return value

    def judge(self, tree: Tree, record: Mapping[str, Any]) -> JudgedTree:
        clues = list(record.get("textual_clue", []))
        facts = image_facts(record.get("reasoning", []), len(record.get("visual_clue", [])))
        context = record.get("context") or "(none)"
        out = JudgedTree()
        earlier: list[str] = []  # texts of the conclusions before the current one
        for node in tree.conclusions():
            premises = [tree.nodes[p] for p in node.parents]
            detail: dict[str, Any] = {"node": node.id}
            only = premises[0] if len(premises) == 1 else None
            is_image_step = only is not None and (
                only.meta.get("image") is not None
                or (only.meta.get("missing") and _IMAGE.search(only.meta.get("token", "")))
            )
            if self.config.compare_images and is_image_step:
                detail["kind"] = "image"
                k = only.meta.get("image")
                if k is None:  # an image index past the record's images
                    score: float | None = 0.0
                elif not facts[k]:
                    score = 1.0
                else:
                    listed = facts[k] + (["; ".join(facts[k])] if len(facts[k]) > 1 else [])
                    score = self._score(IMAGE_PROMPT.format(facts="\n".join(listed), sentence=node.text), out.replies)
                detail["first"] = score
            else:
                detail["kind"] = "inference"
                texts: list[str] = []
                for p in premises:
                    if p.meta.get("missing"):
                        continue  # nothing to show for a premise that does not exist
                    if p.meta.get("image") is not None:
                        texts += facts[p.meta["image"]] or [f"(Image{p.meta['image']}, no reference description)"]
                    else:
                        texts.append(p.text)
                prompt = INFERENCE_PROMPT.format(
                    context=context, premises="\n".join(texts) or "(none)", conclusion=node.text
                )
                score = first = self._score(prompt, out.replies)
                detail["first"] = first
                if first is not None and self.config.correction and first < self.config.correction_below:
                    wider = texts + [c for c in clues if c not in texts] + [c for c in earlier if c not in texts]
                    second = self._score(
                        INFERENCE_PROMPT.format(context=context, premises="\n".join(wider), conclusion=node.text),
                        out.replies,
                    )
                    detail["second"] = second
                    # an unreadable second reply leaves the node unscored, not silently uncorrected
                    score = None if second is None else corrected_score(first, second, self.config.penalty)
                    out.corrected.append(node.id)
            detail["score"] = score
            out.details.append(detail)
            if score is None:
                out.unparsed.append(node.id)
            else:
                out.scores[node.id] = float(score)
            earlier.append(node.text)
        return out
