"""The one place to look up a data reader: kind -> name -> reader.

Recipes pick a reader by name (`data.format=processbench`) and call what `get_reader` returns; no
recipe switches on a format. Readers stay implemented where they belong and register themselves
with `register_reader` (`mmprm.data.registry`); `get_reader` imports the built-in ones first. The
kinds, each with the call its readers answer:

    step_benchmark    (path, check_images=True) -> list[StepExample]     labelled steps (prm_eval)
    answer_benchmark  (source, **options) -> list[problems row]           problems with a gold answer
                      ({id, question, images, answer, choices, meta}; `solution`: its reasoning, if any)
    tree_format       (path, image_dir=None, response_field="response") -> Iterator[tree item]
                      ({"id", "tree", "correct", "reference", "where"}; tree_eval)
    candidates        (path) -> list[mmprm.rerank.candidates.ProblemWithCandidates]     Best-of-N candidates (bon_rerank)
    sft               (path) -> list[StepExample]                         policy SFT rows
    prm_data          (path, **options) -> Converted                      PRM training data in another
                      project's format (`mmprm.data.convert.convert_file`'s options; `mmprm convert`)

A reader of your own (docs/extending.md)::

    from mmprm.data.readers import get_reader, register_reader

    @register_reader("candidates", "my_bon")
    def read_my_bon(path):
        ...

    get_reader("candidates", "my_bon")  # what bon_rerank's candidates_reader=my_bon calls
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mmprm.data.registry import (
    KINDS,
    ReaderKind,
    UnknownReaderError,
    lookup,
    register_alias,
    register_reader,
    registered_names,
)

_loaded = False


def _load_builtins() -> None:
    """Import the modules whose readers register on import, whichever the caller imported already."""
    global _loaded
    if _loaded:
        return
    import mmprm.data.benchmarks  # noqa: F401
    import mmprm.data.convert  # noqa: F401
    import mmprm.data.eval_sets  # noqa: F401
    import mmprm.data.sft  # noqa: F401
    import mmprm.rerank.candidates  # noqa: F401
    import mmprm.treeval.readers  # noqa: F401

    _loaded = True


def reader_names(kind: ReaderKind) -> list[str]:
    """The names registered for `kind`, sorted (deprecated aliases left out)."""
    _load_builtins()
    return registered_names(kind)


def get_reader(kind: ReaderKind, name: str) -> Callable[..., Any]:
    """The `kind` reader registered as `name` (a deprecated alias warns and gives its new name's).

    Raises:
        UnknownReaderError: no such kind, or no such name; the message lists the known names.
    """
    _load_builtins()
    return lookup(kind, name)


__all__ = [
    "KINDS",
    "ReaderKind",
    "UnknownReaderError",
    "get_reader",
    "reader_names",
    "register_alias",
    "register_reader",
]
