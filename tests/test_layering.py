"""The code's structure, checked: engines never import the app, no import cycles (function-level
imports included), no private names imported across modules, every package installed, and no
module grown past ~400 lines without a stated reason."""
from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# source folder -> installed package name (pyproject.toml [tool.setuptools.package-dir])
FOLDERS = {"specchat": "specchat", "backends": "specchat.backends", "profiles": "specchat.shipped_profiles"}
ENGINES = "specchat.backends"
MAX_LINES = 400
LONG_MODULES: dict[str, str] = {}  # module -> why it is longer than MAX_LINES


def modules() -> dict[str, Path]:
    out = {}
    for folder, package in FOLDERS.items():
        for f in sorted((ROOT / folder).rglob("*.py")):
            parts = list(f.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = f
    return out


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, str, int]]:
    """(imported project module, imported name or "", line) for every import in the file, at any depth."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                   for stmt in block.body for n in ast.walk(stmt)}  # never run: not an import at run time
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.append((sub, "", node.lineno) if sub in known else (base, a.name, node.lineno))
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for target, _, _ in imports(name, path, known):
            while target and target not in known:  # `import a.b.c`: the deepest project module named
                target = target.rpartition(".")[0]
            if target and target != name:
                edges[name].add(target)
    return edges


def test_engines_never_import_the_app():
    mods = modules()
    up = [f"{name}:{line} imports {target}" for name, path in mods.items() if name.startswith(ENGINES)
          for target, _, line in imports(name, path, set(mods))
          if target.split(".")[0] == "specchat" and not target.startswith(ENGINES)]
    assert not up, up


def test_nothing_imports_the_folders_by_their_source_names():
    """`backends` and `profiles` are installed as specchat.backends and specchat.shipped_profiles."""
    mods = modules()
    wrong = [f"{name}:{line} imports {target}" for name, path in mods.items()
             for target, _, line in imports(name, path, set(mods)) if target.split(".")[0] in ("backends", "profiles")]
    assert not wrong, wrong


def test_no_import_cycles():
    edges = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_no_private_names_across_modules():
    mods = modules()
    private = [f"{name}:{line} takes {target}.{what}" for name, path in mods.items()
               for target, what, line in imports(name, path, set(mods))
               if target in mods and what.startswith("_") and not what.startswith("__")]
    assert not private, private


def test_every_package_is_installed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {name for name, path in modules().items() if path.name == "__init__.py"}
    assert set(config["packages"]) == packages
    assert config["package-dir"] == {package: folder for folder, package in FOLDERS.items()}


def test_modules_stay_small_or_say_why():
    long = {name: n for name, path in modules().items()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES and name not in LONG_MODULES}
    assert not long, long
