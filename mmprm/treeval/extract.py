"""From a model's free answer to a tree: Think360 extraction by an LLM, or RPTS premise lines.

* Think360 (ToT-Eval): an extractor LLM copies the key steps of the answer verbatim into node
  blocks ``[NODE:d.s] [PARENT:id|None] [ORIGINAL:text] [TYPE:kind]``: a child depends on its parent
  (the next step of that line of thought), siblings are alternatives tried at the same point.
  `extract_think360` asks, parses with `from_think360_blocks`, and asks again while the tree is
  invalid (`think360_valid`); after the retries it returns the last tree marked invalid, which the
  caller counts and leaves out of the width/depth averages, as the reference does.
* RPTS: the model under test is asked to write its reasoning as ``Image0 + Text1 -> Conclusion0:
  ...`` lines (`RPTS_ANSWER_PROMPT`); `rpts_lines` reads those lines out of the answer and
  `rpts_verdict` its agree/disagree answer.

The prompts are ours; the formats are the papers'.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mmprm.chat import ChatClient, ChatReply, messages_for
from mmprm.treeval.builders import from_think360_blocks
from mmprm.treeval.tree import Tree

THINK360_SYSTEM = """You turn a worked solution into a tree of its key reasoning steps.

Rules:
1. Copy, do not write. Every node's text is taken word for word from the solution.
2. Keep only steps that matter: computations, deductions, observations the solution relies on,
   checks, and the final answer. Skip restatements and lists of options. A computation or an
   algebraic rewrite stays in one node, however many "=" it has.
3. Structure. A node's parent is the step it builds on directly. Steps the solution tries side by
   side from the same point (two cases, two methods, a check next to the main line) are siblings:
   children of the same parent. The first steps have no parent.
4. Ids are depth.sequence: depth 1 for steps with no parent, and a child's depth is its parent's
   depth plus one; the sequence numbers the nodes of one depth from 1.
5. If the solution is only a final answer, output one node with that answer.

