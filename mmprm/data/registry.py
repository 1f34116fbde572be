"""The table behind `mmprm.data.readers`: kind -> name -> reader, and the decorator that fills it.

Modules that hold readers import this module (not `mmprm.data.readers`, which imports them);
everyone else looks readers up through `mmprm.data.readers.get_reader`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Literal, TypeVar, get_args

ReaderKind = Literal["step_benchmark", "answer_benchmark", "tree_format", "candidates", "sft", "prm_data"]
KINDS: tuple[str, ...] = get_args(ReaderKind)

F = TypeVar("F", bound=Callable[..., Any])

_READERS: dict[str, dict[str, Callable[..., Any]]] = {kind: {} for kind in KINDS}
_ALIASES: dict[str, dict[str, str]] = {kind: {} for kind in KINDS}


class UnknownReaderError(ValueError):
    """No reader of that kind goes by that name."""


def _check_kind(kind: str) -> None:
    if kind not in _READERS:
        raise UnknownReaderError(f"unknown reader kind {kind!r}: the kinds are {', '.join(KINDS)}")


def register_reader(kind: ReaderKind, name: str) -> Callable[[F], F]:
    """Decorator: register the decorated function as the `kind` reader called `name`.

    Raises:
        ValueError: the kind is unknown, or another function already holds the name.
    """
    _check_kind(kind)

    def decorate(fn: F) -> F:
        held = _READERS[kind].get(name)
        if held is not None and held is not fn:
            raise ValueError(f"{kind} reader {name!r}: already registered ({held.__module__}.{held.__qualname__})")
        _READERS[kind][name] = fn
        return fn

    return decorate


def register_alias(kind: ReaderKind, old: str, new: str) -> None:
    """Keep `old` working as a deprecated name of the `kind` reader `new`; looking it up warns."""
    _check_kind(kind)
    _ALIASES[kind][old] = new


def registered_names(kind: ReaderKind) -> list[str]:
    """The names registered so far for `kind`, sorted (deprecated aliases left out)."""
    _check_kind(kind)
    return sorted(_READERS[kind])


def lookup(kind: ReaderKind, name: str) -> Callable[..., Any]:
    """The `kind` reader registered so far as `name`; a deprecated alias warns and gives its new name's.

    Raises:
        UnknownReaderError: no such kind, or no such name; the message lists the known names.
    """
    _check_kind(kind)
    if name in _ALIASES[kind]:
        new = _ALIASES[kind][name]
        warnings.warn(f"{kind} reader {name!r} is deprecated: use {new!r}", FutureWarning, stacklevel=3)
        name = new
    if name not in _READERS[kind]:
        known = ", ".join(registered_names(kind))
        raise UnknownReaderError(f"{kind} reader {name!r}: unknown; the known names are {known}")
    return _READERS[kind][name]
