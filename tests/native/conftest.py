"""Fixtures for the native engine: tiny checkpoints built once per session, and the real model."""
from __future__ import annotations

import pytest

from tests.native.tiny import LAYOUTS, make_gguf, make_hf_checkpoint


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

