"""The package itself: light import, optional engines stay lazy, the library never imports recipes."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_import_mmprm_loads_no_heavy_or_optional_engine():
    code = (
        "import sys, mmprm, mmprm.steps, mmprm.config, mmprm.scoring, mmprm.cli; "
        "bad = [m for m in ('vllm', 'deepspeed', 'flash_attn', 'torch', 'transformers', 'openai') if m in sys.modules]; "
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", f"import mmprm pulled in {out}"


def test_library_never_imports_recipes():
    offenders = []
    for path in (REPO / "mmprm").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            )
            offenders += [f"{path.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] == "recipes"]
    assert offenders == []


def test_recipes_package_refuses_import():
    res = subprocess.run([sys.executable, "-c", "import recipes"], capture_output=True, text=True, cwd=REPO)
    assert res.returncode != 0 and "recipes are scripts" in res.stderr


def test_cli_help_lists_every_command():
    from mmprm.cli import COMMANDS

    res = subprocess.run([sys.executable, "-m", "mmprm.cli", "--help"], capture_output=True, text=True, check=True)
    for name in COMMANDS:
        assert name in res.stdout
    bad = subprocess.run([sys.executable, "-m", "mmprm.cli", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown command" in bad.stderr


def test_every_cli_command_resolves_to_a_function():
    import importlib

    from mmprm.cli import COMMANDS

    for name, (module, func, _) in COMMANDS.items():
        assert callable(getattr(importlib.import_module(module), func)), name


def _requirement_name(req: str) -> str:
    import re

    return re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0].lower().replace("_", "-")


# Imported under another name than the distribution's (PIL is pillow's, yaml is pyyaml's, ...).
_DIST_OF = {"PIL": "pillow", "yaml": "pyyaml", "flash_attn": "flash-attn", "math_verify": "math-verify"}
# Packages whose own imports need more than they declare: what they need is ours to declare.
_UNDECLARED_NEEDS = {"trl": ["requests"]}  # trl's GRPOTrainer imports its vLLM client, which needs requests
# Code a script is pointed at, not installed: it is the reference that script checks us against.
# --internvl-code: InternVL's own package, imported from the checkout the user names
_GIVEN_BY_PATH = {"internvl": ("benchmarks/internvl_remote_code.py", "benchmarks/internlm2_tokenizer.py")}


def test_every_imported_package_is_declared():
    """A fresh environment installs only what pyproject.toml names: every third-party package that
    the library, recipes, tests or benchmarks import must be named there (in the core or an
    extra), not arrive as some other package's dependency."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {_requirement_name(r) for r in project["dependencies"]}
    for reqs in project["optional-dependencies"].values():
        declared |= {_requirement_name(r) for r in reqs}
    local = {p.stem for d in ("tests", "benchmarks", "recipes") for p in (REPO / d).glob("*.py")}
    local |= {p.parent.name for p in (REPO / "recipes").glob("*/__init__.py")}  # the demo's package
    local |= {"mmprm", "recipes", "tests", "benchmarks"}
    imported: dict[str, str] = {}
    for folder in ("mmprm", "recipes", "tests", "benchmarks"):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    given = str(path.relative_to(REPO)) in _GIVEN_BY_PATH.get(top, ())
                    if top not in sys.stdlib_module_names and top not in local and top != "__future__" and not given:
                        imported.setdefault(top, str(path.relative_to(REPO)))
    needed = {_DIST_OF.get(m, m).lower().replace("_", "-"): where for m, where in imported.items()}
    for dist, extra in _UNDECLARED_NEEDS.items():
        if dist in needed:
            needed |= {e: f"{dist} (undeclared by it)" for e in extra}
    missing = {dist: where for dist, where in needed.items() if dist not in declared}
    assert missing == {}, f"imported but not declared in pyproject.toml (dist: first importer): {missing}"
