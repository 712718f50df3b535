"""Tune suffix decoding's settings (depth, min_prob, factor, offset, max_match) on quantities a busy
machine cannot disturb: tokens per target pass, drafted tokens per pass, acceptance, and a speed-up
predicted from what a verify row costs.

Greedy decoding with exact acceptance emits target-only's reply whatever is drafted, and with the
adaptive gate off (its decisions depend on timing) what the suffix drafter proposes depends only
on the tokens committed so far and on its memory. So once target-only's replies are known, every
pass of a speculative run follows from them: the real `SuffixDrafter` proposes, the draft is
accepted as far as it equals the reply, the pass emits that and the target's next token, exactly
as backends/speculative/loop.py does. Three steps:

    python scripts/suffix_tuning.py reference   # target-only replies of both sets, real decoding
    python scripts/suffix_tuning.py grid top=30 # every setting replayed against them (no target);
        # top=N: Spec-Bench only for today's setting and the N best on the repeated-work set
    python scripts/suffix_tuning.py check [sets=repeated] d7,0.1,1 d10,0.2,2,0,24 ...
        # real speculative decoding of those settings (depth, min_prob, factor[, offset, max_match]),
        # gate off, on one shared compiled target: every reply must equal target-only's, and every
        # prompt's passes and drafted tokens the replay's (which proves the replay)

Sets: scripts/repeated-work-prompts.jsonl (24 prompts) and Spec-Bench (48 prompts spread over its
subtasks, as `--limit 48` takes them), 128 tokens, the profile smollm2-suffix's target (compiled
graphs). The memory is warm as `specchat bench` keeps it: each prompt's reply joins it after the
prompt ran; `empty` rows draft from the conversation only. Each step is resumable: results go to
runs/suffix-tuning/ (not committed) and what is there is not computed again.

Predicted speed-up over target-only = target-only's decode passes / the speculative run's decode
passes weighted by what a pass of 1 + k rows costs in one-token passes: `1 + c k` for c = 0.10
and 0.14 (a verify row of up to four, docs/results.md, 2026-12-06: specchat's own CPU kernels;
equal to tokens_per_pass / (1 + c drafted_per_pass)), and the measured ladder of that section
(its third, quietest run: 2 rows 1.04, 3 rows 1.18, 4 rows 1.31, 8 rows 2.24; linear between,
and past 8 rows at the slope of 4 to 8), which charges deep drafts what they cost: the 4-bit
kernel takes rows 8 at a time, and in its own timing a fifth row costs more than the second,
third and fourth together.
"""
from __future__ import annotations

import itertools
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from specchat.backends.speculative.backend import make_suffix_drafter
from specchat.backends.speculative.suffix import SuffixSettings

OUT = Path("runs/suffix-tuning")
MAX_TOKENS = 128
SETS = {"repeated": ("scripts/repeated-work-prompts.jsonl", None),
        "specbench": ("../shared/data/spec-bench/question.jsonl", 48)}
LADDER = {1: 1.00, 2: 1.04, 3: 1.18, 4: 1.31, 8: 2.24}
TODAY = (7, 0.1, 1.0, 0.0, 24)  # profiles/smollm2-suffix.yaml's setting (SuffixSettings' defaults)
# depth, min_prob and factor first; then offset and max_match (and finer factors, higher min_prob)
# around the depths and probabilities that did best there
GRID = ([(d, p, f, 0.0, 24) for d, p, f in itertools.product(
            (3, 4, 5, 6, 7, 8, 10, 12, 14), (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5), (0.5, 1.0, 2.0, 4.0))]
        + [(d, p, f, o, 24) for d, p, f, o in itertools.product(
            (4, 5, 6, 8, 12), (0.3, 0.5, 0.7, 0.9), (0.75, 1.0, 1.5), (0.0, 1.0, 2.0))]
        + [(d, 0.5, f, 0.0, m) for d, m, f in itertools.product((4, 6, 8, 12), (12, 48), (1.0, 1.5))])


