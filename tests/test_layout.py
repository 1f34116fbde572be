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
    assert "mmprm.training.collate" in graph["mmprm.training.packing"]  # the graph reads real imports
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


NEAR_TWIN_FIELDS = 5


def copied_fields(a: type, b: type) -> set[str]:
    """Field names A and B both declare that are not one composed section: not inherited from a
    base they share, and not a section under the same key whose types are the same or related
    (a recipe composing `policy` or `prm` shares that key with every other, by design)."""
    import typing

    if issubclass(a, b) or issubclass(b, a):
        return set()
    inherited = {f.name for base in shared_bases(a, b) for f in dataclasses.fields(base)}
    ha, hb = typing.get_type_hints(a), typing.get_type_hints(b)
    same = {f.name for f in dataclasses.fields(a)} & {f.name for f in dataclasses.fields(b)}
    composed = {
        n
        for n in same
        if isinstance(ha[n], type)
        and isinstance(hb[n], type)
        and dataclasses.is_dataclass(ha[n])
        and dataclasses.is_dataclass(hb[n])
        and related(ha[n], hb[n])
    }
    return same - inherited - composed


def near_twins(classes: list[type]) -> list[str]:
    """`A and B share [fields]` for each pair of config classes with NEAR_TWIN_FIELDS or more copied fields."""
    import itertools

    found = []
    for a, b in itertools.combinations(classes, 2):
        shared = copied_fields(a, b)
        if len(shared) >= NEAR_TWIN_FIELDS:
            found.append(f"{a.__module__}.{a.__qualname__} and {b.__module__}.{b.__qualname__} share {sorted(shared)}")
    return found


@dataclasses.dataclass
class _ScorerA:
    path: str = ""
    batch_size: int = 8
    max_length: int | None = None
    device: str = "auto"
    backend: str = "hf"
    use_images: bool = True


@dataclasses.dataclass
class _ScorerB:  # the same five settings, copied with one default changed
    path: str = ""
    batch_size: int = 16
    max_length: int | None = None
    device: str = "auto"
    backend: str = "hf"
    chunk: int = 256


@dataclasses.dataclass
class _Composed(_ScorerA):  # extends the section: no copy
    chunk: int = 256


@dataclasses.dataclass
class _Top1:
    scorer: _ScorerA = dataclasses.field(default_factory=_ScorerA)


@dataclasses.dataclass
class _Top2:
    scorer: _Composed = dataclasses.field(default_factory=_Composed)


def test_the_near_twin_finder_finds_a_copied_section_and_passes_a_composed_one():
    assert near_twins([_ScorerA, _ScorerB]) == [
        f"{__name__}._ScorerA and {__name__}._ScorerB share ['backend', 'batch_size', 'device', 'max_length', 'path']"
    ]
    assert near_twins([_ScorerA, _Composed, _Top1, _Top2]) == []


# Near twins left as they are, each with the reason it cannot compose the other yet.
KNOWN_NEAR_TWINS = {
    # The demo's task section spells the synthetic task's knobs as its published settings do
    # (comma-separated strings, its own defaults); reshaping it changes docs/demo/report.json.
    frozenset({"mmprm.data.synthetic.SyntheticConfig", "_recipe_quickstart.TaskConfig"}),
}


def test_no_two_config_classes_are_near_twins():
    """No two config classes in the library and the recipes repeat NEAR_TWIN_FIELDS or more of
    each other's settings: a section several need is written once (`mmprm.config_sections`) and
    composed, by key or by extending it, so the copies cannot drift apart."""
    classes = config_dataclasses()
    names = lambda t: frozenset(t.split(" share ")[0].split(" and "))  # noqa: E731
    found = [t for t in near_twins(classes) if names(t) not in KNOWN_NEAR_TWINS]
    assert len(classes) > 40  # the scan found the sections
    assert not found, "near-twin config classes: " + "; ".join(found)


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


