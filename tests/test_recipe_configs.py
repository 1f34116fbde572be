"""Every shipped recipe YAML parses against its recipe's typed Config and opens with its launch line;
every accelerate config a YAML or a recipe docstring points at exists."""

import dataclasses
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch
from recipe_runs import load_recipe

from mmprm.config import load_config
from mmprm.training.run import resolve_grad_accum

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "recipes" / "configs"
RECIPES = (
    "prm_train",
    "policy_sft",
    "bon_rerank",
    "mcts_annotate",
    "tree_eval",
    "prm_eval",
    "quickstart",
    "reasoning_eval",
    "prm_search",
)
YAMLS = sorted(CONFIGS.rglob("*.yaml"))
CONFIG_FILE = re.compile(r"--config_file[ =]+(\S+)")


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def recipe_module(name: str):
    """recipes/<name>.py loaded by path (the `recipes` package raises on import by design)."""
    path = REPO / "recipes" / f"{name}.py"
    if not path.exists():
        pytest.skip(f"recipe {rel(path)} does not exist yet")
    return load_recipe(name)


def header(path: Path) -> list[str]:
    """The leading comment block of a YAML file."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return lines


def test_configs_are_shipped():
    assert YAMLS, f"no YAML under {rel(CONFIGS)}"
    assert {p.stem for p in YAMLS} <= set(RECIPES), (
        f"a config is named after no recipe: {sorted({p.stem for p in YAMLS} - set(RECIPES))} "
        f"(name it recipes/configs/<backbone>/<recipe>.yaml with <recipe> one of {RECIPES})"
    )


def config_class(name: str) -> type:
    """The recipe's top-level config dataclass: `Config`, else the class its main() loads."""
    module = recipe_module(name)
    if hasattr(module, "Config"):
        return module.Config
    found = re.findall(r"load_config\((\w+),", Path(module.__file__).read_text(encoding="utf-8"))
    assert len(set(found)) == 1, f"recipes/{name}.py: no `Config` and no single load_config(CLASS, ...) call"
    return getattr(module, found[0])


@pytest.mark.parametrize("path", YAMLS, ids=[rel(p) for p in YAMLS])
def test_yaml_parses_against_its_recipe_config(path):
    cls = config_class(path.stem)
    cfg = load_config(cls, path)  # unknown keys, wrong types and validate() fail here
    assert isinstance(cfg, cls)


@pytest.mark.parametrize("path", YAMLS, ids=[rel(p) for p in YAMLS])
def test_yaml_opens_with_its_launch_command(path):
    first = path.read_text(encoding="utf-8").splitlines()[0]
    launcher = r"(accelerate launch|python|torchrun)\b"
    assert re.match(rf"# {launcher}.* recipes/{path.stem}\.py\b", first), (
        f"{rel(path)}:1: first line must be the launch command as a comment, e.g. "
        f"'# accelerate launch recipes/{path.stem}.py --config {rel(path)}'; got {first!r}"
    )
    assert re.search(rf"--config[ =]+{re.escape(rel(path))}(\s|$)", first), (
        f"{rel(path)}:1: the launch line must pass this very file: --config {rel(path)}"
    )


@pytest.mark.parametrize("path", YAMLS, ids=[rel(p) for p in YAMLS])
def test_yaml_header_config_files_exist(path):
    for number, line in enumerate(header(path), start=1):
        for ref in CONFIG_FILE.findall(line):
            assert (REPO / ref).is_file(), f"{rel(path)}:{number}: --config_file {ref} does not exist"


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_docstring_config_files_exist(name):
    module = recipe_module(name)
    doc = module.__doc__ or ""
    for ref in CONFIG_FILE.findall(doc):
        assert (REPO / ref).is_file(), f"recipes/{name}.py docstring: --config_file {ref} does not exist"
    # The --config files a docstring names are shipped too (placeholders like C.yaml aside).
    for ref in re.findall(r"--config[ =]+(recipes/configs/\S+\.yaml)", doc):
        assert (REPO / ref).is_file(), f"recipes/{name}.py docstring: --config {ref} does not exist"


