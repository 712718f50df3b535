"""`specchat train cost`: what one draft token costs, per drafter shape, next to the target's own
single-token forward, measured with the engine that will run them (random weights, same vocabulary).

A drafter pays off only when (tokens per pass) / (1 + depth * draft cost / target cost) > 1, so its
per-token cost must stay small next to the target's."""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch


def per_token_ms(engine, n: int = 24, prompt_len: int = 64) -> float:
    """Median wall time of a single-token forward after a prompt, in milliseconds."""
    engine.truncate(0)
    engine.forward(list(range(10, 10 + prompt_len)), 0, all_logits=False)
    times = []
    for i in range(n):
        t = time.perf_counter()
        engine.forward([100 + i], prompt_len + i, all_logits=False)
        times.append(time.perf_counter() - t)
    times.sort()
    return 1000 * times[len(times) // 2]


def measure(profile, shapes, threads: int = 1, say=print) -> list[dict]:
    from transformers import LlamaForCausalLM

    from specchat.loading import load_target
    from specchat.train.draft import draft_config, target_parts

    from transformers.utils import logging

    logging.disable_progress_bar()
    target = load_target(profile, threads=threads)
    rows = [{"model": "target", "ms_per_token": per_token_ms(target)}]
    say(f"target ({profile.name}): {rows[0]['ms_per_token']:.2f} ms/token")
    _, tcfg, tokenizer = target_parts(profile)
    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes:
            d = Path(tmp) / f"l{shape.layers}h{shape.hidden}"
            torch.manual_seed(0)
            model = LlamaForCausalLM(draft_config(shape, tcfg, tokenizer)).to(torch.bfloat16)
            model.save_pretrained(str(d))
            tokenizer.hf.save_pretrained(str(d))
            engine = TorchBackend(d, "hf_dir", threads=threads, context=512)
            ms = per_token_ms(engine)
            size = sum(p.numel() for p in model.parameters()) * 2 / 1e6  # tied head counted once
            rows.append({"model": f"{shape.layers} layer(s), hidden {shape.hidden}", "layers": shape.layers,
                         "hidden": shape.hidden, "ms_per_token": ms, "ratio": ms / rows[0]["ms_per_token"],
                         "mb_bf16": size})
            say(f"{rows[-1]['model']}: {ms:.2f} ms/token ({rows[-1]['ratio']:.2f} x target), {size:.1f} MB")
            engine.close()
    target.close()
    return rows
