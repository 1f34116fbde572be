"""mmprm.config: field help from docstrings, the no-config message, early model-path checks."""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import pytest

from mmprm.config import ConfigError, config_help, field_help, load_config, parse_cli, require_model_dir


@dataclasses.dataclass
class Inner:
    """A section.

    Attributes:
        mode: how it runs: fast | slow
        width: columns, wrapped
            over two lines
    """

    mode: str = "fast"
    width: int | None = None


@dataclasses.dataclass
class Outer:
    """Top.

    Attributes:
        name_or_path: the model; required
        inner: the section
    """

    name_or_path: str = ""
    inner: Inner = dataclasses.field(default_factory=Inner)

    def validate(self) -> None:
        if not self.name_or_path:
            raise ValueError("name_or_path: required")


def test_field_help_reads_the_attributes_section():
    assert field_help(Inner) == {"mode": "how it runs: fast | slow", "width": "columns, wrapped over two lines"}
    text = config_help(Outer)
    assert '  name_or_path: str = ""\n      the model; required' in text
    assert "inner:  the section" in text
    assert "  inner.width: int | null = null\n      columns, wrapped over two lines" in text


def test_help_flag_prints_and_exits_zero(capsys):
    with pytest.raises(SystemExit) as e:
        parse_cli(["--config", "x.yaml", "--help"], Outer)
    assert e.value.code == 0 and 'inner.mode: str = "fast"' in capsys.readouterr().out
    with pytest.raises(ConfigError, match="--help to list every key"):
        parse_cli(["--bogus"], Outer)


def test_no_config_file_says_so():
    with pytest.raises(ConfigError) as e:
        load_config(Outer, None, [])
    msg = str(e.value)
    assert "name_or_path: required" in msg and "No config file was given" in msg and "--config FILE" in msg
    assert "<defaults>" not in msg
    assert load_config(Outer, None, ["name_or_path=m"]).name_or_path == "m"  # overrides alone are fine


def test_run_record_is_dropped_only_from_a_resolved_config(tmp_path):
    settings = {"name_or_path": "m", "inner": {"mode": "slow"}, "num_processes": 2}
    resolved = tmp_path / "config.resolved.json"
    resolved.write_text(json.dumps(settings))
    assert load_config(Outer, resolved, []).inner.mode == "slow"
    # Written by hand, num_processes is no setting: accelerate launch sets the process count.
    hand = tmp_path / "mine.yaml"
    hand.write_text(json.dumps(settings))
    with pytest.raises(ConfigError, match="unknown key.*num_processes"):
        load_config(Outer, hand, [])


def _model_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return path


def test_require_model_dir_names_the_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    cfg = Outer(name_or_path=str(_model_dir(tmp_path / "ok")))
    require_model_dir(cfg, "name_or_path")  # a model directory passes
    bad = {
        "/x/y": "name_or_path: /x/y does not exist (a local directory expected; no hub access)",
        "runs/tiny/policy": "name_or_path: runs/tiny/policy does not exist (relative to",
        str(tmp_path): "has no config.json: not a Hugging Face model directory",
    }
    (tmp_path / "f.txt").write_text("x")
    bad[str(tmp_path / "f.txt")] = "is a file; a model directory is expected"
    for value, want in bad.items():
        with pytest.raises(ConfigError) as e:
            require_model_dir(Outer(name_or_path=value), "name_or_path")
        assert want in str(e.value), str(e.value)
    # A hub id is transformers' business, unless the hub is off and the cache has no copy.
    require_model_dir(Outer(name_or_path="Qwen/Qwen2.5-VL-7B-Instruct"), "name_or_path")
    with pytest.raises(ConfigError, match="inner.mode: Qwen/Qwen2.5-VL-7B-Instruct does not exist"):
        require_model_dir(Outer(inner=Inner(mode="Qwen/Qwen2.5-VL-7B-Instruct")), "inner.mode", hub=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE is set"):
        require_model_dir(Outer(name_or_path="Qwen/Qwen2.5-VL-7B-Instruct"), "name_or_path")
    # org/name whose org is a local folder is a local path, typo included
    monkeypatch.delenv("HF_HUB_OFFLINE")
    (tmp_path / "runs").mkdir()
    with pytest.raises(ConfigError, match="runs/prm does not exist"):
        require_model_dir(Outer(name_or_path="runs/prm"), "name_or_path")


@dataclasses.dataclass
class Engine:
    """An engine.

    Attributes:
        path: where it is
        kwargs: more
    """

    path: str | None = None
    kwargs: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Moved:
    """Keys that moved.

    Attributes:
        prm: the PRM
        inner: a section
        engine: another
    """

    prm: Engine = dataclasses.field(default_factory=Engine)
    inner: Inner = dataclasses.field(default_factory=Inner)
    engine: Engine = dataclasses.field(default_factory=Engine)

    RENAMED_KEYS: typing.ClassVar[dict[str, str]] = {
        "prm": "prm.path",  # a value that became a section
        "old.mode": "inner.mode",  # a section that is gone
        "old.kwargs": "engine.kwargs",
        "inner.columns": "inner.width",  # within a section
    }


def test_an_old_key_is_read_at_its_new_place_with_a_warning(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("prm: runs/prm\nold:\n  mode: slow\n  kwargs: {a: 1}\ninner:\n  columns: 3\n")
    new = tmp_path / "new.yaml"
    new.write_text("prm:\n  path: runs/prm\ninner:\n  mode: slow\n  width: 3\nengine:\n  kwargs: {a: 1}\n")
    with pytest.warns(FutureWarning) as caught:
        moved = load_config(Moved, old)
    assert moved == load_config(Moved, new) == Moved(Engine("runs/prm"), Inner("slow", 3), Engine(kwargs={"a": 1}))
    said = sorted(str(w.message) for w in caught)
    assert said == [
        f"{old}: inner.columns is now inner.width; the old key is read for one more release: rename it",
        f"{old}: old.kwargs is now engine.kwargs; the old key is read for one more release: rename it",
        f"{old}: old.mode is now inner.mode; the old key is read for one more release: rename it",
        f"{old}: prm is now prm.path; the old key is read for one more release: rename it",
    ]


def test_old_and_new_keys_mix_across_the_file_and_the_overrides(tmp_path, recwarn):
    new = tmp_path / "new.yaml"
    new.write_text("prm:\n  path: runs/prm\n")
    with pytest.warns(FutureWarning, match="override 'prm=other': prm is now prm.path"):
        assert load_config(Moved, new, ["prm=other"]).prm.path == "other"
    with pytest.warns(FutureWarning, match="override 'old.kwargs={b: 2}': old.kwargs is now engine.kwargs"):
        assert load_config(Moved, new, ["old.kwargs={b: 2}"]).engine.kwargs == {"b": 2}  # a mapping value moves whole
    old = tmp_path / "old.yaml"
    old.write_text("prm: runs/prm\n")
    with pytest.warns(FutureWarning, match="prm is now prm.path"):
        assert load_config(Moved, old, ["prm.path=other"]).prm.path == "other"
    recwarn.clear()
    assert load_config(Moved, new, ["prm.path=x", "inner.width=2"]).prm.path == "x"  # new keys: no warning
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning)]


def test_an_old_key_beside_its_new_one_is_refused(tmp_path):
    both = tmp_path / "both.yaml"
    both.write_text("old:\n  mode: slow\ninner:\n  mode: fast\n")
    with pytest.raises(ConfigError, match=r"both.yaml: old.mode and inner.mode are both set: keep inner.mode only"):
        load_config(Moved, both)
