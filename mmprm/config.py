"""Typed recipe configs: nested dataclasses filled from YAML plus dotted `key=value` overrides.

    cfg = load_config(PRMTrainConfig, "recipes/configs/tiny/prm_train.yaml", ["train.lr=1e-5"])

Unknown keys, wrong types and bad values fail before any work starts, naming the file and key.
A key that moved is still read for one release, with a warning naming its new place: a config
class lists its moves in a `RENAMED_KEYS` class attribute (`{"old.dotted": "new.dotted"}`).
Each config dataclass documents its fields in a Google-style `Attributes:` section of its
docstring; `--help` on any recipe prints every dotted key with its type, default and that line.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
import sys
import types
import typing
import warnings
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override that cannot be applied; the message says where and how to fix it."""


def parse_cli(argv: list[str], config_cls: type | None = None) -> tuple[str | None, list[str]]:
    """Split `--config FILE key=value ...` into (config path, overrides).

    `-h` / `--help` prints the recipe's docstring and every key of CONFIG_CLS (`config_help`),
    then exits 0.
    """
    if config_cls is not None and any(a in ("-h", "--help") for a in argv):
        try:
            print(config_help(config_cls), flush=True)
        except BrokenPipeError:  # `--help | head` closed the pipe: not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so exit's flush cannot fail again
        raise SystemExit(0)
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
            hint = ", or --help to list every key" if config_cls is not None else ""
            raise ConfigError(f"unexpected argument {arg!r}: use --config FILE and key=value overrides{hint}")
    return config_path, overrides


def config_help(cls: type) -> str:
    """The recipe's docstring, then one entry per dotted key: `key: type = default` and its help line."""
    module = sys.modules.get(cls.__module__)
    script = getattr(module, "__file__", None)
    if script:
        try:
            script = os.path.relpath(script)
        except ValueError:  # another drive (Windows)
            pass
    lines = [f"usage: python {script or 'RECIPE'} --config FILE [key=value ...] [--help]", ""]
    if module is not None and module.__doc__:
        lines += [module.__doc__.strip(), ""]
    lines.append("Config keys (YAML sections, or dotted key=value overrides after --config):")
    lines += _help_lines(cls, prefix="")
    return "\n".join(lines)


def field_help(cls: type) -> dict[str, str]:
    """Field name -> its entry in the `Attributes:` section of CLS's docstring, on one line.

    A subclass's section adds to (and overrides) its bases', so a config that extends a shared
    section (e.g. `mmprm.chat.ChatConfig`) documents only its own fields.
    """
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is not object and klass.__doc__:
            out.update(_attributes_section(inspect.cleandoc(klass.__doc__)))
    return out


def _attributes_section(doc: str) -> dict[str, str]:
    out: dict[str, str] = {}
    current, inside = None, False
    for line in doc.splitlines():
        if line.strip() == "Attributes:":
            inside = True
            continue
        if not inside:
            continue
        if line and not line.startswith(" "):  # the next section
            break
        m = re.match(r"^    (\w+)(?: \([^)]*\))?:\s*(.*)$", line)
        if m:
            current = m.group(1)
            out[current] = m.group(2).strip()
        elif current and line.strip():
            out[current] += " " + line.strip()
    return out


def _help_lines(cls: type, prefix: str) -> list[str]:
    hints = typing.get_type_hints(cls)
    helps = field_help(cls)
    lines: list[str] = []
    # plain keys first, then one block per section, so a top-level key never reads as a section's
    fields = sorted(dataclasses.fields(cls), key=lambda f: dataclasses.is_dataclass(hints[f.name]))
    for f in fields:
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            summary = (inspect.getdoc(tp) or "").split("\n", 1)[0]
            lines += ["", f"{prefix}{f.name}:  {helps.get(f.name) or summary}".rstrip()]
            lines += _help_lines(tp, prefix + f.name + ".")
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        shown = "required" if default is dataclasses.MISSING else _yaml_value(default)
        lines.append(f"  {prefix}{f.name}: {_type_name(tp)} = {shown}")
        lines.append(f"      {helps.get(f.name, '(no help written)')}")
    return lines


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " | ".join(str(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in typing.get_args(tp))}]"
    return getattr(tp, "__name__", str(tp))


def _yaml_value(value: Any) -> str:
    def as_mapping(item: Any) -> dict[str, Any]:  # a dataclass item, e.g. of a list of search settings
        if dataclasses.is_dataclass(item) and not isinstance(item, type):
            return dataclasses.asdict(item)
        raise TypeError(f"{type(item).__name__} is not JSON serializable")

    try:
        return json.dumps(value, ensure_ascii=False, default=as_mapping)  # null, true, "text", [..] as YAML reads them
    except TypeError:
        return repr(value)


