"""`specchat train prompts`: training prompts written by the target itself (Magpie: Xu et al. 2024,
"Alignment Data Synthesis from Scratch by Prompting Aligned LLMs with Nothing", arXiv 2406.08464).

Given its chat template up to the start of a user turn and nothing more, an instruction-tuned
model writes the kind of request it was tuned on. Sampled at temperature ~1 with a seed per
prompt, these are far more varied than a fixed prompt set (drafters trained on the target's
replies to 427 self-instruct tasks generalise poorly), and they need no dataset and no network.
Kept: prompts that end (the model closed the user turn) within `max_tokens`, once each.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from specchat.backends.base import BackendError, Sampling
from specchat.train.progress import bar

_SENTINEL = "\x00specchat-user-turn\x00"
MIN_CHARS = 12  # shorter "prompts" are mostly greetings and fragments


def user_turn_prefix(tokenizer, system: str | None, history: list[dict] = ()) -> list[int]:
    """Token ids of the chat template up to where a user's text would start (after `history`, the
    turns so far: a follow-up question is written the same way as a first one)."""
    messages = ([{"role": "system", "content": system}] if system else []) + list(history) + \
        [{"role": "user", "content": _SENTINEL}]
    text = tokenizer.hf.apply_chat_template(messages, tokenize=False)
    if _SENTINEL not in text:
        raise BackendError("the target's chat template does not place the user's text verbatim; "
                           "self-written prompts need a template that does")
    return tokenizer.hf(text[:text.index(_SENTINEL)], add_special_tokens=False)["input_ids"]


def settings_path(prompts_file: Path) -> Path:
    """Where `train prompts` records how it wrote a prompt file (read back for re-train commands)."""
    return prompts_file.with_name(prompts_file.stem + ".info.json")


def remake_command(prompts_file: Path) -> str | None:
    """The `specchat train prompts` command that writes `prompts_file` again, or None when it was
    not written by `train prompts`."""
    info_path = settings_path(prompts_file)
    if not info_path.exists():
        return None
    info = json.loads(info_path.read_text())
    count = sum(1 for line in prompts_file.read_text(encoding="utf-8").splitlines() if line.strip()) \
        if prompts_file.exists() else info["count"]
    return (f"specchat train prompts --target {info['target']} --out {prompts_file} --count {count} "
            f"--max-tokens {info['max_tokens']} --temperature {info['temperature']} --top-p {info['top_p']} "
            f"--batch {info['batch']} --seed {info['seed']} --dtype {info['dtype']}")


def _existing(out: Path) -> tuple[list[dict], int]:
    """Records already written (a run resumes) and the next seed offset to use."""
    if not out.exists():
        return [], 0
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines() if line.strip()]
    return records, max((r.get("attempt", -1) for r in records), default=-1) + 1


def make_prompts(profile, out: Path, count: int, temperature: float = 1.0, top_p: float = 0.95,
                 max_tokens: int = 96, batch: int = 48, seed: int = 0, dtype: str = "bfloat16",
                 say=print) -> dict:
    """Append self-written prompts to `out` (jsonl, `{"id", "prompt", "attempt"}`) until it holds `count`."""
    from specchat.train.batched import batched_model, generate_batch

    if count < 1 or batch < 1:
        raise BackendError("--count and --batch must be at least 1")
    records, attempt = _existing(out)
    seen = {r["prompt"] for r in records}
    if len(records) >= count:
        say(f"{out}: already holds {len(records)} prompts")
        return {"prompts": len(records), "attempts": attempt}
    model, tokenizer = batched_model(profile, dtype)
    prefix = user_turn_prefix(tokenizer, profile.system)
    eos = tokenizer.eos_ids
    sampling = Sampling(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed)
    give_up = attempt + 20 * count  # a model that never closes the user turn must not loop forever
    out.parent.mkdir(parents=True, exist_ok=True)
    settings_path(out).write_text(json.dumps({
        "target": profile.name, "count": count, "max_tokens": max_tokens, "temperature": temperature,
        "top_p": top_p, "batch": batch, "seed": seed, "dtype": dtype}, indent=1))
    started, unfinished, repeated = time.perf_counter(), 0, 0
    with out.open("a", encoding="utf-8") as f, bar("prompts", count, len(records)) as update:
        while len(records) < count and attempt < give_up:
            seeds = [seed * 1_000_003 + attempt + i for i in range(batch)]
            samples = generate_batch(model, [prefix] * batch, sampling, 1, eos, min(eos), seeds=seeds)
            kept = 0
            for i, s in enumerate(samples):
                if s.stop != "eos":
                    unfinished += 1
                    continue
                text = tokenizer.decode(s.reply[:-1]).strip()
                if len(text) < MIN_CHARS or text in seen:
                    repeated += 1
                    continue
                seen.add(text)
                rec = {"id": f"self-{seed}-{attempt + i}", "prompt": text, "attempt": attempt + i}
                records.append(rec)
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                kept += 1
                if len(records) >= count:
                    break
            f.flush()
            attempt += batch
            update(kept, status=f"{attempt / (time.perf_counter() - started):.1f} tries/s")
    if len(records) < count:
        say(f"stopped after {attempt} tries: the target closed the user turn within {max_tokens} tokens too "
            f"rarely ({len(records)} prompts); raise --max-tokens")
    say(f"{out}: {len(records)} prompts ({unfinished} ran past {max_tokens} tokens, {repeated} too short or repeated)")
    return {"prompts": len(records), "attempts": attempt, "unfinished": unfinished, "repeated": repeated}