def test_real_backbone_batch_arithmetic():
    """The 7B/8B configs keep MM-PRM's global batches on one 8-GPU node and on four."""
    for backbone in ("qwen2_5_vl_7b", "internvl3_8b"):
        for name, global_batch in (("prm_train", 512), ("policy_sft", 128)):
            path = CONFIGS / backbone / f"{name}.yaml"
            cfg = load_config(config_class(name), path)
            assert cfg.train.global_batch_size == global_batch, rel(path)
            for processes in (8, 32):  # one node, four
                assert (
                    cfg.train.batch_size * resolve_grad_accum(dataclasses.replace(cfg.train), processes) * processes
                    == global_batch
                )
            assert cfg.train.bf16 and cfg.model.freeze_vision_tower and cfg.train.schedule == "cosine"
            assert cfg.train.require_gpu  # a 7B on CPU by accident never starts
            assert 0 < cfg.train.warmup_steps < cfg.train.max_steps and cfg.data.max_length == 4096
            if name == "prm_train":
                assert 2e-6 <= cfg.train.lr <= 4e-6 and cfg.data.label_mode == "soft"
            else:
                assert cfg.train.lr == 4e-5


def _leaf_keys(cls: type, prefix: str = "") -> list[str]:
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    keys = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            keys += _leaf_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


@pytest.mark.parametrize("name", RECIPES)
def test_help_lists_every_key_with_type_default_and_help(name, capsys):
    cls = config_class(name)
    with pytest.raises(SystemExit) as e:
        recipe_module(name).main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python recipes/{name}.py --config FILE") or f"recipes/{name}.py --config FILE" in out
    lines = out.splitlines()
    for key in _leaf_keys(cls):
        entry = next((i for i, line in enumerate(lines) if line.startswith(f"  {key}: ")), None)
        assert entry is not None, f"recipes/{name}.py --help does not list {key}"
        assert " = " in lines[entry], f"{key}: no default shown: {lines[entry]!r}"
        help_line = lines[entry + 1].strip()
        assert help_line and help_line != "(no help written)", (
            f"{key}: no help; add it to the Attributes: section of {cls.__name__}'s docstring"
        )


