"""Tiny checkpoints with MTP layers, written by transformers' own classes, and their GGUFs as llama.cpp's
converter writes them (its nextn blocks: backends/native/gguf_mtp.py).

- qwen35: the Qwen3.5 hybrid (tiny.make_hybrid_checkpoint) with a Qwen3.5 MTP head (`mtp.*`, its
  gated attention layer and dense MLP);
- qwen35moe: Qwen3.5-MoE (tiny_moe) with its head's layer routed experts and a gated shared expert;
- glm4moe: GLM-4.5 (tiny_moe) with a GLM-style head (`model.layers.{N}.eh_proj` ..., routed experts).

The MTP tensors go to `model-mtp.safetensors`, a second part of the checkpoint, as the published
checkpoints keep them beside the main weights: the converter reads the parts named `model*`, the
engine's directory loader every `*.safetensors`. Qwen3.5's multimodal RoPE sections are fitted to the
tiny heads' 4 rotated dims ([1, 1, 0] pairs, for Qwen3.5's [11, 11, 10] of 64): llama.cpp checks that
they fit (with the default, llama-server aborts: `GGML_ASSERT(sect_dims <= ne0)`); text positions
are the same in every section, so transformers' and the engine's RoPE are unchanged.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from tests.native.tiny import add_mtp_head, make_hybrid_checkpoint
from tests.native.tiny_moe import add_moe_mtp_head, make_moe_checkpoint

MTP_ARCHS = ("qwen35", "qwen35moe", "glm4moe")
SEEDS = {"qwen35": 61, "qwen35moe": 62, "glm4moe": 63}


def make_mtp_checkpoint(out: Path, arch: str) -> Path:
    seed = SEEDS[arch]
    if arch == "qwen35":
        path = make_hybrid_checkpoint(out, "qwen3_5", seed=seed)
        add_mtp_head(path, "qwen3_next", seed=seed + 100)
    else:
        path = make_moe_checkpoint(out, "qwen3_5_moe" if arch == "qwen35moe" else "glm4_moe", seed=seed)
        add_moe_mtp_head(path, "qwen3_next" if arch == "qwen35moe" else "deepseek", seed=seed + 100)
    os.replace(path / "mtp.safetensors", path / "model-mtp.safetensors")
    if arch != "glm4moe":
        config = json.loads((path / "config.json").read_text())
        config["rope_parameters"]["mrope_section"] = [1, 1, 0]
        (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def make_mtp_ggufs(root: Path) -> dict:
    """arch -> the F32 GGUF of its tiny checkpoint with MTP layers; (arch, "Q8_0") -> qwen35's and
    glm4moe's as Q8_0 (their matrices on specchat's kernels); (arch, "hf") -> the checkpoint."""
    from tests.native.convert import convert

    out = {(arch, "hf"): make_mtp_checkpoint(root / arch, arch) for arch in MTP_ARCHS}
    jobs = {arch: (out[arch, "hf"], root / f"{arch}-F32.gguf", "f32") for arch in MTP_ARCHS}
    jobs |= {(arch, "Q8_0"): (out[arch, "hf"], root / f"{arch}-Q8_0.gguf", "q8_0") for arch in ("qwen35", "glm4moe")}
    convert(list(jobs.values()))
    return out | {key: path for key, (_, path, _) in jobs.items()}