Output only node blocks, one field per line:
[NODE:depth.sequence]
[PARENT:None or the parent's id]
[ORIGINAL:the copied text]
[TYPE:observation | calculation | deduction | exploration | verification | conclusion | other]"""

THINK360_USER = """Problem:
{question}

Reference answer: {reference}

Solution to turn into a tree (copy its words, do not rewrite them):
{response}

Example of the output for a solution that first reads the figure, then tries two cases and
concludes from the first:
[NODE:1.1]
[PARENT:None]
[ORIGINAL:The triangle has sides 3 and 4 with a right angle between them.]
[TYPE:observation]
[NODE:2.1]
[PARENT:1.1]
[ORIGINAL:If the third side is the hypotenuse, it is sqrt(9 + 16) = 5.]
[TYPE:calculation]
[NODE:2.2]
[PARENT:1.1]
[ORIGINAL:If 4 were the hypotenuse, the third side would be sqrt(16 - 9) = sqrt(7).]
[TYPE:exploration]
[NODE:3.1]
[PARENT:2.1]
[ORIGINAL:The right angle is between 3 and 4, so the answer is 5.]
[TYPE:conclusion]

Now the tree of the solution above. Check that every parent is one depth above its child."""


def think360_valid(tree: Tree) -> tuple[bool, str]:
    """(valid, reason) as the Think360 reference decides whether a tree enters width/depth averages.

    Invalid: no nodes, an id that is not ``depth.sequence``, a duplicate id, a parent that is not a
    node, a cycle (see `from_think360_blocks`). Trees of other builders have no such record: valid.
    """
    errors = tree.meta.get("structure_errors") or []
    return (not errors, "; ".join(errors) if errors else "")


@dataclass
class Extraction:
    """The outcome of extracting one tree: the tree (last attempt), validity, and what it cost."""

    tree: Tree
    valid: bool
    reason: str = ""
    attempts: int = 0
    replies: list[ChatReply] = field(default_factory=list)

    @property
    def tokens(self) -> dict[str, int]:
        return {
            "prompt": sum(r.prompt_tokens for r in self.replies),
            "completion": sum(r.completion_tokens for r in self.replies),
        }


def extract_think360(
    client: ChatClient,
    question: str,
    response: str,
    reference: str | None = None,
    images: Sequence[str] = (),
    send_images: bool = False,
    retries: int = 2,
    retry_temperature: float = 0.7,
    source: str = "",
) -> Extraction:
    """Ask `client` for the Think360 tree of `response`; retry while it is invalid.

    The first ask is greedy; retries sample at `retry_temperature` with a new seed (see
    `ChatClient.ask`). Returns the first valid tree, else the last one with ``valid=False``.
    """
    user = THINK360_USER.format(question=question, reference=reference or "(not given)", response=response)
    messages = messages_for(user, system=THINK360_SYSTEM, images=images if send_images else ())
    trees: list[Tree] = []

    def parse(text: str) -> Tree | None:
        tree = from_think360_blocks(text, question=question, images=images, source=source)
        trees.append(tree)
        return tree if think360_valid(tree)[0] else None

    tree, replies = client.ask(messages, parse, parse_retries=retries, retry_temperature=retry_temperature)
    if tree is not None:
        return Extraction(tree, True, "", len(replies), replies)
    last = trees[-1]
    return Extraction(last, False, think360_valid(last)[1], len(replies), replies)


# ---------------------------------------------------------------- RPTS: the model writes premise lines

RPTS_ANSWER_PROMPT = """{context}
Images: {images}
Text clues:
{clues}
Statement: {statement}

Decide whether the images and text clues agree or disagree with the statement. Reason in numbered
steps, one per line, each naming exactly what it uses: ImageK for the K-th image, TextK for the
K-th text clue, ConclusionK for your own K-th step, Context for the context (all counted from 0).
Write every line as

Image0 + Text1 -> Conclusion0: what follows from them
Conclusion0 + Text2 -> Conclusion1: what follows next

A step drawn from one image alone describes what the image shows. The last line states whether the
clues agree or disagree with the statement."""


def rpts_answer_prompt(record: Mapping[str, Any]) -> str:
    """The question the model under test answers for one RPTS-Eval record."""
    clues = "\n".join(f"Text{k}: {c}" for k, c in enumerate(record.get("textual_clue", []))) or "(none)"
    n = len(record.get("visual_clue", []))
    images = ", ".join(f"Image{k}" for k in range(n)) + " (shown above)" if n else "(none)"
    context = f"Context: {record['context']}" if record.get("context") else ""
    return RPTS_ANSWER_PROMPT.format(
        context=context, images=images, clues=clues, statement=record.get("statement", "")
    ).strip()


_FENCE = re.compile(r"^\s*```")
_BULLET = re.compile(r"^\s*(?:[-*•]|\d+[.)])\s+")


def rpts_lines(text: str) -> list[str]:
    """The ``premises -> conclusion`` lines of an answer; a line without an arrow continues the last one.

    Code fences, bullets and leading numbering are dropped; text before the first arrow line (a
    preamble) is ignored. An empty list means the answer has no RPTS steps (unparseable).
    """
    lines: list[str] = []
    for raw in text.splitlines():
        if _FENCE.match(raw) or not raw.strip():
            continue
        line = _BULLET.sub("", raw.strip()).replace("→", "->").replace("=>", "->")
        if "->" in line:
            lines.append(line)
        elif lines:
            lines[-1] += " " + line
    return lines


_DISAGREE = re.compile(r"\b(?:disagrees?|contradicts?|refutes?|opposes?)\b|矛盾|反对", re.I)
_AGREE = re.compile(r"\b(?:agrees?|supports?)\b|支持", re.I)


def rpts_verdict(text: str) -> str | None:
    """ "agree", "disagree" or None: the last verdict word in the final step, else in the whole answer."""
    steps = rpts_lines(text)
    for part in ([steps[-1]] if steps else []) + [text]:
        hits = [(m.start(), "disagree") for m in _DISAGREE.finditer(part)]
        hits += [(m.start(), "agree") for m in _AGREE.finditer(part)]
        if hits:
            return max(hits)[1]
    return None
