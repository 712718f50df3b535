"""Fixtures for the native engine: tiny checkpoints built once per session, and the real model."""
from __future__ import annotations

import pytest

from tests.native.tiny import LAYOUTS, make_gguf, make_hf_checkpoint, quantize_with_llamacpp


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict:
    """layout -> a saved transformers checkpoint directory with tokenizer."""
    root = tmp_path_factory.mktemp("tiny")
    return {layout: make_hf_checkpoint(root / layout, layout, seed=i) for i, layout in enumerate(LAYOUTS)}


@pytest.fixture(scope="session")
def tiny_ggufs(tiny_dirs, tmp_path_factory) -> dict:
    """qtype -> a llama-arch GGUF of the tiny llama checkpoint."""
    root = tmp_path_factory.mktemp("gguf")
    return {q: make_gguf(root / f"tiny-{q}.gguf", tiny_dirs["llama"], q) for q in ("F32", "Q8_0", "Q4_1")}


@pytest.fixture(scope="session")
def real_gguf():
    """The real default model (SmolLM2-135M-Instruct Q4_1), fetched once into the cache."""
    from specchat.models import pull

    return pull(progress=False)


KQUANT_FTYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")


@pytest.fixture(scope="session")
def kquant_ggufs(tmp_path_factory) -> dict:
    """ftype -> a llama-arch GGUF of a tiny checkpoint wide enough for K-quant blocks (256), quantized
    by llama.cpp's own quantizer, as the files people download are."""
    root = tmp_path_factory.mktemp("kquant")
    hf = make_hf_checkpoint(root / "hf", "llama", seed=21, hidden=256, ffn=512)
    source = make_gguf(root / "tiny-F32.gguf", hf, "F32")
    return {f: quantize_with_llamacpp(source, root / f"tiny-{f}.gguf", f) for f in KQUANT_FTYPES}
