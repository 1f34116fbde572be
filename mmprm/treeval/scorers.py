"""Node scorers: each returns ``{node_id: score in [0, 1]}`` for the conclusion nodes of a tree.

Write the result onto the tree with `mmprm.treeval.set_scores(tree, scores)`.

* `constant_scores`: every conclusion gets one value (a baseline, and the all-correct check).
* `mc_scores`: the Monte-Carlo value an annotation tree carries per node (`meta["mc_value"]`).
* `rollout_mc_scores`: Monte-Carlo values estimated now, by rolling a policy out from each node.
* `prm_scores`: a PRM's step score of the node given the path of its ancestors. A causal PRM's score
  of step k only depends on steps 0..k, so one forward over a root-to-leaf path scores every node
  on it; all the paths of a tree go to the PRM in one `score` call.
* `JudgeScorer`: an LLM judge behind an OpenAI-compatible endpoint (`mmprm.chat.ChatClient`),
  yes/no (Think360) or 0-1 graded; `mmprm.treeval.rpts_judge.RPTSJudge` is the RPTS protocol.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from mmprm.chat import ChatClient, ChatReply, messages_for
from mmprm.treeval.tree import Tree


class StepScorer(Protocol):
    """What `prm_scores` needs: `mmprm.models.prm.PRMScorer` (from `mmprm.load_prm`) or any object
    whose `score` returns one probability per step per example (NaN for steps cut by truncation)."""

    def score(self, examples: Sequence[Any]) -> list[list[float]]: ...


def constant_scores(tree: Tree, value: float = 1.0) -> dict[str, float]:
    """`value` for every conclusion node."""
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"constant score {value} is outside [0, 1]")
    return {n.id: float(value) for n in tree.conclusions()}


def mc_scores(tree: Tree) -> dict[str, float]:
    """Each conclusion's Monte-Carlo value from its annotation (`node.meta["mc_value"]`)."""
    out = {}
    for n in tree.conclusions():
        v = n.meta.get("mc_value")
        if v is None:
            raise ValueError(
                f"node {n.id} has no mc_value: the MC scorer needs trees built with "
                "from_annotation_tree from annotation output"
            )
        out[n.id] = float(v)
    return out


def node_paths(tree: Tree) -> dict[str, list[str]]:
    """Path a scorer shows for each conclusion: its conclusion ancestors in order, then itself."""
    return {n.id: tree.ancestors(n.id, kind="conclusion") + [n.id] for n in tree.conclusions()}


def covering_paths(paths: dict[str, list[str]]) -> tuple[list[list[str]], dict[str, tuple[int, int]]]:
    """Fewest paths such that each node's path is a prefix of one of them.

    Returns (paths to score, {node_id: (path index, position of the node in it)}). For a tree these
    are its root-to-leaf paths; a chain is one path.
    """
    kept: list[list[str]] = []
    where: dict[str, tuple[int, int]] = {}
    for nid, path in sorted(paths.items(), key=lambda kv: -len(kv[1])):
        for k, longer in enumerate(kept):
            if longer[: len(path)] == path:
                where[nid] = (k, len(path) - 1)
                break
        else:
            kept.append(path)
            where[nid] = (len(kept) - 1, len(path) - 1)
    return kept, where


def prm_scores(tree: Tree, scorer: StepScorer) -> dict[str, float]:
    """Score every conclusion with a PRM: its step score given its ancestors' steps before it.

    One `scorer.score` call per tree, one example per covering path::

        {"question": tree.question, "images": tree.images, "steps": [ancestor texts..., node text]}

    The paths share the question and images, so `PRMScorer` encodes the prompt once for all of them.
    """
    paths = node_paths(tree)
    if not paths:
        return {}
    kept, where = covering_paths(paths)
    examples = [
        {"question": tree.question, "images": list(tree.images), "steps": [tree.nodes[nid].text for nid in path]}
        for path in kept
    ]
    results = scorer.score(examples)
    if len(results) != len(kept):
        raise ValueError(f"PRM returned {len(results)} score lists for {len(kept)} paths")
    out = {}
    for nid, (k, pos) in where.items():
        if pos >= len(results[k]) or math.isnan(results[k][pos]):
            raise ValueError(
                f"node {nid}: the PRM scored {len(results[k])} of {len(kept[k])} steps on its path "
                "(the input was truncated); raise the PRM's max_length"
            )
        out[nid] = float(results[k][pos])
    return out


def rollout_mc_scores(
    tree: Tree, backend: Any, verify: Callable[[str], bool], k: int = 8, problem_id: str = ""
) -> dict[str, float]:
    """Monte-Carlo value of every conclusion: the share of `k` rollouts from its path that end right.

    The policy (`backend`, any `mmprm.generation.RolloutBackend`) continues the path of each
    node (its conclusion ancestors, then the node) `k` times, all nodes of the tree in one
    `generate` call; `verify(path text + continuation)` says whether a rollout reaches the right
    answer. This is the value OmegaPRM annotates, for a tree the policy did not write itself.
    """
    from mmprm.generation.base import RolloutRequest

    paths = node_paths(tree)
    if not paths:
        return {}
    ids = list(paths)
    requests = [
        RolloutRequest(
            problem_id or str(tree.meta.get("id", "")),
            tree.question,
            list(tree.images),
            [tree.nodes[p].text for p in paths[nid]],
            k,
        )
        for nid in ids
    ]
    rollouts = backend.generate(requests)
    out = {}
    for nid, req, texts in zip(ids, requests, rollouts):
        prefix = "\n\n".join(req.prefix_steps)
        out[nid] = sum(bool(verify(prefix + "\n\n" + t)) for t in texts) / len(texts)
    return out


