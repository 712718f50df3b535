"""`specchat bench`: a prompt set through one or more profiles, measured in one run.

Every later speed figure comes from here. Speed-ups are ratios against the target-only
reference of the same model measured in the same run (added automatically when the run has
none), because absolute tok/s on a shared machine drift from run to run.
"""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Optional

from specchat import suffix_memory
from specchat.backends.base import Backend, Request, Summary, run_to_summary
from specchat.loading import load_backend, messages_for, sampling_of
from specchat.models import NAMED_MODELS
from specchat.profiles import Profile
from specchat.prompts import PromptItem
from specchat.under_load import LoadRun, run_under_load


@dataclass
class Run:
    prompt: PromptItem
    summary: Summary
    memory: Optional[tuple[int, int]] = None  # (replies, tokens) its suffix memory held as it started


@dataclass
class ProfileResult:
    label: str
    profile: Profile
    runs: list[Run] = field(default_factory=list)
    reference: Optional[str] = None  # label of the target-only row this one is compared with
    load_s: float = 0.0
    repeat: int = 1  # times each prompt was run; `runs` holds each prompt's median run (median_run)
    under_load: Optional[LoadRun] = None  # the prompts again with several in flight (bench --concurrency)
    caveat: Optional[str] = None  # the backend's own line on how it runs below its best here

    def subset(self, task: Optional[str]) -> list[Summary]:
        return [r.summary for r in self.runs if task is None or r.prompt.task == task]

    def decode_tok_s(self, task: Optional[str] = None) -> float:
        vals = [s.decode_tok_s for s in self.subset(task) if s.decode_tok_s > 0]
        return statistics.median(vals) if vals else 0.0

    def ttft_s(self, task: Optional[str] = None) -> float:
        vals = [s.ttft_s for s in self.subset(task)]
        return statistics.median(vals) if vals else 0.0

    def mean_accepted(self, task: Optional[str] = None) -> float:
        """Tokens per drafted pass (Summary.mean_accepted over these runs)."""
        subs = self.subset(task)
        drafts = sum(s.drafts for s in subs)
        return 1.0 + sum(s.accepted_tokens for s in subs) / drafts if drafts else 1.0

    def tokens_per_pass(self, task: Optional[str] = None) -> float:
        """Tokens emitted per target pass over every pass, drafted or not (what pays for the
        drafting; `mean_accepted` counts only passes that verified a draft)."""
        subs = self.subset(task)
        passes = sum(s.passes for s in subs)
        return sum(s.tokens for s in subs) / passes if passes else 0.0

    def acceptance_by_position(self, task: Optional[str] = None) -> list[float]:
        acc: list[int] = []
        dr: list[int] = []
        for s in self.subset(task):
            for i, (a, d) in enumerate(zip(s.accepted_per_position, s.drafts_per_position)):
                if i >= len(acc):
                    acc.append(0)
                    dr.append(0)
                acc[i] += a
                dr[i] += d
        return [a / d if d else 0.0 for a, d in zip(acc, dr)]

    def tokens(self) -> int:
        return sum(s.tokens for s in self.subset(None))

    def memory(self) -> Optional[dict]:
        """How warm its suffix memory was over the run: replies and tokens held at the first and
        the last prompt (None: no memory)."""
        held = [r.memory for r in self.runs if r.memory is not None]
        if not held:
            return None
        return {"replies": [held[0][0], held[-1][0]], "tokens": [held[0][1], held[-1][1]]}


def _target_run(p: Profile) -> dict:
    """Everything that decides how a profile's target decodes (all but its name and speculation)."""
    settings = p.model_dump(exclude={"name", "description", "extends", "speculative", "source"})
    path = p.resolve_path(p.model)  # a file path is relative to its profile; a model name or hub id is not
    settings["model"] = str(path.resolve()) if p.model not in NAMED_MODELS and path.exists() else p.model
    if p.backend == "llamaserver":  # its speculative settings are not the target's
        settings["llama_server"] = p.server_config.model_dump(exclude={"ngram_type", "spec_args", "p_min", "port"})
    return settings


def _is_reference_for(ref: Profile, p: Profile) -> bool:
    """A target-only row measures p's speed-up only if it runs p's target exactly as p does
    (same model, precision, device, threads, context, system prompt and sampling)."""
    return ref.method == "none" and _target_run(ref) == _target_run(p)


