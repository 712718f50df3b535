"""`specchat train tasks`: training data of the kinds users bring, written by the target alone.

A drafter learns what the target does on the text it sees. Replies to short instructions teach
it little about what users ask for: long documents to summarise, question, translate and edit;
conversations that go on; arithmetic worked step by step; code written and then changed. None of
that needs a dataset: the target writes the material, then works on it, in stages:

- `documents`: it writes an article, report, letter or story on a subject; then summarises it,
  lists its key points, edits it, translates it into another language, writes a question about
  it; then answers that question from the document and translates its own translation back.
- `conversations`: it writes a user's first message (Magpie: the chat template up to a user's
  text and nothing more), answers it, writes the user's follow-up the same way, answers that.
- `math`: it poses a word problem on a subject, then solves it step by step.
- `code`: it writes a small Python function on a subject; then explains it, adds type hints and
  comments, writes tests for it and rewrites it.

Every assistant reply is a sample (`KIND:ITEM~STAGE`, in a `train data` directory); the user
turns the target wrote for `conversations` are only prompts. Material is sampled (varied, one seed
per item), work on it is greedy. Items run through all their stages a batch at a time and are
written together, so an interrupted run resumes at the first unwritten batch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

from specchat.backends.base import BackendError, Sampling
from specchat.train import batched_generator, generator_dtype
from specchat.train.progress import bar
from specchat.train.self_prompts import MIN_CHARS, user_turn_prefix

KINDS = ("documents", "conversations", "math", "code")

# Subjects and forms only steer what the target writes about; the text is all its own.
SUBJECTS = (
    "a city's new bicycle lanes", "a drought on small farms", "a school's robotics club", "a rare bird's return",
    "a hospital's night shift", "the history of the printing press", "a local bakery that doubled its staff",
    "volcanoes", "saving for retirement", "a marathon in the rain", "honeybees", "a museum's new wing",
    "solar panels on apartment roofs", "learning a second language", "a football club's new coach",
    "the water cycle", "a library's late-fee amnesty", "electric buses", "a village festival",
    "a software company's layoffs", "sleep and memory", "the moon landing", "a flood in a river town",
    "a chess tournament", "recycling plastic", "a startup selling plant-based cheese", "the Roman aqueducts",
    "a heat wave in Europe", "remote work", "a new vaccine trial", "coral reefs", "a train strike",
    "the invention of the telephone", "a family restaurant", "earthquake safety", "a space telescope",
    "a music school for children", "the price of coffee", "a mountain rescue", "online privacy",
)
FORMS = ("news article", "encyclopedia entry", "report", "blog post", "letter", "short story")
LANGUAGES = ("German", "French", "Spanish", "Italian", "Portuguese")
EDITS = ("Rewrite the following text so that it is clearer and more formal.",
         "Shorten the following text to half its length, keeping every fact.",
         "Fix any mistakes in the following text and improve its style.")
# One worked pattern for the problems (a small model echoes "two steps of arithmetic" when asked for them).
MATH_EXAMPLES = ("Tom has 12 apples. He gives 5 to his sister and buys 8 more. How many apples does he have now?",
                 "A bus carries 34 people. At the first stop 9 get off and 15 get on. How many people are on the bus?",
                 "Anna saves $6 a week for 7 weeks and then spends $18 on a book. How much money does she have left?",
                 "A garden has 4 rows of 9 plants. 7 plants die. How many plants are left?")
MIN_DOCUMENT_CHARS = 400  # shorter "documents" are refusals and fragments: nothing to work on
MIN_TRANSLATION_CHARS = 200
MIN_PROBLEM_CHARS = 40
CODE_EDITS = ("Add type hints and comments to this Python code.",
              "Rewrite this Python function so that it is shorter and easier to read.")


@dataclass(frozen=True)
class Stage:
    """One step of an item: `ask` builds the conversation from the texts written so far (None: the
    item has nothing for this stage); `user` stages write a user turn (a prompt, not a sample)."""
    name: str
    ask: object  # (item: int, texts: dict[str, str]) -> list[dict] | None
    max_tokens: int
    sampled: bool = False
    user: bool = False


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _subject(i: int) -> str:
    return SUBJECTS[i % len(SUBJECTS)]


def _documents() -> list[Stage]:
    def write(i, t):
        form = FORMS[(i + i // len(SUBJECTS)) % len(FORMS)]  # every pairing, in turn
        return _user(f"Write a {form} of about 300 words about {_subject(i)}.")

    def doc(t, ask):
        return _user(f"{ask}\n\n{t['write']}") if len(t.get("write", "")) >= MIN_DOCUMENT_CHARS else None

    def language(i):
        return LANGUAGES[i % len(LANGUAGES)]

    return [
        Stage("write", write, 384, sampled=True),
        Stage("summary", lambda i, t: doc(t, "Summarize the following text in a few sentences."), 160),
        Stage("points", lambda i, t: doc(t, "List the key points of the following text."), 160),
        Stage("edit", lambda i, t: doc(t, EDITS[i % len(EDITS)]), 384),
        Stage("translate", lambda i, t: doc(t, f"Translate the following text into {language(i)}."), 384),
        Stage("question", lambda i, t: doc(t, "Write one question that the following text answers. "
                                              "Write only the question."), 48),
        Stage("answer", lambda i, t: _user("Answer the question using the document below.\n\nDocument: "
                                           f"{t['write']}\n\nQuestion: {t['question']}")
              if t.get("question") and len(t["write"]) >= MIN_DOCUMENT_CHARS else None, 160),
        Stage("back", lambda i, t: _user(f"Translate the following {language(i)} text into English.\n\n"
                                         f"{t['translate']}")
              if len(t.get("translate", "")) >= MIN_TRANSLATION_CHARS else None, 384),
    ]


def _conversations() -> list[Stage]:
    def turns(t, upto):
        names = ("first", "reply", "follow", "reply2")[:upto]
        return [{"role": "user" if n in ("first", "follow") else "assistant", "content": t[n]} for n in names]

    return [
        Stage("first", lambda i, t: [], 128, sampled=True, user=True),
        Stage("reply", lambda i, t: turns(t, 1) if t.get("first") else None, 256),
        Stage("follow", lambda i, t: turns(t, 2) if t.get("reply") else None, 96, sampled=True, user=True),
        Stage("reply2", lambda i, t: turns(t, 3) if t.get("follow") else None, 256),
    ]


def _math() -> list[Stage]:
    return [
        Stage("problem", lambda i, t: _user(
            f"Write a math word problem for a school student about {_subject(i)}, with numbers, like this one: "
            f"\"{MATH_EXAMPLES[i % len(MATH_EXAMPLES)]}\" Write only the new problem."), 128, sampled=True),
        Stage("solution", lambda i, t: _user(f"{t['problem']}\n\nSolve this step by step, then give the final answer.")
              if len(t.get("problem", "")) >= MIN_PROBLEM_CHARS else None, 256),
    ]


def _code() -> list[Stage]:
    def on_code(t, ask):
        return _user(f"{ask}\n\n{t['write']}") if "def " in t.get("write", "") else None

    return [
        Stage("write", lambda i, t: _user(f"Write a short Python function for a program about {_subject(i)}, "
                                          "with a docstring."), 256, sampled=True),
        Stage("explain", lambda i, t: on_code(t, "Explain step by step what this code does."), 256),
        Stage("edit", lambda i, t: on_code(t, CODE_EDITS[i % len(CODE_EDITS)]), 256),
        Stage("tests", lambda i, t: on_code(t, "Write unit tests with pytest for this code."), 256),
    ]


PIPELINES = {"documents": _documents, "conversations": _conversations, "math": _math, "code": _code}


def item_id(kind: str, item: int, stage: str) -> str:
    return f"{kind}:{item}~{stage}"


def make_tasks(profile, kind: str, out: Path, count: int, top_k: int = 32, temperature: float = 0.8,
               seed: int = 0, batch: int = 16, dtype: str = "bfloat16", max_tokens: int | None = None,
               say=print) -> dict:
    """Run `count` items of `kind` through their stages into the data directory `out` (resumable).
    `max_tokens` caps every stage's reply length (each stage has its own, up to 384)."""
    from specchat.train.batched import batched_model
    from specchat.train.data import check_torch_target
    from specchat.train.store import ShardWriter, read_manifest, write_settings

    if kind not in PIPELINES:
        raise BackendError(f"--kind {kind}: one of {', '.join(KINDS)}")
    check_torch_target(profile)
    if count < 1 or batch < 1:
        raise BackendError("--count and --batch must be at least 1")
    stages = PIPELINES[kind]()
    if max_tokens:
        stages = [replace(s, max_tokens=min(s.max_tokens, max_tokens)) for s in stages]
    out.mkdir(parents=True, exist_ok=True)
    info = {"target": profile.name, "model": profile.model, "kind": kind, "count": count, "top_k": top_k,
            "temperature": temperature, "seed": seed, "batch": batch, "generator": batched_generator(dtype),
            "max_tokens": max(s.max_tokens for s in stages), "max_tokens_cap": max_tokens, "prompt_files": [],
            "stages": {s.name: {"max_tokens": s.max_tokens, "sampled": s.sampled, "user_turn": s.user}
                       for s in stages}}
    write_settings(out, info, ("target", "kind", "top_k", "temperature", "seed", "generator", "stages"))
    done = {m["id"].split("~")[0] for m in read_manifest(out)}
    todo = [i for i in range(count) if f"{kind}:{i}" not in done]
    say(f"{kind}: {count} items, {count - len(todo)} already in {out}, {len(todo)} to write")
    if not todo:
        return info
    model, tokenizer = batched_model(profile, dtype)
    started, n_tokens = time.perf_counter(), 0
    with bar(f"{kind} items", count, count - len(todo)) as update:
        for at in range(0, len(todo), batch):
            items = todo[at:at + batch]
            writer = ShardWriter(out, shard_size=10**9)  # one shard per batch of items: all or nothing
            for item, stage, sample in _run_stages(model, tokenizer, profile, stages, items, temperature, seed,
                                                   top_k):
                sample.id = item_id(kind, item, stage)
                writer.add(sample)
                n_tokens += len(sample.reply)
            writer.flush()
            update(len(items), status=f"{n_tokens / (time.perf_counter() - started):.0f} tok/s")
    say(f"{len(todo)} {kind} items, {n_tokens} reply tokens in {time.perf_counter() - started:.0f}s -> {out}")
    return info


