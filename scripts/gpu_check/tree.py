"""The engine and the test helpers, imported from this working tree whether or not it is installed.

pyproject.toml installs `backends/` as `specchat.backends`. A machine that only got a copy of the
tree (a bare GPU machine: no `pip install -e .`, whose build needs setuptools and every app
dependency) has no such mapping, so `use_tree` makes it here: `specchat` and `tests` come from
the tree's root, `specchat.backends` from its `backends/` folder.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def use_tree() -> Path:
    """Make `specchat.backends.*` and `tests.*` this tree's; returns the tree's root."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import specchat

    if Path(specchat.__file__).resolve().parent != ROOT / "specchat":
        raise RuntimeError(f"`specchat` resolves to {specchat.__file__}, not to this tree ({ROOT})")
    init = ROOT / "backends" / "__init__.py"
    found = importlib.util.find_spec("specchat.backends")
    if found is None or Path(found.origin or "").resolve() != init:
        spec = importlib.util.spec_from_file_location("specchat.backends", init,
                                                      submodule_search_locations=[str(init.parent)])
        module = importlib.util.module_from_spec(spec)
        sys.modules["specchat.backends"] = module
        spec.loader.exec_module(module)
        specchat.backends = module
    return ROOT
