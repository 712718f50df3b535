"""Where specchat keeps things: user config (profiles), data (history), cache (models).

Each can be moved with an environment variable, which tests use to stay out of the real ones.
"""
from __future__ import annotations

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
    from specchat import shipped_profiles  # the profiles/ folder of the source tree

    return Path(shipped_profiles.__path__[0])