def private_imports(library: Path) -> list[str]:
    """`module: from X import _name` for each import of a private name (or from a private module)
    of another package. A package is `mmprm.<first part>`: `mmprm.data.eval_sets` may use
    `mmprm.data.eval_sets._source`, `mmprm.models` may not use `mmprm.generation`'s `_helpers`."""
    root = library.parent

    def package(module: str) -> str:
        return ".".join(module.split(".")[:2])

    def private(part: str) -> bool:
        return part.startswith("_") and not part.startswith("__")

    found = []
    for path in sorted(library.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name.split(".")[0] != library.name or package(name) == package(module):
                    continue
                if any(private(p) for p in name.split(".")[1:]):
                    found.append(f"{module}: {name}")
    return sorted(found)


def test_the_private_import_finder_finds_one_across_packages(tmp_path):
    lib = tmp_path / "mmprm"
    for pkg in ("models", "generation", "data/eval_sets"):
        (lib / pkg).mkdir(parents=True)
        (lib / pkg / "__init__.py").write_text("")
    (lib / "generation" / "vllm.py").write_text("def _engine(): pass\ndef engine(): pass\n")
    (lib / "data" / "eval_sets" / "_source.py").write_text("def load(): pass\n")
    (lib / "data" / "eval_sets" / "mmk12.py").write_text("from mmprm.data.eval_sets._source import load\n")
    (lib / "data" / "readers.py").write_text("from .eval_sets._source import load\n")
    (lib / "models" / "prm.py").write_text(
        "from mmprm.generation.vllm import engine\n"
        "def f():\n    from mmprm.generation.vllm import _engine\n"
        "import mmprm.data.eval_sets._source\n"
    )
    assert private_imports(lib) == [
        "mmprm.models.prm: mmprm.data.eval_sets._source",
        "mmprm.models.prm: mmprm.generation.vllm._engine",
    ]


def test_no_module_imports_a_private_name_from_another_package():
    """A name another package needs is part of its owner's interface: public, documented, kept."""
    assert private_imports(LIBRARY) == []


def top_level_names(library: Path) -> dict[str, list[str]]:
    """Public top-level function and class name -> the modules that define it. A package's
    `__init__` that defines a name only to import it lazily from its own package (`mmprm.load_prm`)
    defines nothing new and is left out."""
    root = library.parent
    defined: dict[str, list[str]] = {}
    for path in sorted(library.rglob("*.py")):
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name.startswith("_"):
                continue
            forwards = path.name == "__init__.py" and any(
                isinstance(n, ast.ImportFrom)
                and (n.module or "").startswith(module + ".")
                and any(a.name == node.name for a in n.names)
                for n in ast.walk(node)
            )
            if not forwards:
                defined.setdefault(node.name, []).append(module)
    return defined


def test_the_name_finder_finds_a_name_defined_twice(tmp_path):
    lib = tmp_path / "mmprm"
    (lib / "rerank").mkdir(parents=True)
    (lib / "__init__.py").write_text("def load_prm(p):\n    from mmprm.models.prm import load_prm\n")
    (lib / "models").mkdir()
    (lib / "models" / "prm.py").write_text("def load_prm(p): pass\nclass _Private: pass\n")
    (lib / "problems.py").write_text("class Problem: pass\ndef _helper(): pass\n")
    (lib / "rerank" / "candidates.py").write_text("class Problem: pass\nclass _Private: pass\n")
    names = top_level_names(lib)
    assert names["load_prm"] == ["mmprm.models.prm"]
    assert names["Problem"] == ["mmprm.problems", "mmprm.rerank.candidates"]
    assert "_Private" not in names and "_helper" not in names


def test_no_two_library_modules_define_the_same_public_name():
    """Each public top-level function or class name in the library means one thing: a reader who
    meets `load_problems` or `Problem` knows which without looking at the import."""
    names = top_level_names(LIBRARY)
    assert len(names) > 300  # the scan read the library
    assert {name: modules for name, modules in names.items() if len(modules) > 1} == {}


def names_imported_from(module: str, roots: list[Path]) -> dict[str, list[str]]:
    """name -> files that `from <module> import name`."""
    found: dict[str, list[str]] = {}
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.module == module and not node.level:
                    for a in node.names:
                        found.setdefault(a.name, []).append(str(path.relative_to(REPO)))
    return found


def test_every_name_imported_from_the_training_package_is_exported():
    """Recipes import the run's names from `mmprm.training` (its lazy exports): a name added to
    `mmprm.training.run` that a recipe imports is exported too, or the recipe fails on import."""
    import importlib

    training = importlib.import_module("mmprm.training")
    imported = names_imported_from("mmprm.training", [REPO / d for d in ("mmprm", "recipes", "tests", "benchmarks")])
    assert "TrainingRun" in imported  # the scan read the recipes
    submodules = {p.stem for p in (LIBRARY / "training").glob("*.py")}
    missing = {n: files for n, files in imported.items() if n not in submodules and n not in training.__all__}
    assert missing == {}
    for name in training.__all__:
        assert getattr(training, name).__module__ == "mmprm.training.run"


# A recipe names its reader (`data.format=...`) and calls `mmprm.data.readers.get_reader`; the
# readers themselves live in the library. A "format switch" is code that picks among behaviours by
# a format value (a name or attribute called format, fmt or reader): one function comparing the
# same value with string literals two or more times (an if/elif chain, or ifs in a row), a dict of
# string keys indexed by it (written in place or bound to a name first), or a `match` on it. A single
# check in a function (a requirement such as "scorer.kind=mc needs data.format=mc_tree") is not one.
FORMAT_NAMES = {"format", "fmt", "reader"}


def _format_value(node: ast.AST) -> str | None:
    """The dotted text of `node` when it is a format value (`cfg.data.format`, `fmt`), else None."""
    last = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
    return ast.unparse(node) if last in FORMAT_NAMES else None


def _has_str(node: ast.AST) -> bool:
    items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return any(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in items)


def _str_keyed(node: ast.AST) -> bool:
    return isinstance(node, ast.Dict) and len(node.keys) >= 2 and all(_has_str(k) for k in node.keys if k)


def format_switches(path: Path) -> list[str]:
    """`file:line: what` for each format switch in the Python file at `path` (see above)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    found: set[tuple[int, str]] = set()
    for fn in [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))]:
        compared: dict[str, list[int]] = {}
        tables = {  # names bound to a dict of string keys
            t.id
            for n in ast.walk(fn)
            if isinstance(n, ast.Assign) and _str_keyed(n.value)
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        for node in ast.walk(fn) if fn is not tree else ():
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(_has_str(s) for s in sides):
                    for value in filter(None, map(_format_value, sides)):
                        compared.setdefault(value, []).append(node.lineno)
            elif isinstance(node, ast.Subscript) and (value := _format_value(node.slice)):
                if _str_keyed(node.value) or isinstance(node.value, ast.Name) and node.value.id in tables:
                    found.add((node.lineno, f"dict dispatch on {value}"))
            elif isinstance(node, ast.Match) and (value := _format_value(node.subject)):
                found.add((node.lineno, f"match on {value}"))
        found |= {(min(lines), f"{len(lines)} tests of {v}") for v, lines in compared.items() if len(lines) >= 2}
    return [f"{where}:{line}: {what}" for line, what in sorted(found)]


def test_the_switch_finder_finds_each_shape(tmp_path):
    src = tmp_path / "recipe.py"
    src.write_text(
        "def read(cfg, fmt):\n"
        "    if cfg.data.format == 'rpts':\n        a = 1\n"
        "    elif cfg.data.format in ('steps', 'mc'):\n        a = 2\n"
        "    table = {'x': 1, 'y': 2}\n"
        "    b = table[fmt]\n"
        "    match cfg.reader:\n        case 'z':\n            pass\n"
        "def check(cfg):\n"
        "    if cfg.data.format != 'mc_tree':\n        raise ValueError('one check is not a switch')\n"
        "    if cfg.kind == 'a':\n        pass\n    elif cfg.kind == 'b':\n        pass\n"
    )
    assert format_switches(src) == [
        f"{src}:2: 2 tests of cfg.data.format",
        f"{src}:7: dict dispatch on fmt",
        f"{src}:8: match on cfg.reader",
    ]


def test_no_format_switch_in_the_recipes():
    """Recipes pick a reader by name from `mmprm.data.readers`; the formats are read in the library."""
    found = [s for p in sorted((REPO / "recipes").rglob("*.py")) for s in format_switches(p)]
    assert not found, "format switches in recipes (register a reader in mmprm.data.readers instead):\n" + "\n".join(
        found
    )


# What only `PolicyConfig.build` and `PRMScorerConfig.build` (mmprm.config_sections) may call.
BUILT_BY_SECTIONS = {
    "load_prm",
    "make_rollout_backend",
    "HFBackend",
    "VLLMBackend",
    "SimulatedBackend",
    "VLLMPRMScorer",
}


def section_bypasses(path: Path, root: Path = REPO) -> list[str]:
    """`file:line name` for each call of a BUILT_BY_SECTIONS name (bare, or as an attribute such as
    `HFBackend.from_pretrained` or `mmprm.load_prm`) in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call):
            continue
        func, names = node.func, set()
        while isinstance(func, ast.Attribute):
            names.add(func.attr)
            func = func.value
        if isinstance(func, ast.Name):
            names.add(func.id)
        for name in sorted(names & BUILT_BY_SECTIONS):
            found.append(f"{path.relative_to(root)}:{node.lineno} {name}")
    return found


def test_the_bypass_finder_finds_a_loader_call(tmp_path):
    (tmp_path / "r.py").write_text(
        "from mmprm import load_prm\nimport mmprm\n\ns = load_prm('p', batch_size=8)\n"
        "t = mmprm.load_prm('p')\nb = HFBackend.from_pretrained('p')\nok = cfg.prm.build()\n"
    )
    assert section_bypasses(tmp_path / "r.py", tmp_path) == [
        "r.py:4 load_prm",
        "r.py:5 load_prm",
        "r.py:6 HFBackend",
    ]


def test_recipes_build_policies_and_prms_only_through_their_sections():
    """A recipe composes the `policy` / `prm` sections (mmprm.config_sections) and calls their
    build(): it never constructs a generation backend or calls load_prm with its arguments itself."""
    files = sorted((REPO / "recipes").rglob("*.py"))
    assert any(p.name == "bon_rerank.py" for p in files)
    assert [f for p in files for f in section_bypasses(p)] == []
