"""The package itself: light import, optional engines stay lazy, the library never imports recipes."""

import ast
import subprocess
import sys
from pathlib import Path

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
