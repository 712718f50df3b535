"""Where specchat keeps things: user config (profiles), data (history), cache (models).

Each can be moved with an environment variable, which tests use to stay out of the real ones.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import platformdirs

APP = "specchat"


def _dir(env: str, default: str) -> Path:
    path = Path(os.environ.get(env) or default).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def config_dir() -> Path:
    return _dir("SPECCHAT_CONFIG_DIR", platformdirs.user_config_dir(APP))


def data_dir() -> Path:
    return _dir("SPECCHAT_DATA_DIR", platformdirs.user_data_dir(APP))


def cache_dir() -> Path:
    return _dir("SPECCHAT_CACHE_DIR", platformdirs.user_cache_dir(APP))


def user_profiles_dir() -> Path:
    return _dir("SPECCHAT_PROFILES_DIR", str(config_dir() / "profiles"))


def shipped_profiles_dir() -> Path:
    import profiles  # the package of shipped YAML profiles

    return Path(profiles.__path__[0])


def derived_cache_path(kind: str, source: Path, *versions: str, suffix: str = "") -> Path:
    """Where something derived from the file `source` is cached: under cache_dir()/kind, named by
    the file's path, size and modification time and the `versions` of whatever derived it, so a
    changed file (or a new version of the tool) gets a fresh entry."""
    st = source.stat()
    key = "|".join([str(source.resolve()), str(st.st_size), str(st.st_mtime_ns), *versions])
    return cache_dir() / kind / (hashlib.sha256(key.encode()).hexdigest()[:24] + suffix)
