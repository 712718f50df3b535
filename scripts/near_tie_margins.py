"""Where the near-tie margin comes from: the score gaps at which real floating-point flips and
planted bugs make a speculative reply part from target-only decoding.

    python scripts/near_tie_margins.py [--limit 12] [--max-tokens 96] [--out runs/near-tie-margins.jsonl]
        [--precisions int4 bfloat16 float32] [--bugs accept-one-too-many off-by-one kv-not-rolled-back]
    python scripts/near_tie_margins.py --table       # the table from the records, running nothing

For each target precision (int4, bfloat16, float32; the default model) and sampling mode (greedy,
temperature 0.7), `smollm2-ngram` runs without strict verification over Spec-Bench prompts, as
`specchat verify` does. Every divergence is classified by recomputing the speculative run's own
verify row (a flip when it chose the speculative token: a real near-tie) and its margin recorded
(the reference's score of its token minus that of the other). Then the same runs with planted
bugs (tests/speculative/test_planted_bugs.py: one draft too many accepted, the accepted count off
by one, the KV cache not rolled back), whose divergences the recomputed rows call bugs. Records are
appended to --out as each run ends, and runs already there are skipped (rerun to resume). The margin rule (compare.NEAR_TIE_MARGIN), used only where no row can be recomputed (a
remote server judged against a local reference), calls a divergence a near-tie when its margin
is at most the threshold: a planted bug within it is a false negative, a real near-tie beyond it
a false positive. Prints both rates for candidate thresholds, per precision, as Markdown.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC_BENCH = ROOT.parent / "shared" / "data" / "spec-bench" / "question.jsonl"
PRECISIONS = ("int4", "bfloat16", "float32")
SAMPLINGS = {"greedy": {}, "t0.7": {"temperature": 0.7, "seed": 1}}
BUGS = {"accept-one-too-many": "accept one draft too many", "off-by-one": "off-by-one in the accepted count",
        "kv-not-rolled-back": "KV cache not rolled back"}
THRESHOLDS = (1e-4, 1e-3, 1e-2, 0.05, 0.1, 0.25, 0.5, 1.0)


def divergences(profile, prompts, bug: str | None) -> list[dict]:
    """One record per prompt that parted from its reference: kind, margin, where."""
    from specchat.backends.base import Request
    from specchat.loading import load_backend, messages_for, sampling_of
    from specchat.verify import check_prompt

    spec = load_backend(profile)
    records = []
    try:
        for item in prompts:
            request = Request(messages=messages_for(profile, [{"role": "user", "content": item.first}]))
            _, _, v = check_prompt(spec, spec.target, request, sampling_of(profile))
            if v.index is not None and v.margin is not None:
                records.append({"prompt": item.id, "task": item.task, "index": v.index, "kind": v.kind,
                                "margin": v.margin, "bug": bug})
    finally:
        spec.close()
    return records


def planted(bug: str):
    """The loop module's speculative_stream with `bug` planted (None: as it is)."""
    sys.path.insert(0, str(ROOT))
    from specchat.backends.speculative import backend as backend_module
    from specchat.backends.speculative import loop as loop_module
    from tests.speculative.test_planted_bugs import LOOP_BUGS, accept_one_too_many, mutate

    original = backend_module.speculative_stream, loop_module.accept_exact
    if bug == "accept one draft too many":
        loop_module.accept_exact = accept_one_too_many
    else:
        backend_module.speculative_stream = mutate(loop_module, LOOP_BUGS[bug]).speculative_stream

    def undo():
        backend_module.speculative_stream, loop_module.accept_exact = original
    return undo


