"""What every stage shares: the script's paths, the one-line stop, logging, the sandbox's environment, git."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent  # scripts/
DEFAULT_REPO = HERE.parent
PROMPTS = HERE / "mutation" / "verify-prompts.jsonl"
EQUIVALENT = HERE / "mutation" / "equivalent.toml"
TRACER = HERE / "mutation" / "line_trace.py"
SELECTOR = HERE / "mutation" / "tests_for_mutant.py"


class Stop(Exception):
    """A reason to stop, printed as one line."""


def log(msg: str) -> None:
    print(msg, flush=True)


# An editable install's finder serves `specchat.backends.X` from the real checkout when the sandbox's
# commit has no X (a module added since): the sandbox would run a mix of two trees. Every sandbox
# process drops that finder at start-up (site.py imports sitecustomize after the .pth files).
SITECUSTOMIZE = """import sys
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
sys.path_hooks[:] = [h for h in sys.path_hooks if not getattr(h, "__module__", "").startswith("__editable__")]
sys.path_importer_cache.clear()
"""


def sandbox_env(out: Path) -> dict:
    env = dict(os.environ)
    for var in ("PYTHONPATH", "PYTHONSAFEPATH", "PYTHONSTARTUP"):
        env.pop(var, None)
    site = out / "site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env["PYTHONPATH"] = str(site)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    # On 2 shared cores torch's OpenMP threads spin while they wait; with another busy process (a
    # measurement, a second worker) that made the unmutated subset 8x slower (516 s against 64 s).
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    home = out / "home"  # `verify` writes nothing that matters, but keep it out of the user's dirs
    env["SPECCHAT_CONFIG_DIR"] = str(home / "config")
    env["SPECCHAT_DATA_DIR"] = str(home / "data")
    env["SPECCHAT_PROFILES_DIR"] = str(home / "profiles")
    return env


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def committed_text(repo: Path, commit: str, path: str) -> str | None:
    done = subprocess.run(["git", "-C", str(repo), "show", f"{commit}:{path}"], capture_output=True)
    return done.stdout.decode("utf-8") if done.returncode == 0 else None
