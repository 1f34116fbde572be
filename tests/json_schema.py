"""Schema comparison of JSON records from two runs (the vLLM tier: vLLM vs HF outputs)."""

from __future__ import annotations

from typing import Any


def key_paths(value: Any, path: str = "") -> set[str]:
    """Every key path of a JSON value: `a.b` for keys, `a[]` for a non-empty list, `a[].b` inside it."""
    if isinstance(value, dict):
        return {p for k, v in value.items() for p in {path + k} | key_paths(v, path + k + ".")}
    if isinstance(value, list) and value:
        items = path.rstrip(".") + "[]"
        return {items} | {p for v in value for p in key_paths(v, items + ".")}
    return set()


def schema_differences(a: Any, b: Any) -> list[str]:
    """Key paths found on one side only, except those under a list the other side has no items of
    (a search that found no first error has an empty `first_errors`: no schema difference)."""
    pa, pb = key_paths(a), key_paths(b)

    def under_empty_list(p: str, other: set[str]) -> bool:
        parts = p.split(".")
        return any((q := ".".join(parts[:i])).endswith("[]") and q not in other for i in range(1, len(parts) + 1))

    return sorted(p for p in pa ^ pb if not under_empty_list(p, pb if p in pa else pa))
