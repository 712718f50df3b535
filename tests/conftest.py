"""Shared fixtures: every test gets its own config and data directories (the model cache is shared,
so the real default model is fetched once per machine)."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def isolated_dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCHAT_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("SPECCHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("SPECCHAT_PROFILES_DIR", str(tmp_path / "user-profiles"))
    monkeypatch.delenv("SPECCHAT_DEBUG", raising=False)
    return tmp_path


@pytest.fixture(scope="session")
def default_gguf():
    """The real default model (SmolLM2-135M-Instruct Q4_1), fetched once into the cache."""
    from specchat.models import pull

    return pull(progress=False)