def test_help_runs_as_a_script_without_a_config():
    import subprocess

    done = subprocess.run(
        [sys.executable, "recipes/tree_eval.py", "--help"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert (
        "prm.path: str | null = null" in done.stdout and "PRM directory written by recipes/prm_train.py" in done.stdout
    )


def test_a_missing_model_directory_names_its_key_before_any_loading(tmp_path):
    from mmprm.config import ConfigError

    config = str(CONFIGS / "tiny" / "prm_train.yaml")
    with pytest.raises(ConfigError, match=r"^model\.name_or_path: /nonexistent/model does not exist \(a local"):
        recipe_module("prm_train").main(
            ["--config", config, "model.name_or_path=/nonexistent/model", f"output_dir={tmp_path}"]
        )
    assert not any(tmp_path.iterdir())  # nothing written
    # before hours of generation, not after
    with pytest.raises(ConfigError, match=r"^policy\.path: /nonexistent/policy does not exist"):
        recipe_module("bon_rerank").main(
            [
                "--config",
                str(CONFIGS / "tiny" / "bon_rerank.yaml"),
                "generate.enabled=true",
                "policy.path=/nonexistent/policy",
                f"output_dir={tmp_path / 'bon'}",
            ]
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: require_gpu passes")
@pytest.mark.parametrize("recipe", ["prm_train", "policy_sft"])
def test_a_gpu_config_without_a_gpu_stops_before_anything(recipe, tmp_path, tiny_models):
    """The 7B configs set train.require_gpu: without a visible GPU (e.g. a driver older than
    torch's CUDA) the run stops at once, naming the key, instead of training on CPU."""
    from mmprm.config import ConfigError

    config = str(CONFIGS / "tiny" / f"{recipe}.yaml")
    with pytest.raises(ConfigError, match=r"^train\.require_gpu: torch .* sees no GPU\. Check `nvidia-smi`"):
        recipe_module(recipe).main(
            [
                "--config",
                config,
                f"model.name_or_path={tiny_models('qwen2_vl')}",
                "train.require_gpu=true",
                f"output_dir={tmp_path / 'out'}",
            ]
        )
    assert not (tmp_path / "out").exists()  # nothing written


GPU_MARKERS = ("torchrun", "--num_processes 8", "sbatch", "srun", "backend=vllm", "shard.count=8", "--nproc")


def readme_gpu_commands() -> list[str]:
    """The commands of the README and docs/ (continuation lines joined) that run on GPUs."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    text = "\n".join(page.read_text(encoding="utf-8") for page in pages)
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        cmd = ""
        for line in block.splitlines():
            if line.strip().startswith("#"):
                continue
            cmd += line.rstrip().removesuffix("\\") + " "
            if not line.rstrip().endswith("\\"):
                if any(m in cmd for m in GPU_MARKERS):
                    commands.append(" ".join(cmd.split()))
                cmd = ""
    return commands


def test_readme_gpu_commands_name_real_configs_that_take_their_overrides():
    """A tiny config on a GPU runs a 7B in fp32 with 128 new tokens: every GPU command of the README
    and docs/ names a real config, and its config loads with the overrides the command gives."""
    commands = readme_gpu_commands()
    assert len(commands) >= 4
    for cmd in commands:
        assert "configs/tiny/" not in cmd, f"GPU command in README.md or docs/ names a tiny config: {cmd}"
        config = re.search(r"recipes/(\w+)\.py --config (recipes/configs/\S+)", cmd)
        if config is None:
            continue  # a placeholder (CONFIG.yaml), or an sbatch line naming its config in CONFIG=
        recipe, path = config.groups()
        overrides = [w for w in shlex.split(cmd.split(path, 1)[1]) if "=" in w and not w.startswith("-")]
        load_config(config_class(recipe), str(REPO / path), overrides)


def _renamed_keys() -> list[tuple[str, str, str]]:
    """(recipe, old key, new key) of every key a recipe still reads under its old name."""
    out = []
    for name in RECIPES:
        cls = config_class(name)
        out += [(name, old, new) for old, new in getattr(cls, "RENAMED_KEYS", {}).items()]
    return out


def _value_for(cls: type, key: str):
    """A value of the type at dotted KEY of CLS, unlike its default where the type allows."""
    import typing

    tp = cls
    for part in key.split("."):
        tp = typing.get_type_hints(tp)[part]
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, __import__("types").UnionType):
        tp = args[0]
    if typing.get_origin(tp) is typing.Literal:
        return typing.get_args(tp)[-1]
    if dataclasses.is_dataclass(tp):
        return {"seed": 7}  # a section: the sampling one
    return {str: "renamed/x", int: 3, float: 0.25, bool: True, dict: {"enforce_eager": True}}[
        typing.get_origin(tp) or tp
    ]


RENAMED = _renamed_keys()


@pytest.mark.parametrize(("name", "old", "new"), RENAMED, ids=[f"{n}:{o}" for n, o, _ in RENAMED])
def test_an_old_key_still_loads_with_a_warning_naming_the_new_one(name, old, new):
    """Keys that moved to the shared `policy` / `prm` sections are read under their old names for
    one release: the same config, and a FutureWarning that names the new key."""
    import yaml

    cls = config_class(name)
    value = _value_for(cls, new)
    text = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
    path = CONFIGS / "tiny" / f"{name}.yaml"
    with pytest.warns(FutureWarning, match=rf"{re.escape(old)} is now {re.escape(new)}; the old key is read"):
        via_old = load_config(cls, path, [f"{old}={text}"])
    via_new = load_config(cls, path, [f"{new}={text}"])
    assert via_old == via_new != load_config(cls, path)  # the same config, the value set where it now lives


def test_an_old_layout_yaml_loads_as_the_shipped_one(tmp_path):
    """bon_rerank's tiny YAML as written before the `policy` / `prm` sections: the same config."""
    old = tmp_path / "bon_rerank.yaml"
    old.write_text(
        "prm: runs/tiny/prm\ncandidates_file: runs/tiny/bon_candidates/candidates.jsonl\ngenerate:\n"
        "  enabled: false\n  policy: runs/tiny/toy_policy\n  problems_file: runs/tiny/toy_problems/problems.jsonl\n"
        "  n: 4\n  backend: hf\n  batch_size: 32\n  step_mode: null\n  sampling:\n    temperature: 1.0\n"
        "    top_k: 50\n    top_p: 0.9\n    max_new_tokens: 128\n    seed: 0\nscoring:\n  batch_size: 16\n"
        "  share_prefix: true\n  max_length: null\n  device: auto\nreport:\n  n_subsets: 32\n  resamples: 1000\n"
        "  seed: 0\n  weighted_by: min\n  title: 'Best-of-N, tiny PRM on the toy policy'\nshard:\n  index: 0\n"
        "  count: 1\noutput_dir: runs/tiny/bon\n"
    )
    cls = config_class("bon_rerank")
    with pytest.warns(FutureWarning) as caught:
        assert load_config(cls, old) == load_config(cls, CONFIGS / "tiny" / "bon_rerank.yaml")
    assert f"{old}: generate.policy is now policy.path" in "\n".join(str(w.message) for w in caught)
