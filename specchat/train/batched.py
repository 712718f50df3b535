"""Batched reply generation for `specchat train data --batch N`.

The torch engine decodes one sequence at a time; distillation data wants hundreds of thousands
of tokens. transformers' model of the same checkpoint (a GGUF dequantized, then run in bfloat16
by default) decodes a left-padded batch in one pass per step, several times the engine's rate
(`specchat train data` prints its tok/s). Tokens are chosen by the engine's own position-keyed
sampler, and the stored top-k log-probabilities are this model's.

These replies are this model's, not the engine's int4 arithmetic: greedy replies can part
from the engine's at a near-tie. A drafter only needs replies typical of the target; the
training steps recompute the target's hidden states and labels with the engine.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from specchat.backends.base import BackendError, Sampling
from specchat.backends.hf_reference import cache_kwargs
from specchat.backends.native import sampling as sampler
from specchat.train import BATCH_DTYPES
from specchat.train.store import Sample


@torch.inference_mode()
def generate_batch(model, prompts: list[list[int]], sampling: Sampling, top_k: int, eos_ids: frozenset[int],
                   pad_id: int, seeds: list[int] | None = None) -> list[Sample]:
    """Replies to `prompts` (token ids), decoded together until each ends or reaches max_tokens.
    `seeds`: one sampling seed per row (rows with the same prompt then still differ)."""
    rows = [replace(sampling, seed=seed) for seed in seeds] if seeds else None
    B, L = len(prompts), max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (L - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    logits = out.logits[:, -1].float()
    replies: list[list[int]] = [[] for _ in prompts]
    top_ids: list[list[torch.Tensor]] = [[] for _ in prompts]
    top_logp: list[list[torch.Tensor]] = [[] for _ in prompts]
    stops = [""] * B
    for step in range(sampling.max_tokens):
        logp = torch.log_softmax(logits, dim=-1)
        v, i = logp.topk(top_k, dim=-1)
        positions_now = [len(p) + step for p in prompts]
        chosen = (sampler.sample(logits, positions_now, sampling) if rows is None else
                  torch.cat([sampler.sample(logits[r:r + 1], positions_now[r:r + 1], rows[r]) for r in range(B)]))
        for r in range(B):
            if stops[r]:
                continue
            token = int(chosen[r])
            replies[r].append(token)
            top_ids[r].append(i[r].to(torch.int32))
            top_logp[r].append(v[r].to(torch.float16))
            if token in eos_ids:
                stops[r] = "eos"
            elif len(replies[r]) >= sampling.max_tokens:
                stops[r] = "max_tokens"
        if all(stops):
            break
        mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype)], dim=1)
        positions = positions[:, -1:] + 1
        out = model(input_ids=chosen[:, None], attention_mask=mask, position_ids=positions, use_cache=True,
                    **cache_kwargs(out))
        logits = out.logits[:, -1].float()
    return [Sample("", list(p), reply, torch.stack(ti), torch.stack(tl), stop or "max_tokens")
            for p, reply, ti, tl, stop in zip(prompts, replies, top_ids, top_logp, stops)]


def batched_model(profile, dtype: str = "bfloat16"):
    """transformers' model of the profile's target in `dtype` and its chat tokenizer, for batched
    decoding (bfloat16 is the faster on CPUs with bfloat16 matrix units); a local GGUF is
    dequantized first either way."""
    from specchat import paths
    from specchat.backends.cpu import thread_count
    from specchat.backends.hf_reference import load_hf_model
    from specchat.backends.native.tokenizer import ChatTokenizer
    from specchat.models import resolve_model

    ref = resolve_model(profile.model, profile.base_dir)
    if ref.kind == "hub":
        raise BackendError("batched decoding needs a local model file or directory (the profile names a hub id)")
    if dtype not in BATCH_DTYPES:
        raise BackendError(f"--dtype {dtype}: batched decoding runs in {' or '.join(BATCH_DTYPES)}")
    torch.set_num_threads(thread_count(profile.threads))
    return load_hf_model(ref.path, getattr(torch, dtype)), ChatTokenizer(ref.path, paths.cache_dir())
