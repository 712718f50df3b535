"""The training-data directory `specchat train data` writes and every trainer reads.

- `manifest.jsonl`: one line per sample: id, shard, prompt_len, reply_len, stop, offsets into the shard.
- `shard-NNNNN.safetensors`: `tokens` int32 (prompt + reply ids of every sample, concatenated),
  `topk_ids` int32 [reply positions, k] and `topk_logp` float16 [reply positions, k]: the target's
  k most likely next tokens and their log-probabilities at each reply position (position j holds
  the distribution the target chose reply token j from).
- `info.json`: target profile, sampling, top-k, max tokens: how to make the directory again.

A shard and its manifest lines are written together, so an interrupted run loses at most the
samples of one unwritten shard.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specchat.backends.base import BackendError

MANIFEST = "manifest.jsonl"
INFO = "info.json"
SHARD_FIX = "make the data again with `specchat train data` (its info.json says how)"  # a broken shard


@dataclass
class Sample:
    id: str
    prompt: list[int]
    reply: list[int]
    topk_ids: torch.Tensor  # int32 [len(reply), k]
    topk_logp: torch.Tensor  # float16 [len(reply), k]
    stop: str


@dataclass
class ShardWriter:
    out: Path
    shard_size: int
    pending: list[Sample] = field(default_factory=list)

    def next_index(self) -> int:
        return len(list(self.out.glob("shard-*.safetensors")))

    def add(self, s: Sample) -> None:
        self.pending.append(s)
        if len(self.pending) >= self.shard_size:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        from safetensors.torch import save_file

        name = f"shard-{self.next_index():05d}.safetensors"
        tokens, lines, tok_off, pos_off = [], [], 0, 0
        for s in self.pending:
            seq = s.prompt + s.reply
            tokens += seq
            lines.append({"id": s.id, "shard": name, "offset": tok_off, "prompt_len": len(s.prompt),
                          "reply_len": len(s.reply), "topk_offset": pos_off, "stop": s.stop})
            tok_off += len(seq)
            pos_off += len(s.reply)
        tmp = self.out / (name + ".tmp")
        save_file({"tokens": torch.tensor(tokens, dtype=torch.int32),
                   "topk_ids": torch.cat([s.topk_ids for s in self.pending]).contiguous(),
                   "topk_logp": torch.cat([s.topk_logp for s in self.pending]).contiguous()}, str(tmp))
        tmp.replace(self.out / name)
        with open(self.out / MANIFEST, "a", encoding="utf-8") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")
        self.pending = []


def write_settings(out: Path, info: dict, keep: tuple[str, ...]) -> None:
    """Write `info` as the directory's info.json, refusing a directory whose data was made with
    other values of the `keep` settings (a run resumes only what the same settings began)."""
    path = out / INFO
    if path.exists():
        old = json.loads(path.read_text())
        old.setdefault("generator", "engine")  # directories from before batched decoding
        if any(old.get(k) != info.get(k) for k in keep):
            raise BackendError(f"{out}: holds data made with other settings "
                               f"({ {k: old.get(k) for k in keep} }); use another --out")
    path.write_text(json.dumps(info, indent=1))


def read_manifest(out: Path) -> list[dict]:
    path = out / MANIFEST
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