def plan(profiles: list[Profile]) -> list[tuple[str, Profile, Optional[str]]]:
    """Rows to run: each profile, plus a target-only reference for speculative ones lacking it."""
    rows: list[tuple[str, Profile, Optional[str]]] = []
    for p in profiles:
        rows.append((p.name, p, None))
        if p.backend == "torch" and p.speculative.suffix_drafts and p.speculative.suffix.history:
            # its speed-up is read against the same drafter without the memory of earlier replies
            rows.append((f"{p.name}{EMPTY_HISTORY}", p.with_overrides({"speculative.suffix.history": False}), None))
    for i, (label, p, _) in enumerate(list(rows)):
        if p.method == "none":
            continue
        ref = next((lab for lab, q, _ in rows if _is_reference_for(q, p)), None)
        if ref is None:
            ref_profile = p.target_only()
            rows.append((ref_profile.name, ref_profile, None))
            ref = ref_profile.name
        rows[i] = (label, p, ref)
    return rows


EMPTY_HISTORY = ":empty-history"  # the row of a suffix profile whose memory of earlier replies stays empty


def warm_up(backend: Backend, profile: Profile) -> None:
    sampling = replace(sampling_of(profile), max_tokens=8)
    run_to_summary(backend.stream(Request(messages=messages_for(profile, [{"role": "user", "content": "Hi"}])), sampling))


def request_for(profile: Profile, item: PromptItem) -> Request:
    from specchat.constraints import constraint_for

    return Request(messages=messages_for(profile, [{"role": "user", "content": item.first}]),
                   constraint=constraint_for(profile, item))


def run_one(backend: Backend, profile: Profile, item: PromptItem) -> Run:
    return Run(item, run_to_summary(backend.stream(request_for(profile, item), sampling_of(profile))))


def measure_under_load(res: ProfileResult, backend: Backend, concurrency: int) -> None:
    """The row's prompts again with `concurrency` in flight at all times (under_load.py): the
    throughput then, and which replies changed against the row's own runs."""
    requests = [request_for(res.profile, run.prompt) for run in res.runs]
    res.under_load = run_under_load(backend, requests, [run.summary for run in res.runs], sampling_of(res.profile),
                                    concurrency)