def row_cost(rows: int, c: float | None) -> float:
    """A pass of `rows` verify rows in one-token passes: linear in c, or the ladder (c None)."""
    if c is not None:
        return 1 + c * (rows - 1)
    if rows in LADDER:
        return LADDER[rows]
    lo = max(r for r in LADDER if r < rows)
    hi = min((r for r in LADDER if r > rows), default=None)
    if hi is None:
        return LADDER[8] + (rows - 8) * (LADDER[8] - LADDER[4]) / 4
    return LADDER[lo] + (rows - lo) * (LADDER[hi] - LADDER[lo]) / (hi - lo)


def key(setting) -> str:
    d, p, f, o, m = setting
    return f"d{d},{p:g},{f:g},{o:g},{m}"


def parse(text: str):
    """`d7,0.1,1[,offset[,max_match]]` -> a setting; offset and max_match default to today's."""
    parts = text.lstrip("d").split(",")
    values = [int(parts[0]), float(parts[1]), float(parts[2])]
    values += [float(x) for x in parts[3:4]] + [int(x) for x in parts[4:5]]
    return tuple(values + list(TODAY[len(values):]))


def suffix_settings(setting, warm: bool) -> SuffixSettings:
    _, p, f, o, m = setting
    return SuffixSettings(min_prob=p, factor=f, offset=o, max_match=m, memory=warm)


# ---------------------------------------------------------------------------------------- reference
def load_shared_target():
    from specchat.loading import load_target, sampling_of
    from specchat.profiles import load_profiles

    profile = load_profiles().get("smollm2-suffix")
    return profile, load_target(profile), replace(sampling_of(profile), temperature=0.0, max_tokens=MAX_TOKENS)


def request(profile, item):
    from specchat.backends.base import Request
    from specchat.loading import messages_for

    return Request(messages=messages_for(profile, [{"role": "user", "content": item.first}]))


def reference() -> None:
    from specchat.backends.base import STOP_EOS, run_to_summary
    from specchat.prompts import load_prompts
    from specchat.verify import fresh

    profile, target, sampling = load_shared_target()
    for name, (path, limit) in SETS.items():
        out = OUT / f"reference-{name}.json"
        if out.exists():
            continue
        rows = []
        for item in load_prompts(path, limit):
            req = request(profile, item)
            s = run_to_summary(fresh(target).stream(req, sampling))
            rows.append(dict(id=item.id, task=item.task, prompt=target.prompt_ids(req), reply=s.token_ids,
                             eos=s.stop_reason == STOP_EOS, tok_s=s.decode_tok_s))
            print(name, item.id, len(s.token_ids), s.stop_reason, flush=True)
        out.write_text(json.dumps(rows))


def references() -> dict[str, list[dict]]:
    """The sets whose target-only replies are there (`reference` writes them one set at a time)."""
    return {name: json.loads((OUT / f"reference-{name}.json").read_text()) for name in SETS
            if (OUT / f"reference-{name}.json").exists()}


# ------------------------------------------------------------------------------------------- replay
def replay(items: list[dict], setting, warm: bool) -> list[dict]:
    """Per prompt, the passes a greedy speculative run of `setting` makes, gate off (module docstring)."""
    depth = setting[0]
    drafter = make_suffix_drafter(suffix_settings(setting, warm))
    out = []
    for it in items:
        prompt, reply, eos = it["prompt"], it["reply"], it["eos"]
        if not reply:  # the end of sequence first: no pass counted, nothing to draft
            continue
        drafter.start(prompt, {}, None)
        tokens, pos, rows, passes, drafted, accepted, find_s = list(prompt) + reply[:1], 1, [], 1, 0, 0, 0.0
        while pos < MAX_TOKENS and (pos < len(reply) or eos):
            k = max(0, min(depth, MAX_TOKENS - pos - 1))
            t0 = time.process_time()
            d = drafter.find(tokens, k).tokens[:k] if k else []
            find_s += time.process_time() - t0
            a = 0
            while a < len(d) and pos + a < len(reply) and d[a] == reply[pos + a]:
                a += 1
            rows.append(len(d) + 1)
            kept = min(a + 1, len(reply) - pos)  # the pass's tokens before the end of sequence
            if kept:  # a pass that only ends the reply is not counted (loop.py's emit)
                passes, drafted, accepted = passes + 1, drafted + len(d), accepted + min(a, kept)
            tokens.extend(reply[pos:pos + kept])
            pos += kept
            if kept < a + 1:  # the end of sequence was among its tokens
                break
        out.append(dict(id=it["id"], task=it["task"], tokens=len(reply), passes=passes, drafted=drafted,
                        accepted=accepted, rows=rows, target_passes=len(reply) - 1 + eos,
                        find_us=round(1e6 * find_s / max(len(rows), 1), 1)))
        if warm:
            drafter.memory.add(it["id"], reply)
    return out


