"""The library's layout: its modules import one another without cycles, and never the recipes.

Imports inside functions count too: a lazy import that closes a cycle still ties the two modules
together, and it is what let collation helpers and the model file lean on each other.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIBRARY = REPO / "mmprm"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path) -> set[str]:
    """Every absolute module name `path` imports, at any depth of its code (and `pkg.name` for
    `from pkg import name`, which may be a module)."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in LIBRARY.rglob("*.py")}
    return {m: {n for n in imported_names(p) if n in modules and n != m} for m, p in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_hand_made_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_inside_the_library():
    graph = import_graph()
    assert len(graph) > 50
    assert "mmprm.collate" in graph["mmprm.packing"]  # the graph reads real imports
    assert cycles(graph) == []


def test_the_library_never_imports_the_recipes():
    offenders = {
        module_name(p): sorted(n for n in imported_names(p) if n.split(".")[0] == "recipes")
        for p in LIBRARY.rglob("*.py")
    }
    assert {m: names for m, names in offenders.items() if names} == {}


def test_the_library_never_imports_the_demo():
    """The demo's evaluation and report (recipes/demo/, imported as `demo`) are a leaf, as the
    recipes are: the library holds parts a user's own run needs, not the demo's."""
    demo = REPO / "recipes" / "demo"
    assert (demo / "ablation.py").exists()  # the scan below looks for the right name
    offenders = {
        module_name(p): sorted(n for n in imported_names(p) if n.split(".")[0] == demo.name)
        for p in LIBRARY.rglob("*.py")
    }
    assert {m: names for m, names in offenders.items() if names} == {}


def config_dataclasses() -> list[type]:
    """Every dataclass named *Config defined in the library or a recipe (recipes loaded by path:
    their package refuses imports)."""
    import dataclasses
    import importlib

    from recipe_runs import load_recipe

    modules = [importlib.import_module(module_name(p)) for p in sorted(LIBRARY.rglob("*.py"))]
    modules += [load_recipe(p.stem) for p in sorted((REPO / "recipes").glob("*.py")) if p.name != "__init__.py"]
    return [
        obj
        for m in modules
        for name, obj in vars(m).items()
        if isinstance(obj, type)
        and dataclasses.is_dataclass(obj)
        and obj.__module__ == m.__name__
        and name.endswith("Config")
    ]


def test_each_config_section_is_defined_once():
    """No two config dataclasses have the same fields of the same types: a section several
    recipes need is written once (`mmprm.config_sections`, the generation backends' sampling) and
    each recipe composes it, so the copies cannot drift apart."""
    import typing

    seen: dict[tuple, type] = {}
    twins = []
    for cls in config_dataclasses():
        hints = typing.get_type_hints(cls)
        key = tuple(sorted((f.name, repr(hints[f.name])) for f in dataclasses.fields(cls)))
        other = seen.setdefault(key, cls)
        if other is not cls and not related(other, cls):  # a subclass only giving its own defaults composes
            twins.append(f"{other.__module__}.{other.__qualname__} and {cls.__module__}.{cls.__qualname__}")
    assert len(seen) > 20  # the scan found the sections
    assert not twins, "config sections defined twice: " + "; ".join(twins)


def related(a: type, b: type) -> bool:
    """One config class extends the other, or both extend one shared section."""
    return issubclass(a, b) or issubclass(b, a) or bool(shared_bases(a, b))


def shared_bases(a: type, b: type) -> set[type]:
    return {k for k in a.__mro__ if dataclasses.is_dataclass(k) and k in b.__mro__}


MAX_FUNCTION_LINES = 80


def long_functions(path: Path, root: Path = REPO, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """`file:line name (n lines)` for each function or method in `path` longer than `limit` lines."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > limit:
                found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({n} lines)")
    return found


def test_the_length_counter_finds_a_long_method(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"def short():\n    pass\n\n\nclass C:\n    def long(self):\n{body}\n")
    assert long_functions(tmp_path / "m.py", tmp_path) == [f"m.py:6 long ({MAX_FUNCTION_LINES + 1} lines)"]


def test_no_function_in_the_library_or_recipes_is_over_80_lines():
    """A function a reader can hold in view: longer ones are split into named steps."""
    files = sorted(LIBRARY.rglob("*.py")) + sorted((REPO / "recipes").rglob("*.py"))
    assert [f for p in files for f in long_functions(p)] == []
