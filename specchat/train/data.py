"""`specchat train data`: the target answers training prompts; its replies and top-k distributions
are stored for distillation (the directory's layout: store.py).

Resumable: prompts whose id is already in the manifest are skipped.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from specchat.backends.base import BackendError, Sampling
from specchat.prompts import PromptItem, load_prompts
from specchat.train import batched_generator
from specchat.train.progress import bar
from specchat.train.store import Sample, ShardWriter, read_manifest, write_settings
from specchat.train.variants import derived_prompts, self_instruct_tasks

def training_prompts(files: list[str], limit: int | None = None, instances: bool = False,
                     variants: bool = False) -> list[PromptItem]:
    """Prompts from jsonl files; Spec-Bench (evaluation only) is refused.

    With `instances`, every instance input of a self-instruct task becomes its own prompt; with
    `variants`, the prompts derived from each task (specchat/train/variants.py) follow its own.
    """

    items: list[PromptItem] = []
    for f in files:
        path = Path(f)
        if "spec-bench" in str(path.resolve()).lower():
            raise BackendError(f"{f}: Spec-Bench is evaluation data; never train a drafter on it")
        first = next((line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()), "") \
            if path.exists() else ""
        if '"question_id"' in first and '"turns"' in first:
            raise BackendError(f"{f}: looks like Spec-Bench/MT-Bench (question_id, turns), which is evaluation "
                               "data; train on the self-instruct prompts instead")
        tag = path.stem
        loaded = load_prompts(path)
        if instances and path.suffix == ".jsonl":
            loaded = _instance_prompts(path) or loaded
        items += [PromptItem(f"{tag}:{it.id}", it.turns, it.category) for it in loaded]
        if variants and path.suffix == ".jsonl":
            items += derived_prompts(path, tag)
    if limit:
        items = items[:limit]
    return items


def _instance_prompts(path: Path) -> list[PromptItem]:
    out = []
    for n, rec in self_instruct_tasks(path):
        inputs = [i.get("input", "") for i in rec.get("instances", [])] or [""]
        for j, inp in enumerate(inputs):
            text = rec["instruction"] + (f"\n\n{inp}" if inp else "")
            out.append(PromptItem(f"{rec.get('id', n)}" + (f"#{j}" if j else ""), [text]))
    return out


def check_torch_target(profile) -> None:
    """Training data is written by the target on the torch engine (or transformers' model of it)."""
    if profile.backend != "torch":
        raise BackendError(f"profile '{profile.name}' uses backend '{profile.backend}'; training data needs "
                           "the torch engine (backend: torch)")


def generate(engine, prompt: list[int], sampling: Sampling, top_k: int) -> Sample:
    """Decode with the target, keeping its top-k log-probabilities at every reply position.

    The same steps as the engine's own stream (prefill, then one token per forward), so greedy
    replies are exactly what target-only decoding produces."""
    logits = engine.prefill(prompt)  # reuses the cached common prefix (system prompt)
    reply, ids, logps = [], [], []
    pos, stop = len(prompt), "max_tokens"
    while True:
        logp = torch.log_softmax(logits[-1].float(), dim=-1)
        v, i = logp.topk(top_k)
        ids.append(i.to(torch.int32))
        logps.append(v.to(torch.float16))
        token = int(engine.sample(logits[-1:], [pos], sampling)[0])
        reply.append(token)
        if token in engine.eos_ids:
            stop = "eos"
            break
        if len(reply) >= sampling.max_tokens or pos + 1 >= engine.context_length:
            break
        logits, _ = engine.forward([token], pos, all_logits=False)
        pos += 1
    return Sample("", list(prompt), reply, torch.stack(ids), torch.stack(logps), stop)


def make_data(profile, prompt_files: list[str], out: Path, max_tokens: int = 128, limit: int | None = None,
              top_k: int = 32, temperature: float = 0.0, seed: int = 0, instances: bool = False,
              shard_size: int = 32, variants: bool = False, batch: int = 1, dtype: str = "bfloat16",
              say=print) -> dict:
    """batch > 1: replies come from transformers' model of the target (in `dtype`) in batches of
    that size (specchat/train/batched.py), several times the engine's one-at-a-time decoding."""

    check_torch_target(profile)
    prompts = training_prompts(prompt_files, limit, instances, variants)
    if not prompts:
        raise BackendError("no training prompts found in " + ", ".join(prompt_files))
    out.mkdir(parents=True, exist_ok=True)
    info = {"target": profile.name, "model": profile.model, "max_tokens": max_tokens, "top_k": top_k,
            "temperature": temperature, "seed": seed, "prompt_files": [str(f) for f in prompt_files],
            "instances": instances, "variants": variants, "limit": limit, "batch": batch,
            "generator": "engine" if batch <= 1 else batched_generator(dtype)}
    write_settings(out, info, ("target", "max_tokens", "top_k", "temperature", "seed", "generator"))
    done = {m["id"] for m in read_manifest(out)}
    todo = [p for p in prompts if p.id not in done]
    say(f"{len(prompts)} prompts, {len(prompts) - len(todo)} already in {out}, {len(todo)} to generate")
    if not todo:
        return info
    sampling = Sampling(temperature=temperature, seed=seed, max_tokens=max_tokens)
    writer = ShardWriter(out, shard_size)
    started = time.perf_counter()
    run = _answer_batched if batch > 1 else _answer_one_by_one
    try:
        n_tokens = run(profile, todo, sampling, top_k, writer, len(prompts), batch, dtype)
    finally:
        writer.flush()
    say(f"{len(todo)} replies, {n_tokens} tokens in {time.perf_counter() - started:.0f}s -> {out}")
    return info


def _answer_one_by_one(profile, todo: list[PromptItem], sampling: Sampling, top_k: int, writer: ShardWriter,
                       total: int, batch: int, dtype: str) -> int:
    from specchat.loading import load_target, messages_for

    engine = load_target(profile)
    started, n_tokens = time.perf_counter(), 0
    try:
        with bar("target answers", total, total - len(todo)) as update:
            for item in todo:
                prompt = engine.tokenize_chat(messages_for(profile, [{"role": "user", "content": item.first}]))
                if len(prompt) + 2 > engine.context_length:
                    update(status=f"skipped {item.id}: prompt too long")
                    continue
                sample = generate(engine, prompt, sampling, min(top_k, engine.model.cfg.vocab_size))
                sample.id = item.id
                writer.add(sample)
                n_tokens += len(sample.reply)
                update(status=f"{n_tokens / (time.perf_counter() - started):.0f} tok/s")
    finally:
        engine.close()
    return n_tokens


def _answer_batched(profile, todo: list[PromptItem], sampling: Sampling, top_k: int, writer: ShardWriter,
                    total: int, batch: int, dtype: str) -> int:
    from specchat.loading import messages_for
    from specchat.train.batched import batched_model, generate_batch

    model, tokenizer = batched_model(profile, dtype)
    eos = tokenizer.eos_ids
    prompts = []
    for item in todo:
        ids = tokenizer.encode_chat(messages_for(profile, [{"role": "user", "content": item.first}]))
        if len(ids) + sampling.max_tokens <= profile.context:
            prompts.append((item.id, ids))
    prompts.sort(key=lambda p: len(p[1]))  # similar lengths together: little padding
    started, n_tokens = time.perf_counter(), 0
    with bar("target answers", total, total - len(todo)) as update:
        for at in range(0, len(prompts), batch):
            chunk = prompts[at:at + batch]
            for (pid, _), sample in zip(chunk, generate_batch(model, [ids for _, ids in chunk], sampling,
                                                               min(top_k, model.config.vocab_size), eos, min(eos))):
                sample.id = pid
                writer.add(sample)
                n_tokens += len(sample.reply)
            update(len(chunk), status=f"{n_tokens / (time.perf_counter() - started):.0f} tok/s")
    return n_tokens