# Our own wording of the two judge styles the papers use: Think360 asks for a true/false verdict on
# a step given the steps before it; RPTS asks how well the conclusion follows, on a 0-1 scale.
JUDGE_SYSTEM = "You check reasoning one step at a time. Be strict about facts, arithmetic and logic."

JUDGE_BINARY = """Problem:
{question}
{reference}
Steps already taken (context only, do not judge them):
{context}

Step to check:
{step}

Is this step correct - true to the problem and the images, and validly following from the steps
before it? Reply with one word: yes or no."""

# Think360 checks the last step against the reference answer as well as for its logic.
FINAL_STEP_NOTE = "\n(This is the final step: it is correct only if its answer agrees with the reference answer.)"

JUDGE_GRADED = """Problem:
{question}
{reference}
Steps already taken (context only, do not judge them):
{context}

Step to check:
{step}

Rate how well this step holds: 1.0 means it is certain from the problem, the images and the steps
before it; 0.5 means the link is weak; 0.0 means it is wrong or contradicts them. Use steps of 0.1.
Reply with the number only."""

_THINK = re.compile(r"<think>.*?(?:</think>|$)", re.S)
_NUMBER = re.compile(r"(?<![\d.])(?:0(?:\.\d+)?|1(?:\.0+)?|\.\d+)(?![\d.])")


def parse_verdict(reply: str, mode: Literal["binary", "graded"]) -> float | None:
    """Score from a judge's reply: yes/true -> 1.0, no/false -> 0.0 (binary), or a number in [0, 1].

    A reasoning model's ``<think>...</think>`` block is skipped: the verdict is what follows it.
    """
    text = _THINK.sub("", reply).strip().lower()
    if mode == "binary":
        m = re.match(r"\W*(yes|true|correct|no|false|incorrect)\b", text)
        if not m:
            return None
        return 1.0 if m.group(1) in ("yes", "true", "correct") else 0.0
    m = _NUMBER.search(text)
    return float(m.group()) if m else None


def final_step(tree: Tree) -> str | None:
    """The step that states the answer: the root if set, else (Think360) the last of the deepest steps."""
    if tree.root is not None:
        return tree.root
    depths = tree.depths()
    deepest = max(depths.values(), default=0)
    return next((nid for nid in reversed(list(tree.nodes)) if depths.get(nid) == deepest), None)


@dataclass
class JudgedTree:
    """What a judge made of one tree.

    scores: {node_id: score} of the nodes it could score.
    unparsed: nodes whose replies held no verdict even after the retries (the tree is then not
        fully scored; callers count it and leave it out of the averages).
    corrected: RPTS nodes that went through the correction pass.
    details: one dict per node (prompt kind, first/second score, ...) for the trees file.
    replies: every reply, for token counts.
    """

    scores: dict[str, float] = field(default_factory=dict)
    unparsed: list[str] = field(default_factory=list)
    corrected: list[str] = field(default_factory=list)
    details: list[dict[str, Any]] = field(default_factory=list)
    replies: list[ChatReply] = field(default_factory=list)

    @property
    def tokens(self) -> dict[str, int]:
        return {
            "prompt": sum(r.prompt_tokens for r in self.replies),
            "completion": sum(r.completion_tokens for r in self.replies),
        }


class JudgeScorer:
    """Step-by-step LLM judge (Think360 style) over `mmprm.chat.ChatClient`.

    Each conclusion is shown with the problem, the reference answer and the steps it rests on;
    the final step is also checked against the reference answer.

    Args:
        client: the judge endpoint.
        mode: "binary" (yes/no, Think360) or "graded" (a 0-1 number).
        send_images: attach the tree's images (data URLs) for vision judges.
        parse_retries: extra asks when a reply holds no verdict.
    """

    def __init__(
        self,
        client: ChatClient,
        mode: Literal["binary", "graded"] = "binary",
        send_images: bool = False,
        parse_retries: int = 2,
    ):
        self.client = client
        self.mode = mode
        self.send_images = send_images
        self.parse_retries = parse_retries

    def prompt(self, tree: Tree, node_id: str, reference: str | None = None) -> str:
        path = node_paths(tree)[node_id]
        context = "\n".join(f"{i + 1}. {tree.nodes[p].text}" for i, p in enumerate(path[:-1])) or "(none)"
        evidence = [p for p in tree.nodes[node_id].parents if tree.nodes[p].kind == "evidence"]
        step = tree.nodes[node_id].text
        if evidence:
            step = "Using " + ", ".join(tree.nodes[p].label for p in evidence) + ": " + step
        template = JUDGE_BINARY if self.mode == "binary" else JUDGE_GRADED
        ref = f"Reference answer: {reference}\n" if reference else ""
        if reference and node_id == final_step(tree):
            step += FINAL_STEP_NOTE
        return template.format(question=tree.question, reference=ref, context=context, step=step)

    def judge(self, tree: Tree, reference: str | None = None) -> JudgedTree:
        """Judge every conclusion; a reply without a verdict is asked again, then reported unparsed."""
        out = JudgedTree()
        images = tree.images if self.send_images else ()
        for n in tree.conclusions():
            messages = messages_for(self.prompt(tree, n.id, reference), system=JUDGE_SYSTEM, images=images)
            verdict, replies = self.client.ask(
                messages, lambda t: parse_verdict(t, self.mode), self.parse_retries, max_tokens=16
            )
            out.replies.extend(replies)
            out.details.append({"node": n.id, "kind": self.mode, "reply": replies[-1].text[:200], "score": verdict})
            if verdict is None:
                out.unparsed.append(n.id)
            else:
                out.scores[n.id] = verdict
        return out
