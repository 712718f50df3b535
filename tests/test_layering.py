"""The code's structure, checked: engines never import the app, no import cycles (function-level and
type-checking-only imports included), the TUI's screens reach the app only through ChatHost, no private
names imported across modules, every package installed, and no module grown past ~400 lines without a
stated reason."""
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
    """(imported project module, imported name or "", line) for every import in the file, at any depth.

    Imports under `if TYPE_CHECKING:` count too: they never run, but a module that names another's
    types for its annotations depends on it all the same, and a circle through them is one to untie."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
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


def graph(mods: dict[str, Path]) -> dict[str, set[str]]:
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


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

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
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    found = cycles(graph(modules()))
    assert not found, found


def test_a_circle_through_type_checking_or_function_level_imports_is_caught(tmp_path):
    """The way the TUI's circle once ran: the app imports a screen at the top, the screen imports the
    app for its type only, or inside a function."""
    (tmp_path / "app.py").write_text("from pkg.screen import Screen\n")
    (tmp_path / "screen.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                        "    from pkg.app import App\n")
    (tmp_path / "late.py").write_text("def open_app():\n    from pkg import app\n")
    mods = {f"pkg.{p.stem}": p for p in tmp_path.glob("*.py")}
    assert cycles(graph(mods)) == [["pkg.app", "pkg.screen"]]
    (tmp_path / "app.py").write_text("from pkg.screen import Screen\nfrom pkg.late import open_app\n")
    (tmp_path / "screen.py").write_text("")
    assert cycles(graph(mods)) == [["pkg.app", "pkg.late"]]


def names_used_on_the_app(path: Path) -> set[str]:
    """Every `self.app.X` and `app.X` (the screens' local alias of self.app) in a module."""
    used = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        if (isinstance(v, ast.Name) and v.id == "app") or (
                isinstance(v, ast.Attribute) and v.attr == "app" and isinstance(v.value, ast.Name) and v.value.id == "self"):
            used.add(node.attr)
    return used


def host_names() -> set[str]:
    """The attributes and methods ChatHost (specchat/tui/host.py) declares."""
    tree = ast.parse((ROOT / "specchat" / "tui" / "host.py").read_text(encoding="utf-8"))
    host = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ChatHost")
    return {n.target.id for n in host.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)} | {
        n.name for n in host.body if isinstance(n, ast.FunctionDef)}


def test_the_screens_ask_the_app_only_what_chat_host_declares():
    """A screen that reached for more of the app than ChatHost (or any Textual App) offers would depend
    on app.py again without importing it: the interface would stop describing what the screens need."""
    from textual.app import App

    mods = modules()
    for screen in ("specchat.tui.chat_screen", "specchat.tui.ab_screen"):
        assert "specchat.tui.app" not in graph(mods)[screen]
        extra = names_used_on_the_app(mods[screen]) - host_names() - set(dir(App))
        assert not extra, f"{screen} uses app.{sorted(extra)}: declare them in ChatHost (specchat/tui/host.py)"


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
