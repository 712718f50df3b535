"""DSpark (PKU x DeepSeek-AI, arXiv 2607.05147): DFlash's block drafter (dflash.py) plus a
low-rank Markov head that corrects each draft position's logits from the token before it.

- Base logits: the DFlash drafter's one bidirectional pass over the block (unchanged).
- Markov bias: B_k = W2 . W1[x_{k-1}] (W1 [V, r] an embedding, W2 [V, r] a linear r -> V, low
  rank), added to position k's base logits. x_0 is the last committed token; x_k is the token
  drafted at position k, so the positions are chosen one after another (a cheap loop: one row of
  W1 and an r x V product per position, after the one backbone pass).
- Layouts: DeepSpec's checkpoint keys (`markov_head.markov_w{1,2}.weight`, optional
  `confidence_head.proj.{weight,bias}`) beside the DFlash tensors, as llama.cpp's dflash.cpp and
  vLLM's DSparkSpeculator compose them (bias = w2 . w1[prev]; prev = the pick at the position before).
- Which slot is the first draft: `dflash_config.sample_from_anchor` (llama.cpp's GGUF key of the
  same name). true (the default, DeepSpec's released drafters): the anchor's own output is the
  first draft, B inputs give B drafts; false (specchat's, trained from a DFlash drafter): slot 0 is
  the committed token and drafts start at slot 1, as in DFlash.
- The confidence head (c_k = sigmoid(w . [h_k; W1[x_{k-1}]])) is read and shape-checked when a
  checkpoint has one, and not used: it schedules the verify length against server load (the
  paper's batch-128 GPU setting); here the profile's depth and the draft gate (gate.py) decide how
  far to draft, and the output is the target's either way.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..base import BackendError
from ..native.config import ModelConfig
from ..native.sampling import probs
from .dflash import DFlashConfig, DFlashDrafter, DFlashModel, read_dflash
from .loop import Draft

W1, W2 = "markov_head.markov_w1.weight", "markov_head.markov_w2.weight"
CONF_W, CONF_B = "confidence_head.proj.weight", "confidence_head.proj.bias"


class MarkovHead(nn.Module):
    """W1 [V, r] and W2 [V, r] (released names and shapes); optionally the confidence head."""

    def __init__(self, w1: Tensor, w2: Tensor, conf_w: Tensor | None = None, conf_b: Tensor | None = None):
        super().__init__()
        self.w1, self.w2 = nn.Parameter(w1.float()), nn.Parameter(w2.float())
        self.conf_w = None if conf_w is None else nn.Parameter(conf_w.float(), requires_grad=False)
        self.conf_b = None if conf_b is None else nn.Parameter(conf_b.float(), requires_grad=False)

    @property
    def rank(self) -> int:
        return self.w1.shape[1]

    def bias(self, prev: Tensor) -> Tensor:
        """The logit correction [n, V] for positions whose previous tokens are `prev` [n]."""
        return F.linear(self.w1[prev], self.w2)

    def released_tensors(self) -> dict[str, Tensor]:
        out = {W1: self.w1, W2: self.w2}
        if self.conf_w is not None:
            out |= {CONF_W: self.conf_w, CONF_B: self.conf_b}
        return {k: v.detach().float() for k, v in out.items()}


def fresh_markov(vocab: int, rank: int, generator: torch.Generator | None = None) -> MarkovHead:
    """A head that starts as no correction at all (W2 = 0), so training from a DFlash drafter
    begins at that drafter's own drafts; W1 as an embedding is initialised (N(0, 1))."""
    return MarkovHead(torch.randn(vocab, rank, generator=generator), torch.zeros(vocab, rank))