def median_run(tries: list[Run]) -> Run:
    """The run of median decode tok/s (of an even count, the slower of the middle two): one real
    run, so that its tokens, TTFT and acceptance stay together."""
    return sorted(tries, key=lambda r: r.summary.decode_tok_s)[(len(tries) - 1) // 2]


def bench(profiles: list[Profile], prompts: list[PromptItem],
          on_run: Callable[[str, Run], None] = lambda label, r: None,
          on_load: Callable[[str], None] = lambda label: None,
          extra_rows: Iterable[tuple[str, Callable[[], Backend], Profile]] = (),
          interleave: bool = True, repeat: int = 1, concurrency: int = 1) -> list[ProfileResult]:
    """Measure every row on every prompt, never two at once (they would contend for the cores).

    Interleaved (the default), all rows are loaded and take turns prompt by prompt, so that a
    slow spell of a shared machine hits every row alike and the ratios stay fair. Sequential
    loads one row at a time, for models too large to hold together. `repeat`: each prompt runs
    that many times per row (taking turns each time) and the row keeps its median run.
    `concurrency` > 1 (server rows): then every row's prompts again, that many in flight at once."""
    if repeat < 1:
        raise ValueError(f"repeat must be 1 or more, not {repeat}")
    rows = [(label, (lambda p=p: load_backend(p)), p, ref) for label, p, ref in plan(profiles)]
    rows += [(label, factory, p, None) for label, factory, p in extra_rows]
    results = [ProfileResult(label, profile, reference=ref, repeat=repeat) for label, _, profile, ref in rows]
    factories = [factory for _, factory, _, _ in rows]

    def load(res: ProfileResult, factory) -> Backend:
        on_load(res.label)
        t0 = time.perf_counter()
        backend = factory()
        res.load_s = time.perf_counter() - t0
        res.caveat = backend.caveat
        warm_up(backend, res.profile)
        return backend

    def measure(res: ProfileResult, backend: Backend, item: PromptItem, tries: list[Run]) -> None:
        memory = suffix_memory.memory_of(backend)
        run = run_one(backend, res.profile, item)
        if memory is not None:
            run.memory = (memory.sequences, memory.live_tokens)
        tries.append(run)
        on_run(res.label, run)
        if len(tries) == repeat:
            kept = median_run(tries)
            res.runs.append(kept)
            # the earlier prompts' replies warm the memory (never the user's history: the run is
            # reproducible), each once all its tries ran, so that no try drafts from its own reply
            suffix_memory.remember(backend, None, None, kept.summary.token_ids)

    loaded: list[Backend] = []
    try:
        if interleave:
            loaded = [load(res, factory) for res, factory in zip(results, factories)]
            for item in prompts:
                tries: list[list[Run]] = [[] for _ in results]
                for _ in range(repeat):
                    for res, backend, row_tries in zip(results, loaded, tries):
                        measure(res, backend, item, row_tries)
            for res, backend in zip(results, loaded) if concurrency > 1 else ():
                measure_under_load(res, backend, concurrency)
        else:
            for res, factory in zip(results, factories):
                loaded = [load(res, factory)]
                for item in prompts:
                    row_tries: list[Run] = []
                    for _ in range(repeat):
                        measure(res, loaded[0], item, row_tries)
                if concurrency > 1:
                    measure_under_load(res, loaded[0], concurrency)
                loaded.pop().close()
                gc.collect()
    finally:
        for backend in loaded:
            backend.close()
    return results


def speedup(results: list[ProfileResult], res: ProfileResult, task: Optional[str] = None) -> Optional[float]:
    ref = next((r for r in results if r.label == res.reference), None)
    if ref is None:
        return None
    base = ref.decode_tok_s(task)
    return res.decode_tok_s(task) / base if base else None


def tasks_of(results: list[ProfileResult]) -> list[str]:
    seen: list[str] = []
    for r in results:
        for run in r.runs:
            if run.prompt.task and run.prompt.task not in seen:
                seen.append(run.prompt.task)
    return seen


def repeat_of(results: list[ProfileResult]) -> int:
    return max((r.repeat for r in results), default=1)


def to_json(results: list[ProfileResult]) -> dict:
    out = {"repeat": repeat_of(results), "statistic": "median", "rows": []}
    for r in results:
        row = {
            "label": r.label, "backend": r.profile.backend, "method": r.profile.method,
            "depth": r.profile.speculative.depth if r.profile.method != "none" else 0,
            "lookup": r.profile.speculative.lookup,
            "model": r.profile.model, "prompts": len(r.runs), "tokens": r.tokens(),
            "decode_tok_s": r.decode_tok_s(), "ttft_s": r.ttft_s(), "mean_accepted": r.mean_accepted(),
            "tokens_per_pass": r.tokens_per_pass(), "acceptance_by_position": r.acceptance_by_position(),
            "reference": r.reference, "speedup": speedup(results, r), "load_s": r.load_s,
            "suffix_memory": r.memory(), "caveat": r.caveat,
            "under_load": None if r.under_load is None else {
                "concurrency": r.under_load.concurrency, "tok_s": r.under_load.tok_s,
                "alone_tok_s": alone_tok_s(r), "changed": r.under_load.changed, "changed_at": r.under_load.changed_at},
            "by_task": {t: {"decode_tok_s": r.decode_tok_s(t), "mean_accepted": r.mean_accepted(t),
                            "tokens_per_pass": r.tokens_per_pass(t), "speedup": speedup(results, r, t),
                            "acceptance_by_position": r.acceptance_by_position(t)}
                        for t in tasks_of(results)},
        }
        out["rows"].append(row)
    return out


TASK_HEADERS = {"mt_bench": "mt-bench", "translation": "transl", "summarization": "summ", "math_reasoning": "math"}


def tok_s(value: float) -> str:
    """Decode tok/s in at most 5 characters: 8.3, 102.9, 1234."""
    return f"{value:.0f}" if value >= 1000 else f"{value:.1f}"


def ttft(seconds: float) -> str:
    return f"{seconds * 1000:.0f}ms" if seconds < 1 else f"{seconds:.2f}s"


def compact_table(title: str, caption: str = ""):
    """A table that reads in an 80-column terminal: a rule under the header, two spaces between columns."""
    from rich import box
    from rich.table import Table

    return Table(title=title, caption=caption or None, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                 padding=(0, 1, 0, 0), caption_justify="left", title_justify="left")


def render(results: list[ProfileResult]):
    """A rich table of one row per profile, then per-subtask speed-ups: 80 columns wide for names up to ~30."""
    from rich.console import Group

    backends = {r.profile.backend for r in results}
    prompts = max((len(r.runs) for r in results), default=0)
    title = f"specchat bench · {prompts} prompt{'s' * (prompts != 1)}"
    if len(backends) == 1:
        title += f" · {next(iter(backends))}"
    repeat = repeat_of(results)
    runs = (f"each prompt run {repeat} times, its median-tok/s run kept · " if repeat > 1 else "")
    main = compact_table(title, runs + ("method (backend), as the backends differ · " if len(backends) > 1 else "") +
                         "t/pass: tokens per target pass · t/dp: tokens per drafted pass (one that verified a draft) · "
                         "speed-up: decode tok/s over its target-only reference's, same run")
    main.add_column("profile", no_wrap=True)
    main.add_column("method")  # the one column that wraps, at its spaces: "mtp:3 +lookup:4 (torch)"
    for col in ("tok/s", "TTFT", "t/pass", "t/dp", "speed-up"):
        main.add_column(col, justify="right", no_wrap=True)
    for r in results:
        sp = speedup(results, r)
        spec = r.profile.speculative
        method = r.profile.method if r.profile.method == "none" else f"{r.profile.method}:{spec.depth}"
        if spec.lookup:
            method += f" +lookup:{spec.lookup}"
        if spec.suffix.first:
            method += f" +suffix:{spec.suffix.first}"
        if r.profile.backend == "llamaserver":
            method = r.profile.method_label.removeprefix("llama.cpp ")
        speculated = r.profile.method != "none"
        if r.profile.remote:  # the server's own speculation, and only what it reported
            method = r.profile.method_label
            speculated = any(run.summary.drafts for run in r.runs)
        per_pass = r.tokens_per_pass() if speculated else 0.0
        if len(backends) > 1:
            method += f" ({r.profile.backend})"
        main.add_row(r.label, method, tok_s(r.decode_tok_s()),
                     ttft(r.ttft_s()), f"{per_pass:.2f}" if per_pass else "-",
                     f"{r.mean_accepted():.2f}" if speculated else "-", f"{sp:.2f}x" if sp else "-")
    tasks = tasks_of(results)
    warmth = memory_lines(results) + load_lines(results) + [f"{r.label}: {r.caveat}" for r in results if r.caveat]
    if len(tasks) < 2:
        return Group(main, "", *warmth) if warmth else main
    by_task = compact_table("speed-up by subtask", "plain numbers: decode tok/s (rows without a reference)")
    by_task.add_column("profile", no_wrap=True)
    for t in tasks:
        by_task.add_column(TASK_HEADERS.get(t, t), justify="right", no_wrap=True)
    for r in results:
        cells = []
        for t in tasks:
            tsp = speedup(results, r, t)
            cells.append(f"{tsp:.2f}x" if tsp else tok_s(r.decode_tok_s(t)))
        by_task.add_row(r.label, *cells)
    first = first_position_table(results, tasks)
    return Group(main, *(("", *warmth) if warmth else ()), "", by_task, *(("", first) if first.row_count else ()))


def alone_tok_s(r: ProfileResult) -> float:
    """Throughput one request at a time: every run's tokens over their wall time."""
    wall = sum(run.summary.wall_s for run in r.runs)
    return r.tokens() / wall if wall else 0.0


def load_lines(results: list[ProfileResult]) -> list[str]:
    """A line per row measured under load (bench --concurrency): throughput alone and at C, and
    how many replies changed against the same request sent alone."""
    lines = []
    for r in results:
        if (u := r.under_load) is not None:
            lines.append(f"{r.label}: {alone_tok_s(r):.1f} tok/s one request at a time, {u.tok_s:.1f} tok/s with "
                         f"{u.concurrency} in flight ({u.tok_s / alone_tok_s(r):.2f}x); {u.changed} of {len(r.runs)} "
                         "replies changed under load" if alone_tok_s(r) else f"{r.label}: no tokens")
    return lines


def memory_lines(results: list[ProfileResult]) -> list[str]:
    """How warm each suffix row's memory of earlier replies was: a speed-up is never read without it."""
    lines = []
    for r in results:
        held = r.memory()
        if held is not None:
            (r0, r1), (t0, t1) = held["replies"], held["tokens"]
            lines.append(f"{r.label}: the suffix memory held the run's earlier replies, {r0} to {r1} "
                         f"({t0:,} to {t1:,} tokens) from the first prompt to the last")
        elif r.label.endswith(EMPTY_HISTORY):
            lines.append(f"{r.label}: the same drafter with no memory of earlier replies (the conversation only)")
    return lines


def first_position_table(results: list[ProfileResult], tasks: list[str]):
    """Per subtask, the share of drafted first positions the target accepted (under greedy decoding
    what a depth-1 drafter's speed-up rests on), for the rows that drafted."""
    table = compact_table("accepted at position 1 by subtask, %",
                          "lookup-first rows: lookup's drafts and the model drafter's together")
    table.add_column("profile", no_wrap=True)
    for t in tasks:
        table.add_column(TASK_HEADERS.get(t, t), justify="right", no_wrap=True)
    for r in results:
        if not any(run.summary.drafts for run in r.runs):
            continue
        cells = []
        for t in tasks:
            by_position = r.acceptance_by_position(t)
            cells.append(f"{by_position[0] * 100:.0f}" if by_position else "-")
        table.add_row(r.label, *cells)
    return table
