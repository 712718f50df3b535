import pytest


@pytest.fixture(autouse=True)
def _isolated_dirs(tmp_path, monkeypatch):
    """Keep every test out of the user's real config, data and history."""
    for var, sub in (("SPECCHAT_CONFIG_DIR", "config"), ("SPECCHAT_DATA_DIR", "data"),
                     ("SPECCHAT_PROFILES_DIR", "profiles")):
        monkeypatch.setenv(var, str(tmp_path / sub))
    yield tmp_path