def _run_stages(model, tokenizer, profile, stages: list[Stage], items: list[int], temperature: float, seed: int,
                top_k: int):
    """(item, stage name, sample) for every reply of `items`, each stage decoded as one batch."""
    from specchat.loading import messages_for
    from specchat.train.batched import generate_batch

    eos = tokenizer.eos_ids
    texts: dict[int, dict[str, str]] = {i: {} for i in items}
    for stage in stages:
        jobs = []
        for i in items:
            history = stage.ask(i, texts[i])
            if history is None:
                continue
            history = messages_for(profile, history)
            ids = user_turn_prefix(tokenizer, None, history) if stage.user else tokenizer.encode_chat(history)
            if len(ids) + stage.max_tokens <= profile.context:
                jobs.append((i, ids))
        if not jobs:
            continue
        sampling = Sampling(temperature=temperature if stage.sampled else 0.0, seed=seed, max_tokens=stage.max_tokens)
        seeds = [seed * 1_000_003 + i for i, _ in jobs] if stage.sampled else None
        samples = generate_batch(model, [ids for _, ids in jobs], sampling, min(top_k, model.config.vocab_size),
                                 eos, min(eos), seeds=seeds)
        for (i, _), sample in zip(jobs, samples):
            if stage.user and sample.stop != "eos":
                continue  # a user turn the target never closed is no prompt
            text = tokenizer.decode(sample.reply).strip()
            if stage.user and len(text) < MIN_CHARS:
                continue
            texts[i][stage.name] = text
            if not stage.user:
                yield i, stage.name, sample


def remake_command(info: dict, out: Path) -> str:
    """The `specchat train tasks` command that makes the data directory `out` again (card.py)."""
    dtype = generator_dtype(info["generator"])
    return (f"specchat train tasks --target {info['target']} --kind {info['kind']} --count {info['count']} "
            f"--out {out} --top-k {info['top_k']} --temperature {info['temperature']} --seed {info['seed']} "
            f"--batch {info['batch']} --dtype {dtype}" +
            (f" --max-tokens {info['max_tokens_cap']}" if info.get("max_tokens_cap") else ""))
