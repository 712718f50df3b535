"""The tiny random checkpoints the check runs on, written by the test suite's own helpers
(tests/native/tiny.py, tests/speculative/tiny_dflash.py) with transformers' and gguf's writers,
so the device checks what the CPU tests check, on the same weights."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.native.tiny import LAYOUTS, add_mtp_head, make_gguf, make_hf_checkpoint
from tests.speculative.tiny_dflash import make_dflash_checkpoint

# GGUF matrix types checked besides the safetensors layouts: lossless F32, and Q4_1, the default
# model's (dequantized off CPU, where torch's int4 kernel does not run)
GGUF_TYPES = ("F32", "Q4_1")
DFLASH_BLOCK = 7  # drafts of up to 6 tokens: every depth of the parity grid


def architecture_checkpoints(root: Path) -> dict[str, Path]:
    """name -> checkpoint: every layout the engine reads (llama, llama3-rope, qwen2, qwen3) as a
    safetensors directory, and the llama one as GGUF files."""
    out = {layout: make_hf_checkpoint(root / layout, layout, seed=i) for i, layout in enumerate(LAYOUTS)}
    for qtype in GGUF_TYPES:
        out[f"llama-gguf-{qtype}"] = make_gguf(root / f"llama-{qtype}.gguf", out["llama"], qtype)
    return out


@dataclass(frozen=True)
class ParityCheckpoints:
    """What the speculative parity grid runs (as tests/speculative/conftest.py's tiny_pair): a
    target with a built-in MTP head, a different draft model with its tokenizer, a DFlash drafter."""

    target: Path
    draft: Path
    dflash: Path


def parity_checkpoints(root: Path) -> ParityCheckpoints:
    target = make_hf_checkpoint(root / "target", "llama", seed=11)
    add_mtp_head(target, "deepseek", seed=13)  # the main model ignores it; the MTP drafter reads it
    draft = make_hf_checkpoint(root / "draft", "llama", seed=12)
    dflash = make_dflash_checkpoint(root / "dflash", target, block_size=DFLASH_BLOCK)
    return ParityCheckpoints(target, draft, dflash)
