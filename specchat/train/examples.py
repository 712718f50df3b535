"""The training data as the trainers read it: every sample of `specchat train data` directories,
split into training and held-out sets by source task, and a batch schedule that is a pure
function of its arguments (so a resumed run sees the same data)."""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from specchat.backends.base import BackendError
from specchat.backends.weight_files import load_safetensors
from specchat.train.store import SHARD_FIX, read_manifest


@dataclass
class Example:
    id: str
    tokens: torch.Tensor  # int64 prompt + reply
    prompt_len: int
    topk_ids: torch.Tensor  # int64 [reply, k]
    topk_logp: torch.Tensor  # float32 [reply, k]


def load_examples(dirs: list[Path], max_prompt_tokens: int | None = None) -> list[Example]:
    """Every sample of the data directories (a prompt id seen twice is kept once), sorted by id;
    with `max_prompt_tokens`, only samples whose prompt is at most that long (long documents cost
    the target's feature pass far more than their replies add)."""
    seen: dict[str, Example] = {}
    for data in dirs:
        manifest = read_manifest(data)
        if not manifest:
            raise BackendError(f"{data}: no training samples (manifest.jsonl); run `specchat train data` first")
        shards: dict[str, dict] = {}
        for m in manifest:
            if m["reply_len"] == 0 or m["id"] in seen or (max_prompt_tokens and m["prompt_len"] > max_prompt_tokens):
                continue
            sh = shards.setdefault(m["shard"], load_safetensors(data / m["shard"], SHARD_FIX))
            n = m["prompt_len"] + m["reply_len"]
            lo = m["topk_offset"]
            seen[m["id"]] = Example(m["id"], sh["tokens"][m["offset"]:m["offset"] + n].long(), m["prompt_len"],
                                    sh["topk_ids"][lo:lo + m["reply_len"]].long(),
                                    sh["topk_logp"][lo:lo + m["reply_len"]].float())
    return [seen[k] for k in sorted(seen)]


def source_task(example_id: str) -> str:
    """The prompt an example derives from: `--variants` ids are `<task id>~<kind>`."""
    return example_id.split("~", 1)[0]


def split(examples: list[Example], holdout: float, seed: int) -> tuple[list[Example], list[Example]]:
    """Held-out examples for about `holdout` of the data, whole source tasks at a time: a reply
    to "summarise X" in training and one to "explain X" held out would measure memory of X."""
    groups: dict[str, list[int]] = {}
    for i, e in enumerate(examples):
        groups.setdefault(source_task(e.id), []).append(i)
    keys = sorted(groups)
    random.Random(seed).shuffle(keys)
    n_eval = max(1, round(len(examples) * holdout)) if len(keys) > 1 and holdout > 0 else 0
    ev: list[int] = []
    for key in keys:
        if len(ev) >= n_eval:
            break
        ev += groups[key]
    held = set(ev)
    return ([e for i, e in enumerate(examples) if i not in held], [e for i, e in enumerate(examples) if i in held])


def schedule(n: int, lengths: list[int], batch_tokens: int, seed: int, steps: int) -> list[list[int]]:
    """Batches of example indices for every step: seeded epoch permutations, cut into batches of
    about `batch_tokens` tokens. A pure function of its arguments, so a resumed run sees the same data."""
    batches: list[list[int]] = []
    epoch = 0
    while len(batches) < steps:
        order = list(range(n))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        cur, size = [], 0
        for i in order:
            cur.append(i)
            size += lengths[i]
            if size >= batch_tokens:
                batches.append(cur)
                cur, size = [], 0
        if cur:
            batches.append(cur)
        epoch += 1
    return batches[:steps]
