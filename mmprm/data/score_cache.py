"""A PRM scorer whose step scores persist, so that evaluations resume and reruns score nothing twice.

The evaluation recipes (prm_eval, tree_eval, reasoning_eval) can score for hours: a step-level
benchmark, or every path of thousands of annotation trees, with a 7B PRM. `CachedScorer` wraps the
PRM they load and appends each example's scores to an append-only file (`mmprm.data.store`: one
fsync'ed row per example, a torn last row dropped on resume). A killed run resumes where it stopped,
and a rerun that changes only what is done with the scores (a threshold, a metric, a slice of the
same rows) scores only the examples the file lacks, loading the PRM only if there is one.

    scorer = CachedScorer(out / "score_cache.jsonl", load, prm=prm_path, max_length=max_length)
    scorer.score(examples)   # -> one list of step scores per example, as the PRM's own `score`

Rows are keyed by what the PRM sees (question, steps, images), not by an id: the same example met
again under another id or split reuses its scores. The settings that change scores (which PRM, its
convention, the truncation length) are recorded beside the file, and a run with others is refused.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mmprm.data import store


def example_key(example: Any) -> str:
    """A digest of what a PRM scores in `example` (a `StepExample` or a dict with question, steps
    and images): its question, its steps and its images (paths, or an image's pixels)."""

    def get(name: str) -> Any:
        return example.get(name) if isinstance(example, Mapping) else getattr(example, name, None)

    digest = hashlib.sha256()
    digest.update(json.dumps([get("question") or "", list(get("steps") or [])], ensure_ascii=False).encode("utf-8"))
    for image in get("images") or []:
        if isinstance(image, (str, Path)):
            digest.update(b"\0path:" + str(image).encode("utf-8"))
        else:  # a PIL image: its pixels
            digest.update(f"\0pixels:{image.mode}:{image.size}:".encode() + image.tobytes())
    return digest.hexdigest()


class CachedScorer:
    """`score(examples)` as the wrapped PRM scorer's, each example scored once per cache file.

    Args:
        path: the append-only cache (JSONL rows `{"id": example_key, "scores": [...]}`).
        load: returns the PRM scorer (`mmprm.load_prm(...)`); called at the first example the cache
            lacks, never when it holds them all.
        prm, convention, max_length: what the scores depend on besides the example (the PRM's
            directory, its released convention, the truncation length `load` gives it); recorded in
            `<path stem>.run.json`, and a cache made with others is refused (ConfigError naming
            what changed).
    """

    def __init__(
        self,
        path: str | Path,
        load: Callable[[], Any],
        prm: str | Path,
        convention: str | None = None,
        max_length: int | None = None,
    ) -> None:
        self.path = Path(path)
        settings = {"prm": str(Path(prm).resolve()), "convention": convention, "max_length": max_length}
        store.check_same_run(self.path.with_suffix(".run.json"), settings, self.path)
        store.resume(self.path)  # a torn last row is cut off before this run appends
        self._scores = {row["id"]: row["scores"] for row in store.iter_rows(self.path)}
        self._load = load
        self._scorer: Any = None
        self._file: Any = None

    def __len__(self) -> int:
        return len(self._scores)

    def missing(self, examples: Sequence[Any]) -> list[Any]:
        """The examples whose scores the cache lacks (each distinct one once), in order."""
        todo: dict[str, Any] = {}
        for ex in examples:
            key = example_key(ex)
            if key not in self._scores:
                todo.setdefault(key, ex)
        return list(todo.values())

    def score(self, examples: Sequence[Any], progress: bool = False) -> list[list[float]]:
        """One list of step scores per example (NaN for steps the PRM's max_length cut), scoring
        only those the cache lacks, in one call of the PRM, and saving them before returning."""
        keys = [example_key(ex) for ex in examples]
        todo = {k: ex for k, ex in zip(keys, examples) if k not in self._scores}
        if todo:
            if self._scorer is None:
                self._scorer = self._load()
            if self._file is None:
                self._file = store.open_append(self.path)
            for key, scores in zip(todo, self._scorer.score(list(todo.values()), progress=progress)):
                store.append_row(self._file, {"id": key, "scores": scores})
                self._scores[key] = scores
        return [list(self._scores[k]) for k in keys]

    def close(self) -> None:
        """Close the cache file and the PRM (a vLLM engine stops here, not at the interpreter's exit)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._scorer is not None:
            self._scorer.close()
            self._scorer = None