def summary(runs: list[dict], task: str | None = None) -> dict:
    """Tokens and drafted tokens per pass, acceptance, and the predicted speed-ups (module docstring)."""
    runs = [r for r in runs if task is None or r["task"] == task]
    tokens, passes = sum(r["tokens"] for r in runs), sum(r["passes"] for r in runs)
    drafted, accepted = sum(r["drafted"] for r in runs), sum(r["accepted"] for r in runs)
    plain = sum(r["target_passes"] for r in runs)
    out = dict(tpp=tokens / passes, dpp=drafted / passes, acc=accepted / max(drafted, 1),
               find_us=sum(r["find_us"] for r in runs) / len(runs))
    for name, c in (("c10", 0.10), ("c14", 0.14), ("ladder", None)):
        out[name] = plain / sum(row_cost(k, c) for r in runs for k in r["rows"])
    return out


# --------------------------------------------------------------------------------------------- grid
def grid(settings, sets=tuple(SETS)) -> dict:
    """Replays of every setting on `sets`, warm and empty, one file a setting under OUT/grid."""
    refs = {name: items for name, items in references().items() if name in sets}
    (OUT / "grid").mkdir(exist_ok=True)
    done = {}
    for setting in settings:
        path = OUT / "grid" / f"{key(setting)}.json"
        runs = json.loads(path.read_text()) if path.exists() else {}
        for name, items in refs.items():
            for warm in ("warm", "empty"):
                if f"{name}|{warm}" not in runs:
                    runs[f"{name}|{warm}"] = replay(items, setting, warm == "warm")
        path.write_text(json.dumps(runs))
        done.update({f"{key(setting)}|{k}": v for k, v in runs.items()})
    return done


def table(done: dict, settings, top: int, by: str) -> None:
    """The settings of the best predicted speed-up on the repeated-work set (warm memory) under
    the cost model `by`, today's first."""
    def s(setting, name, warm="warm", task=None):
        return summary(done[f"{key(setting)}|{name}|{warm}"], task)

    if not all(f"{key(TODAY)}|{name}|warm" in done for name in SETS):
        return print("(the table waits for both sets' replays)")
    ranked = sorted(settings, key=lambda x: -s(x, "repeated")[by])
    base = s(TODAY, "specbench")
    print(f"\nranked by the predicted speed-up on the repeated-work set, cost model {by}")
    print("setting (depth,min_prob,factor,offset,max_match) | repeated warm: t/pass, drafted/pass, acc, "
          "x c=.10, x c=.14, x ladder | spec-bench warm: t/pass, x c=.10, x c=.14, x ladder | repeated empty x ladder")
    for setting in [TODAY] + [x for x in ranked if x != TODAY][:top]:
        r, b, e = s(setting, "repeated"), s(setting, "specbench"), s(setting, "repeated", "empty")
        ok = "" if b["ladder"] >= base["ladder"] - 0.005 and b["c14"] >= base["c14"] - 0.005 else "  (spec-bench worse)"
        print(f"{key(setting)}{' (today)' if setting == TODAY else ''} | {r['tpp']:.2f}, {r['dpp']:.2f}, "
              f"{r['acc']:.2f}, {r['c10']:.3f}, {r['c14']:.3f}, {r['ladder']:.3f} | {b['tpp']:.2f}, {b['c10']:.3f}, "
              f"{b['c14']:.3f}, {b['ladder']:.3f} | {e['ladder']:.3f}{ok}")


