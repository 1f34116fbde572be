"""mmprm.generation.policy: the prompt format saved with a policy, and how configs override it."""

from __future__ import annotations

import json
import warnings

import pytest

from mmprm.generation.policy import (
    POLICY_SPEC_FILE,
    PolicySpec,
    load_policy_spec,
    resolve_prompt_format,
    save_policy_spec,
)


def test_saved_spec_fills_what_the_config_leaves_unset(tmp_path):
    save_policy_spec(tmp_path, PolicySpec(system_prompt="Solve it.", step_mode="blank_lines"))
    assert json.loads((tmp_path / POLICY_SPEC_FILE).read_text())["version"] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # agreeing or unset values warn about nothing
        assert resolve_prompt_format(tmp_path, None, None, "x") == (
            "Solve it.",
            "blank_lines",
        )
        assert resolve_prompt_format(tmp_path, "Solve it.", "blank_lines", "x") == (
            "Solve it.",
            "blank_lines",
        )


def test_config_values_win_with_a_warning(tmp_path):
    save_policy_spec(tmp_path, PolicySpec(system_prompt="Solve it."))
    with pytest.warns(UserWarning, match=r"x: step_mode='blank_lines' overrides 'tags'"):
        assert resolve_prompt_format(tmp_path, None, "blank_lines", "x") == (
            "Solve it.",
            "blank_lines",
        )
    with pytest.warns(UserWarning, match="system_prompt='' overrides 'Solve it.'"):
        assert resolve_prompt_format(tmp_path, "", None, "x") == (
            None,
            "tags",
        )  # "" sends no system turn


def test_a_policy_without_a_spec_uses_the_config_or_defaults(tmp_path):
    assert load_policy_spec(tmp_path) is None
    assert resolve_prompt_format(tmp_path, None, None, "x") == (None, "tags")
    assert resolve_prompt_format("Qwen/Qwen2.5-VL-7B-Instruct", "Hi.", "blank_lines", "x") == ("Hi.", "blank_lines")


@pytest.mark.parametrize(
    "content, error",
    [
        ("{", "not valid JSON"),
        ('{"version": 7}', "version: expected 1, got 7"),
        ('{"version": 1, "step_mode": "lines"}', "step_mode: 'lines' is not one of"),
        (
            '{"version": 1, "system_prompt": 3}',
            "system_prompt: must be a string or null",
        ),
    ],
)
def test_a_broken_spec_names_file_and_field(tmp_path, content, error):
    (tmp_path / POLICY_SPEC_FILE).write_text(content)
    with pytest.raises(ValueError, match=error) as e:
        load_policy_spec(tmp_path)
    assert str(tmp_path / POLICY_SPEC_FILE) in str(e.value)