def markov_from(tensors: dict[str, Tensor], cfg: DFlashConfig, where: str) -> MarkovHead:
    """The Markov (and confidence) head from a checkpoint's extra tensors, checked: one clear line
    for a missing tensor or a wrong shape."""
    V, d = cfg.layer.vocab_size, cfg.layer.dim
    for name in (W1, W2):
        if name not in tensors:
            raise BackendError(f"{where}: tensor {name} missing: a DSpark drafter has a Markov head beside the "
                               "DFlash tensors (a DFlash drafter runs with method dflash)")
        t = tensors[name]
        if t.dim() != 2 or t.shape[0] != V:
            raise BackendError(f"{where}: {name} has shape {tuple(t.shape)}; expected [{V}, rank] (the target's "
                               "vocabulary by the Markov rank)")
    w1, w2 = tensors[W1], tensors[W2]
    if w1.shape != w2.shape:
        raise BackendError(f"{where}: {W1} {tuple(w1.shape)} and {W2} {tuple(w2.shape)} must have the same shape "
                           "[vocab, rank]")
    conf_w, conf_b = tensors.get(CONF_W), tensors.get(CONF_B)
    if (conf_w is None) != (conf_b is None):
        raise BackendError(f"{where}: the confidence head needs both {CONF_W} and {CONF_B}")
    if conf_w is not None and (tuple(conf_w.shape) != (1, d + w1.shape[1]) or conf_b.numel() != 1):
        raise BackendError(f"{where}: {CONF_W} has shape {tuple(conf_w.shape)} and {CONF_B} "
                           f"{tuple(conf_b.shape)}; expected [1, {d + w1.shape[1]}] (hidden + rank) and [1]")
    return MarkovHead(w1, w2, conf_w, None if conf_b is None else conf_b.reshape(1))


@dataclass
class DSparkWeights:
    model: DFlashModel  # the block drafter (DFlash's)
    markov: MarkovHead
    anchor_first: bool  # the anchor's slot is the first draft (see the module docstring)


def load_dspark(path: Path, target_cfg: ModelConfig) -> DSparkWeights:
    """A DSpark drafter directory: DFlash's config and tensors plus the Markov head, checked
    against the target."""
    path = Path(path)
    cfg, tensors, extra = read_dflash(path, target_cfg, frozenset((W1, W2, CONF_W, CONF_B)), "DSpark")
    markov = markov_from(extra, cfg, str(path))
    d = json.loads((path / "config.json").read_text()).get("dflash_config") or {}
    anchor_first = d.get("sample_from_anchor", True)
    if not isinstance(anchor_first, bool):
        raise BackendError(f"{path / 'config.json'}: dflash_config.sample_from_anchor must be true or false "
                           f"(got {anchor_first!r})")
    return DSparkWeights(DFlashModel(cfg, tensors), markov, anchor_first)


def config_json(cfg: DFlashConfig, rank: int, anchor_first: bool) -> dict:
    """config.json of a DSpark drafter: DFlash's released layout, marked as DSpark (the
    Speculators name and projector type) with the Markov rank and the first draft slot."""
    out = cfg.to_hf()
    out["architectures"] = ["DSparkDraftModel"]
    out["dflash_config"] = out["dflash_config"] | {"projector_type": "dspark", "markov_rank": rank,
                                                   "sample_from_anchor": anchor_first}
    return out


def is_dspark_config(config: dict) -> bool:
    arch = config.get("architectures") or []
    return (any("DSpark" in a for a in arch)
            or (config.get("dflash_config") or {}).get("projector_type") == "dspark")


class DSparkDrafter(DFlashDrafter):
    """DFlash's drafter with the Markov correction chained through the block.

    Each position's token is chosen by the target's position-keyed sampler (argmax when greedy,
    the target's own Gumbel noise at temperature: the coupling DFlashDrafter describes) on its
    corrected logits, and is the `prev` of the next position, as in vLLM's DSparkSpeculator (and
    llama.cpp's in-graph chain, which is greedy). With rejection acceptance, each position's q is
    the distribution it was drawn from given the drafts before it."""

    name = "dspark"

    def __init__(self, weights: DSparkWeights, target, want_q: bool = False):
        self.first_slot = 0 if weights.anchor_first else 1
        super().__init__(weights.model, target, want_q)
        self.markov = weights.markov.to(self.device).eval()

    @torch.inference_mode()
    def chain(self, tokens: Sequence[int], depth: int) -> tuple[list[int], Tensor]:
        """(the drafted tokens, their corrected logits [depth, vocab]) at positions len(tokens) ..."""
        base = self.draft_logits(tokens, depth)
        n, prev = len(tokens), tokens[-1]
        out, rows = [], []
        for i in range(depth):
            row = base[i:i + 1] + self.markov.bias(torch.tensor([prev], device=self.device))
            prev = int(self.target.sample(row, [n + i], self.sampling)[0])
            out.append(prev)
            rows.append(row)
        return out, torch.cat(rows)

    def propose(self, tokens: Sequence[int], depth: int) -> Draft:
        depth = min(depth, self.max_depth, self.max_len - len(tokens))
        if depth <= 0:
            return Draft([])
        out, logits = self.chain(tokens, depth)
        return Draft(out, probs(logits, self.sampling) if self.want_q else None)

    def close(self) -> None:
        super().close()
        self.markov = None
