"""Node scorers: each returns ``{node_id: score in [0, 1]}`` for the conclusion nodes of a tree.

Write the result onto the tree with `mmprm.treeval.set_scores(tree, scores)`.

* `constant_scores`: every conclusion gets one value (a baseline, and the all-correct check).
* `mc_scores`: the Monte-Carlo value an annotation tree carries per node (`meta["mc_value"]`).
* `prm_scores`: a PRM's step score of the node given the path of its ancestors. A causal PRM's score
  of step k only depends on steps 0..k, so one forward over a root-to-leaf path scores every node
  on it; all the paths of a tree go to the PRM in one `score` call.
* `JudgeScorer`: an LLM judge behind an OpenAI-compatible ``/chat/completions`` endpoint, yes/no
  or 0-1 graded (stdlib HTTP; the key comes from an environment variable).
"""

from __future__ import annotations

import base64
import json
import math
import mimetypes
import os
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, Sequence

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
            raise ValueError(f"node {n.id} has no mc_value: the MC scorer needs trees built with "
                             "from_annotation_tree from annotation output")
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
    examples = [{"question": tree.question, "images": list(tree.images),
                 "steps": [tree.nodes[nid].text for nid in path]} for path in kept]
    results = scorer.score(examples)
    if len(results) != len(kept):
        raise ValueError(f"PRM returned {len(results)} score lists for {len(kept)} paths")
    out = {}
    for nid, (k, pos) in where.items():
        if pos >= len(results[k]) or math.isnan(results[k][pos]):
            raise ValueError(f"node {nid}: the PRM scored {len(results[k])} of {len(kept[k])} steps on its path "
                             "(the input was truncated); raise the PRM's max_length")
        out[nid] = float(results[k][pos])
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

_NUMBER = re.compile(r"(?<![\d.])(?:0(?:\.\d+)?|1(?:\.0+)?|\.\d+)(?![\d.])")


def parse_verdict(reply: str, mode: Literal["binary", "graded"]) -> float | None:
    """Score from a judge's reply: yes/true -> 1.0, no/false -> 0.0 (binary), or a number in [0, 1]."""
    text = reply.strip().lower()
    if mode == "binary":
        m = re.match(r"\W*(yes|true|correct|no|false|incorrect)\b", text)
        if not m:
            return None
        return 1.0 if m.group(1) in ("yes", "true", "correct") else 0.0
    m = _NUMBER.search(text)
    return float(m.group()) if m else None


@dataclass
class JudgeScorer:
    """LLM judge over an OpenAI-compatible chat endpoint (vLLM serve, llama.cpp, a hosted API).

    url: base URL ending before ``/chat/completions`` (e.g. ``http://127.0.0.1:8000/v1``).
    api_key_env: environment variable holding the key; unset sends no Authorization header.
    mode: "binary" (yes/no verdicts) or "graded" (0-1 scores).
    send_images: attach the tree's images (as data URLs) for vision judges.
    """

    url: str
    model: str
    api_key_env: str = "OPENAI_API_KEY"
    mode: Literal["binary", "graded"] = "binary"
    timeout: float = 60.0
    max_retries: int = 3
    send_images: bool = False
    max_tokens: int = 16

    def prompt(self, tree: Tree, node_id: str, reference: str | None = None) -> str:
        path = node_paths(tree)[node_id]
        context = "\n".join(f"{i + 1}. {tree.nodes[p].text}" for i, p in enumerate(path[:-1])) or "(none)"
        evidence = [p for p in tree.nodes[node_id].parents if tree.nodes[p].kind == "evidence"]
        step = tree.nodes[node_id].text
        if evidence:
            step = "Using " + ", ".join(tree.nodes[p].label for p in evidence) + ": " + step
        template = JUDGE_BINARY if self.mode == "binary" else JUDGE_GRADED
        ref = f"Reference answer: {reference}\n" if reference else ""
        return template.format(question=tree.question, reference=ref, context=context, step=step)

    def _content(self, text: str, images: Sequence[str]) -> Any:
        if not self.send_images or not images:
            return text
        parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
        for p in images:
            mime = mimetypes.guess_type(p)[0] or "image/png"
            data = base64.b64encode(Path(p).read_bytes()).decode("ascii")
            parts.append({"type": "image_url", "image_url": {"url": f"data:{mime};base64,{data}"}})
        return parts

    def chat(self, text: str, images: Sequence[str] = ()) -> str:
        """One completion; retries transport errors with a short backoff."""
        body = json.dumps({
            "model": self.model, "temperature": 0, "max_tokens": self.max_tokens,
            "messages": [{"role": "system", "content": JUDGE_SYSTEM},
                         {"role": "user", "content": self._content(text, images)}],
        }).encode("utf-8")
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.api_key_env)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        url = self.url.rstrip("/") + "/chat/completions"
        for attempt in range(self.max_retries + 1):
            try:
                req = urllib.request.Request(url, data=body, headers=headers, method="POST")
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    return json.loads(resp.read())["choices"][0]["message"]["content"] or ""
            except (urllib.error.URLError, TimeoutError, KeyError, json.JSONDecodeError) as e:
                if attempt == self.max_retries:
                    raise RuntimeError(f"judge at {url} failed after {attempt + 1} tries: {e}; "
                                       "check judge.url, judge.model and the API key variable") from e
                time.sleep(0.5 * (attempt + 1))
        raise AssertionError("unreachable")

    def scores(self, tree: Tree, reference: str | None = None) -> dict[str, float]:
        """Judge every conclusion; a reply that cannot be read is asked again, then raises."""
        out = {}
        for n in tree.conclusions():
            text = self.prompt(tree, n.id, reference)
            for _ in range(self.max_retries + 1):
                reply = self.chat(text, tree.images)
                verdict = parse_verdict(reply, self.mode)
                if verdict is not None and 0.0 <= verdict <= 1.0:
                    out[n.id] = verdict
                    break
            else:
                raise RuntimeError(f"node {n.id}: judge reply {reply[:80]!r} is not a {self.mode} verdict")
        return out