def require_model_dir(cfg: Any, key: str, hub: bool = True) -> None:
    """Fail early, naming KEY, when the model path at dotted KEY of CFG cannot be loaded.

    A local directory must hold a config.json. With HUB, a name shaped like a hub id (`org/name`,
    whose `org` is not a local folder) is left to transformers unless HF_HUB_OFFLINE /
    TRANSFORMERS_OFFLINE is set and the hub cache has no copy. Runs before any model import, so
    a typo costs a second, not a traceback from transformers after the heavy imports.
    """
    value: Any = cfg
    for part in key.split("."):
        value = getattr(value, part)
    if not value:
        raise ConfigError(f"{key}: required (a model directory)")
    path = Path(str(value)).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"{key}: {value} has no config.json: not a Hugging Face model directory "
                "(point it at a directory save_pretrained or a recipe wrote)"
            )
        return
    if path.exists():
        raise ConfigError(f"{key}: {value} is a file; a model directory is expected")
    hub_shaped = re.fullmatch(r"[\w.-]+/[\w.-]+", str(value)) and not Path(str(value).split("/")[0]).is_dir()
    offline = any(
        os.environ.get(v, "").lower() in ("1", "true", "yes", "on") for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )
    if hub and hub_shaped:
        if not offline:
            return  # a hub id: transformers downloads it (or says why not)
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(str(value), "config.json"), str):
            return
        raise ConfigError(
            f"{key}: {value} is not a local directory and not in the hub cache, and "
            "HF_HUB_OFFLINE is set (no hub access): give a local model directory"
        )
    where = f" (relative to {Path.cwd()})" if not path.is_absolute() else ""
    kind = "a local directory expected" + ("; no hub access" if offline or not hub_shaped else "")
    raise ConfigError(f"{key}: {value} does not exist{where} ({kind})")


def require_files(cfg: Any, *keys: str) -> None:
    """Fail early, naming the key, when a data file at a dotted key of CFG is set but is not a
    file: before a model loads (minutes for a 7B one), not as a bare errno after it."""
    for key in keys:
        value: Any = cfg
        for part in key.split("."):
            value = getattr(value, part)
        if not value:
            continue
        path = Path(str(value)).expanduser()
        if not path.is_file():
            where = f" (relative to {Path.cwd()})" if not path.is_absolute() else ""
            what = "is a directory" if path.is_dir() else "does not exist"
            raise ConfigError(f"{key}: {value} {what}{where}; a JSONL file is expected")


# What a training run writes into its output folder (mmprm.training): every setting, plus facts
# about the run that are not settings. Given back with --config, the file repeats the run.
RESOLVED_CONFIG = "config.resolved.json"
RUN_RECORD_KEYS = ("num_processes",)


def resolved_config_text(cfg: Any, num_processes: int) -> str:
    """The RESOLVED_CONFIG file's JSON: `cfg`'s settings and the run's record (RUN_RECORD_KEYS)."""
    return json.dumps({**to_dict(cfg), "num_processes": num_processes}, indent=2)


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Build `cls` from a YAML file (optional) and dotted overrides (`train.lr=1e-5`)."""
    raw: dict[str, Any] = {}
    source = "(no --config file)"
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
        if Path(path).name == RESOLVED_CONFIG:  # a run's record: its facts are not settings
            for key in RUN_RECORD_KEYS:
                raw.pop(key, None)
    _move_renamed(cls, raw, source, prefix="")
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: write it as key=value, e.g. train.lr=1e-5")
        one: dict[str, Any] = {}
        _set_dotted(one, key.strip(), _Leaf(yaml.safe_load(value) if value != "" else ""))
        _move_renamed(cls, one, f"override {item!r}", prefix="")
        key, leaf = _leaf(one)
        _set_dotted(raw, key, leaf.value)
    try:
        return _build(cls, raw, source, prefix="")
    except ConfigError as e:
        if path is not None:
            raise
        raise ConfigError(
            f"{e}\nNo config file was given: pass one with --config FILE (the shipped ones are "
            "in recipes/configs/<backbone>/), or set every required key as key=value; "
            "--help lists every key."
        ) from None


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


def _get_dotted(raw: dict[str, Any], key: str) -> tuple[bool, Any]:
    node: Any = raw
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _pop_dotted(raw: dict[str, Any], key: str) -> None:
    *parents, last = key.split(".")
    node = raw
    for part in parents:
        node = node[part]
    del node[last]
    if parents and not node:  # a section left empty by the move is no key of the new layout
        _pop_dotted(raw, ".".join(parents))


def _move_renamed(cls: type, raw: dict[str, Any], source: str, prefix: str) -> None:
    """Move each old key of CLS's `RENAMED_KEYS` (and its sections') found in RAW to its new place,
    warning with both names; old and new both set is an error. An old key that is a prefix of its
    new one (`prm` -> `prm.path`) moves only when it holds a value, not the new section."""
    for old, new in getattr(cls, "RENAMED_KEYS", {}).items():
        found, value = _get_dotted(raw, old)
        content = value.value if isinstance(value, _Leaf) else value
        if not found or (new.startswith(old + ".") and isinstance(content, dict)):
            continue
        _pop_dotted(raw, old)
        if _get_dotted(raw, new)[0]:
            raise ConfigError(f"{source}: {prefix + old} and {prefix + new} are both set: keep {prefix + new} only")
        warnings.warn(
            f"{source}: {prefix + old} is now {prefix + new}; the old key is read for one more release: rename it",
            FutureWarning,
            stacklevel=3,
        )
        _set_dotted(raw, new, value)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]) and isinstance(raw.get(f.name), dict):
            _move_renamed(hints[f.name], raw[f.name], source, prefix + f.name + ".")


@dataclasses.dataclass
class _Leaf:
    """An override's value while its key is moved: the mapping around it is keys, never its content."""

    value: Any


def _leaf(one: dict[str, Any]) -> tuple[str, _Leaf]:
    """(dotted key, value) of the one `_Leaf` in ONE, a mapping that nests it."""
    ((name, value),) = one.items()
    if isinstance(value, _Leaf):
        return name, value
    key, leaf = _leaf(value)
    return f"{name}.{key}", leaf


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