# -------------------------------------------------------------------------------------------- check
def check(settings, sets=tuple(SETS)) -> None:
    """Real decoding of `settings` on `sets`, gate off, warm memory: replies against target-only's,
    passes and drafted tokens against the replay's."""
    from specchat.backends.base import run_to_summary
    from specchat.backends.speculative.backend import SpeculativeBackend
    from specchat.prompts import load_prompts
    from specchat.verify import fresh

    refs = references()
    profile, target, sampling = load_shared_target()
    for setting in settings:
        out = OUT / f"check-{key(setting)}-{'+'.join(sets)}.json"
        if out.exists():
            continue
        backend = SpeculativeBackend(target, make_suffix_drafter(suffix_settings(setting, True)), setting[0],
                                     strict=None, adaptive=False)
        result = {}
        for name in sets:
            path, limit = SETS[name]
            backend.memory.reset()
            expected = {r["id"]: r for r in replay(refs[name], setting, True)}
            rows = []
            for item, ref in zip(load_prompts(path, limit), refs[name]):
                s = run_to_summary(fresh(backend).stream(request(profile, item), sampling))
                e = expected.get(item.id)
                same = s.token_ids == ref["reply"]
                agrees = e is not None and (s.passes, s.draft_tokens, s.accepted_tokens) == (
                    e["passes"], e["drafted"], e["accepted"])
                rows.append(dict(id=item.id, same=same, replay_agrees=agrees, passes=s.passes,
                                 drafted=s.draft_tokens, accepted=s.accepted_tokens, tokens=s.tokens,
                                 tok_s=s.decode_tok_s))
                if s.token_ids:
                    backend.memory.add(item.id, s.token_ids)
                print(key(setting), name, item.id, "same" if same else "DIFFERS",
                      "replay agrees" if agrees else f"REPLAY DIFFERS {(s.passes, s.draft_tokens, s.accepted_tokens)} "
                      f"vs {e and (e['passes'], e['drafted'], e['accepted'])}", flush=True)
            result[name] = rows
        out.write_text(json.dumps(result))
        for name, rows in result.items():
            print(f"{key(setting)} {name}: {sum(r['same'] for r in rows)}/{len(rows)} replies equal target-only's, "
                  f"{sum(r['replay_agrees'] for r in rows)}/{len(rows)} prompts as the replay predicted; "
                  f"{sum(r['tokens'] for r in rows) / sum(r['passes'] for r in rows):.2f} tokens per pass")


def main(argv: list[str]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    step = argv[0] if argv else "grid"
    if step == "reference":
        reference()
    elif step == "grid":
        # `top=N`: Spec-Bench is replayed only for today's setting and the N best on the repeated-work set
        # under each cost model (the search is for the repeated-work set; Spec-Bench must not get worse)
        top = int(next((a[4:] for a in argv[1:] if a.startswith("top=")), 0))
        extra = [parse(a) for a in argv[1:] if not a.startswith("top=")]
        settings = list(dict.fromkeys([TODAY] + GRID + extra))
        done = grid(settings, ("repeated",) if top else tuple(SETS))
        if top:
            def score(x, by):
                return summary(done[f"{key(x)}|repeated|warm"])[by]
            settings = list(dict.fromkeys([TODAY] + [x for by in ("ladder", "c14", "c10")
                                                     for x in sorted(settings, key=lambda x: -score(x, by))[:top]]))
            done = grid(settings)
        for by in ("ladder", "c14", "c10"):
            table(done, settings, 15, by)
    elif step == "check":  # `sets=repeated` (or specbench): that set only
        sets = [a.split("=", 1)[1].split(",") for a in argv[1:] if a.startswith("sets=")]
        check([parse(a) for a in argv[1:] if not a.startswith("sets=")], *(tuple(x) for x in sets[-1:]))
    else:
        sys.exit(f"unknown step {step!r}: reference, grid [SETTING ...] or check SETTING ...")


if __name__ == "__main__":
    main(sys.argv[1:])
