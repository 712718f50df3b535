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
    # every model built from its file (test_built_models.py turns the store on): a test that changes how
    # a model is read must meet its own build, not one an earlier test kept in the shared cache
    monkeypatch.setenv("SPECCHAT_BUILT_MODELS", "0")
    return tmp_path


@pytest.fixture(scope="session")
def default_gguf():
    """The real default model (SmolLM2-135M-Instruct Q4_1), fetched once into the cache."""
    from specchat.models import pull

    return pull(progress=False)


KQUANT_FTYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "IQ4_XS", "Q5_1", "F16", "BF16")


@pytest.fixture(scope="session")
def kquant_ggufs(tmp_path_factory) -> dict:
    """ftype -> a llama-arch GGUF of a tiny checkpoint wide enough for K-quant blocks (256), quantized
    by llama.cpp's own quantizer, as the files people download are."""
    from tests.native.tiny import make_gguf, make_hf_checkpoint, quantize_with_llamacpp

    root = tmp_path_factory.mktemp("kquant")
    hf = make_hf_checkpoint(root / "hf", "llama", seed=21, hidden=256, ffn=512)
    source = make_gguf(root / "tiny-F32.gguf", hf, "F32")
    return {f: quantize_with_llamacpp(source, root / f"tiny-{f}.gguf", f) for f in KQUANT_FTYPES}


@pytest.fixture(scope="session")
def arch_ggufs(tmp_path_factory) -> dict:
    """(arch, ftype) -> a GGUF of a tiny transformers checkpoint of each of tiny_archs.GGUF_ARCHS (qwen3moe,
    gemma3), as people's GGUFs are made: F32 and Q8_0 by llama.cpp's converter, Q4_K_M by its quantizer
    from the F32 file; (arch, "hf") -> the checkpoint directory."""
    from tests.native.convert import convert
    from tests.native.tiny import quantize_with_llamacpp
    from tests.native.tiny_archs import GGUF_ARCHS, make_arch_checkpoint

    root = tmp_path_factory.mktemp("archs")
    # qwen3moe's seed: one whose int8-rounded rows seldom choose other experts (another gave 95% top-1, not 99%)
    seeds = {"qwen3moe": 32, "gemma3": 31}
    out = {(arch, "hf"): make_arch_checkpoint(root / arch, arch, seed=seeds[arch]) for arch in GGUF_ARCHS}
    jobs = {(arch, ftype): (out[arch, "hf"], root / f"{arch}-{ftype}.gguf", ftype.lower()) for arch in GGUF_ARCHS
            for ftype in ("F32", "Q8_0")}
    convert(list(jobs.values()))
    out |= {key: path for key, (_, path, _) in jobs.items()}
    for arch in GGUF_ARCHS:
        out[arch, "Q4_K_M"] = quantize_with_llamacpp(out[arch, "F32"], root / f"{arch}-Q4_K_M.gguf", "Q4_K_M")
    return out


@pytest.fixture(scope="session")
def mtp_ggufs(tmp_path_factory) -> dict:
    """arch -> a GGUF with MTP (nextn) layers of each of tiny_mtp.MTP_ARCHS (qwen35, qwen35moe, glm4moe),
    converted by llama.cpp's own converter; (arch, "hf") -> the checkpoint directory it came from."""
    from tests.native.tiny_mtp import make_mtp_ggufs

    return make_mtp_ggufs(tmp_path_factory.mktemp("mtp-ggufs"))
