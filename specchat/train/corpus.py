"""The target-written corpus kept in the repository: the token ids of `specchat train data`
directories, compact, so that a session extends the corpus instead of regenerating it.

- `pack(data, out)`: `out/tokens.npz` (numpy's compressed archive: every sample's prompt + reply
  ids, concatenated, uint16) and `out/manifest.jsonl` (id, prompt and reply lengths, stop reason,
  offset), with `out/info.json` (target, sampling, how the replies were made). Samples already in
  `out` are kept; new ones are appended. No probabilities and no hidden states are stored.
- `unpack(corpus, out, profile)`: a `train data` directory again. The replies are the stored
  ones; the target's top-k log-probabilities at each reply position are recomputed by one
  teacher-forced pass per sample (a prefill: seconds, where writing the reply took minutes).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specchat.backends.base import BackendError
from specchat.backends.weight_files import load_safetensors
from specchat.train.store import INFO, MANIFEST, SHARD_FIX, Sample, ShardWriter, read_manifest

TOKENS = "tokens.npz"
MAX_ID = np.iinfo(np.uint16).max


def read_corpus(corpus: Path) -> tuple[list[dict], np.ndarray]:
    """(manifest lines, all token ids) of a packed corpus; empty if there is none yet."""
    lines = read_manifest(corpus)
    if not lines:
        return [], np.zeros(0, dtype=np.uint16)
    with np.load(corpus / TOKENS) as z:
        return lines, z["tokens"]


def pack(data: Path, out: Path) -> int:
    """Add the samples of the data directory `data` that `out` lacks; returns how many were added."""
    manifest = read_manifest(data)
    if not manifest:
        raise BackendError(f"{data}: no samples (manifest.jsonl); run `specchat train data` first")
    info = json.loads((data / INFO).read_text())
    out.mkdir(parents=True, exist_ok=True)
    lines, tokens = read_corpus(out)
    if (out / INFO).exists():
        old = json.loads((out / INFO).read_text())
        keep = ("target", "kind", "max_tokens", "temperature", "seed", "generator")
        if any(old.get(k) != info.get(k) for k in keep):
            raise BackendError(f"{out}: holds replies made with other settings ({ {k: old.get(k) for k in keep} }); "
                               "pack into another directory")
    have = {m["id"] for m in lines}
    parts, offset, shards = [tokens], len(tokens), {}
    new = []
    for m in manifest:
        if m["id"] in have:
            continue
        sh = shards.setdefault(m["shard"], load_safetensors(data / m["shard"], SHARD_FIX)["tokens"])
        ids = sh[m["offset"]:m["offset"] + m["prompt_len"] + m["reply_len"]].numpy()
        if ids.size and int(ids.max()) > MAX_ID:
            raise BackendError(f"{data}: token id {int(ids.max())} does not fit uint16; this corpus format is "
                               "for vocabularies of at most 65,536 tokens")
        parts.append(ids.astype(np.uint16))
        new.append({"id": m["id"], "offset": offset, "prompt_len": m["prompt_len"], "reply_len": m["reply_len"],
                    "stop": m["stop"]})
        offset += ids.size
        have.add(m["id"])
    if not new:
        return 0
    tmp = out / (TOKENS + ".tmp.npz")
    np.savez_compressed(tmp, tokens=np.concatenate(parts))
    tmp.replace(out / TOKENS)
    with open(out / MANIFEST, "a", encoding="utf-8") as f:
        f.writelines(json.dumps(m) + "\n" for m in new)
    counts = tokens_by_kind(lines + new)
    settings = {k: v for k, v in info.items() if k not in ("top_k", "unpacked_from")}  # top-k: recomputed
    (out / INFO).write_text(json.dumps(settings | counts, indent=1))
    return len(new)


def tokens_by_kind(lines: list[dict]) -> dict:
    """How many replies and reply tokens the corpus holds of each kind: the stage after `~` in a
    sample id (`documents:3~summary`, a derived prompt's `~translate`), `reply` for plain prompts."""
    replies: dict[str, int] = {}
    tokens: dict[str, int] = {}
    for m in lines:
        kind = m["id"].rsplit("~", 1)[1] if "~" in m["id"] else "reply"
        replies[kind] = replies.get(kind, 0) + 1
        tokens[kind] = tokens.get(kind, 0) + m["reply_len"]
    return {"replies": sum(replies.values()), "reply_tokens": sum(tokens.values()),
            "by_kind": {k: {"replies": replies[k], "reply_tokens": tokens[k]} for k in sorted(tokens)}}


@torch.inference_mode()
def unpack(corpus: Path, out: Path, profile, top_k: int = 32, shard_size: int = 32, say=print) -> int:
    """A `train data` directory from a packed corpus, top-k recomputed with the target; resumable."""
    from specchat.loading import load_target

    lines, tokens = read_corpus(corpus)
    if not lines:
        raise BackendError(f"{corpus}: no packed corpus (manifest.jsonl); make one with `specchat train corpus`")
    info = json.loads((corpus / INFO).read_text())
    if info.get("target") != profile.name:
        raise BackendError(f"{corpus}: written by target '{info.get('target')}', not '{profile.name}'")
    out.mkdir(parents=True, exist_ok=True)
    (out / INFO).write_text(json.dumps(info | {"top_k": top_k, "unpacked_from": str(corpus)}, indent=1))
    done = {m["id"] for m in read_manifest(out)}
    todo = [m for m in lines if m["id"] not in done]
    engine = load_target(profile)
    head = engine.model.head.weight if engine.model.head.weight is not None else engine.model.embed
    writer = ShardWriter(out, shard_size)
    try:
        for m in todo:
            ids = tokens[m["offset"]:m["offset"] + m["prompt_len"] + m["reply_len"]].astype(np.int64).tolist()
            prompt, reply = ids[:m["prompt_len"]], ids[m["prompt_len"]:]
            engine.truncate(0)
            states, _ = engine.forward(ids[:-1], 0, head=False)  # row i predicts token i + 1
            # the reply's rows only, in one GEMM (the engine's own head multiplies row pairs on CPU)
            logits = F.linear(states[len(prompt) - 1:].to(head.dtype), head)
            logp = torch.log_softmax(logits.float(), dim=-1)
            v, i = logp.topk(top_k, dim=-1)
            writer.add(Sample(m["id"], prompt, reply, i.to(torch.int32), v.to(torch.float16), m["stop"]))
    finally:
        writer.flush()
    say(f"{len(todo)} samples unpacked from {corpus} into {out} ({len(lines) - len(todo)} already there)")
    return len(todo)