def rates(real: list[float], bugs: list[float]) -> list[tuple[float, float, float]]:
    """(threshold, false-negative rate among bug divergences, false-positive rate among real near-ties)."""
    return [(t, sum(m <= t for m in bugs) / len(bugs) if bugs else float("nan"),
             sum(m > t for m in real) / len(real) if real else float("nan")) for t in THRESHOLDS]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", default=str(ROOT / "runs" / "near-tie-margins.jsonl"))
    ap.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    ap.add_argument("--bugs", nargs="+", choices=sorted(BUGS), default=sorted(BUGS),
                    help="planted bugs to run (default: all); the table counts what the records hold")
    ap.add_argument("--table", action="store_true", help="print the table from the records only, run nothing")
    args = ap.parse_args()

    sys.path.insert(0, str(ROOT))
    from specchat.profiles import get_profile
    from specchat.prompts import load_prompts
    from tests.speculative.test_planted_bugs import LOOP_BUGS

    prompts = load_prompts(SPEC_BENCH, args.limit)
    bugs = [BUGS[b] for b in sorted(BUGS) if b in args.bugs]
    assert all(b in LOOP_BUGS for b in bugs if b != BUGS["accept-one-too-many"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    done = {(r["precision"], r["sampling"], r["bug"]) for r in records if r.get("run")}
    for precision in [] if args.table else args.precisions:
        for mode, sampling in SAMPLINGS.items():
            settings = {"dtype": precision, "speculative.strict": False, "sampling.max_tokens": args.max_tokens}
            settings |= {f"sampling.{k}": v for k, v in sampling.items()}
            profile = get_profile("smollm2-ngram").with_overrides(settings)
            for bug in [None, *bugs]:
                if (precision, mode, bug) in done:
                    continue
                undo = planted(bug) if bug else (lambda: None)
                try:
                    found = divergences(profile, prompts, bug)
                finally:
                    undo()
                # one marker record per run, so that a run without divergences counts as done too
                found = [r | {"precision": precision, "sampling": mode} for r in found]
                found.append({"run": True, "precision": precision, "sampling": mode, "bug": bug})
                with out.open("a") as f:
                    f.write("".join(json.dumps(r) + "\n" for r in found))
                records += found
                print(f"{precision} {mode} {bug or 'no bug'}: {len(found) - 1} divergences "
                      f"({sum(r.get('kind') == 'near-tie' for r in found)} real near-ties)", file=sys.stderr, flush=True)

    print(f"{len(prompts)} Spec-Bench prompts x {args.max_tokens} tokens, smollm2-ngram not strict; "
          "|margin| in the reference's score units (logits, or tempered logits + noise). A real near-tie "
          "found again in a bug's run (before the bug diverged) counts once.\n")
    print("| precision | samplings | bugs planted | real near-ties | their largest margin | bug divergences | "
          "their smallest margin | no-bug divergences called bugs | "
          + " | ".join(f"FN / FP at {t:g}" for t in THRESHOLDS) + " |")
    print("|---" * (8 + len(THRESHOLDS)) + "|")
    short = {v: k for k, v in BUGS.items()}
    for precision in PRECISIONS:
        runs = [r for r in records if r.get("run") and r["precision"] == precision]
        if not runs:
            continue
        samplings = ", ".join(sorted({r["sampling"] for r in runs}))
        planted_bugs = ", ".join(sorted({short[r["bug"]] for r in runs if r["bug"]})) or "none"
        mine = [r for r in records if r["precision"] == precision and not r.get("run")]
        real = list({(r["sampling"], r["prompt"], r["index"]): abs(r["margin"])
                     for r in mine if r["kind"] == "near-tie"}.values())
        bug = [abs(r["margin"]) for r in mine if r["bug"] and r["kind"] == "mismatch"]
        false_bugs = sum(1 for r in mine if not r["bug"] and r["kind"] == "mismatch")
        cells = " | ".join(f"{fn * len(bug):.0f}/{len(bug)} / {fp * len(real):.0f}/{len(real)}"
                           for _, fn, fp in rates(real, bug))
        print(f"| {precision} | {samplings} | {planted_bugs} | {len(real)} | {max(real, default=float('nan')):.2e} | "
              f"{len(bug)} | {min(bug, default=float('nan')):.2e} | {false_bugs} | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
