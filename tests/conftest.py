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


KQUANT_FTYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "IQ4_XS", "Q5_1")


@pytest.fixture(scope="session")
def kquant_ggufs(tmp_path_factory) -> dict:
    """ftype -> a llama-arch GGUF of a tiny checkpoint wide enough for K-quant blocks (256), quantized
    by llama.cpp's own quantizer, as the files people download are."""
    from tests.native.tiny import make_gguf, make_hf_checkpoint, quantize_with_llamacpp

    root = tmp_path_factory.mktemp("kquant")
    hf = make_hf_checkpoint(root / "hf", "llama", seed=21, hidden=256, ffn=512)
    source = make_gguf(root / "tiny-F32.gguf", hf, "F32")
    return {f: quantize_with_llamacpp(source, root / f"tiny-{f}.gguf", f) for f in KQUANT_FTYPES}
