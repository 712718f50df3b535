"""A tiny random DSpark drafter: a tiny DFlash drafter (tiny_dflash.py) with DeepSpec's Markov head
tensors (and optionally the confidence head) written beside its own, in the released names."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.speculative.tiny_dflash import make_dflash_checkpoint


def make_dspark_checkpoint(out: Path, target_dir: Path, *, rank: int = 8, anchor_first: bool = False,
                           confidence: bool = False, markov_scale: float = 1.0, seed: int = 0,
                           drop: tuple[str, ...] = (), shapes: dict | None = None, **dflash) -> Path:
    make_dflash_checkpoint(out, target_dir, seed=seed, **dflash)
    cfg = json.loads((out / "config.json").read_text())
    V, d = cfg["vocab_size"], cfg["hidden_size"]
    g = torch.Generator().manual_seed(seed + 1000)
    extra = {"markov_head.markov_w1.weight": torch.randn(V, rank, generator=g),
             "markov_head.markov_w2.weight": torch.randn(V, rank, generator=g) * markov_scale}
    if confidence:
        extra |= {"confidence_head.proj.weight": torch.randn(1, d + rank, generator=g) * 0.1,
                  "confidence_head.proj.bias": torch.zeros(1)}
    for name, shape in (shapes or {}).items():
        extra[name] = torch.randn(*shape, generator=g)
    w = load_file(str(out / "model.safetensors")) | {k: v for k, v in extra.items() if k not in drop}
    save_file(w, str(out / "model.safetensors"))
    cfg["architectures"] = ["DSparkDraftModel"]
    cfg["dflash_config"] |= {"projector_type": "dspark", "markov_rank": rank, "sample_from_anchor": anchor_first}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
