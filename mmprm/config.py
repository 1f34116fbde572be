"""Typed recipe configs: nested dataclasses filled from YAML plus dotted `key=value` overrides.

    cfg = load_config(PRMTrainConfig, "recipes/configs/tiny/prm_train.yaml", ["train.lr=1e-5"])

Unknown keys, wrong types and bad values fail before any work starts, naming the file and key.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override that cannot be applied; the message says where and how to fix it."""


def parse_cli(argv: list[str]) -> tuple[str | None, list[str]]:
    """Split `--config FILE key=value ...` into (config path, overrides)."""
    config_path, overrides = None, []
    it = iter(argv)
    for arg in it:
        if arg == "--config":
            config_path = next(it, None)
            if config_path is None:
                raise ConfigError("--config needs a file path")
        elif arg.startswith("--config="):
            config_path = arg.split("=", 1)[1]
        elif "=" in arg and not arg.startswith("-"):
            overrides.append(arg)
        else:
            raise ConfigError(f"unexpected argument {arg!r}: use --config FILE and key=value overrides")
    return config_path, overrides


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Build `cls` from a YAML file (optional) and dotted overrides (`train.lr=1e-5`)."""
    raw: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        try:
            loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{path}: config file not found") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping of keys to values")
        raw = loaded or {}
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: write it as key=value, e.g. train.lr=1e-5")
        _set_dotted(raw, key.strip(), yaml.safe_load(value) if value != "" else "")
    return _build(cls, raw, source, prefix="")


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict of a config dataclass (for logging and saving)."""
    return dataclasses.asdict(cfg)


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {key}: {part!r} is a value, not a section")
        node = nxt
    node[parts[-1]] = value


def _build(cls: type[T], raw: dict[str, Any], source: str, prefix: str) -> T:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {prefix.rstrip('.') or 'top level'}: expected a section (mapping)")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        known = ", ".join(prefix + name for name in fields)
        raise ConfigError(f"{source}: unknown key(s) {', '.join(prefix + u for u in unknown)} (known: {known})")
    kwargs = {}
    for name, value in raw.items():
        kwargs[name] = _coerce(hints[name], value, source, prefix + name)
    try:
        obj = cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{source}: {prefix.rstrip('.') or 'config'}: {e}") from None
    check = getattr(obj, "validate", None)
    if callable(check):
        try:
            check()
        except ValueError as e:
            raise ConfigError(f"{source}: {e}") from None
    return obj


def _coerce(tp: Any, value: Any, source: str, key: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value if value is not None else {}, source, key + ".")
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, source, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{source}: {key}: cannot be {value!r}")
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{source}: {key}: {value!r} is not one of {list(allowed)}")
        return value
    if origin in (list, tuple):
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{source}: {key}: expected a list, got {value!r}")
        items = [_coerce(item_tp, v, source, f"{key}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{source}: {key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{source}: {key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML reads 1e-5 as a string; accept it
            except ValueError:
                pass
        raise ConfigError(f"{source}: {key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{source}: {key}: expected a string, got {value!r}")
    return value
