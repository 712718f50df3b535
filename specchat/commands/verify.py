"""`specchat verify`: speculative output against target-only output, token for token."""
from __future__ import annotations

import json

from specchat import help_text
from specchat.commands.common import (EXIT_OK, EXIT_RUNTIME, UsageError, add_prompt_flags, add_sampling_flags,
                                      chosen_profile, count, needs_profile_or_model, overridden, prompt_set)
from specchat.constraints import add_constraint_flags
from specchat.model_flag import add_model_flag
from specchat.profiles import get_profile


def cmd_verify(args) -> int:
    from rich.console import Console
    from rich.markup import escape

    from specchat import under_load
    from specchat.compare import mark_and_colour
    from specchat.constraints import replies_valid
    from specchat.live import peak_rss_bytes, speculation_note
    from specchat.loading import load_backend, load_reference, same_arithmetic, sampling_of
    from specchat.verify import check_conversation, summarize

    needs_profile_or_model(args, "verify", "SPEC")
    spec_profile = overridden(chosen_profile(args, args.profile), args)
    if spec_profile.remote and not args.reference:
        spec_profile.target_only()  # raises: a server's speculation can't be switched off from here
    if spec_profile.method == "none" and not spec_profile.remote and not args.reference:
        raise UsageError(f"profile '{spec_profile.name}' has no speculative method; verify compares a "
                         "speculative profile with its target-only reference (or with -r REFERENCE)")
    ref_profile = get_profile(args.reference) if args.reference else spec_profile.target_only()
    if args.concurrency:
        if args.turns != "first":
            raise UsageError("--concurrency sends each prompt's first turn: leave out --turns all")
        spec_profile, ref_profile = (under_load.profile_for_load(p, what, args.concurrency) for p, what in
                                     ((spec_profile, "profile"), (ref_profile, "reference")))
    prompts = prompt_set(args)
    console = Console(stderr=True, highlight=False)
    spec = load_backend(spec_profile)
    reference = load_reference(spec_profile, spec, ref_profile)  # on spec's own weights where it can
    # a reference on another engine, backend, dtype or quantization: the speculative profile's own
    # target-only runs too, so that each divergence is the drafter's or the engines'
    own = None
    if not spec_profile.remote and not same_arithmetic(spec_profile, ref_profile):
        own = load_reference(spec_profile, spec, spec_profile.target_only())
    sampling = sampling_of(spec_profile)
    if args.concurrency:  # throughput alone is set beside throughput under load: no cold first request in it
        from specchat.bench import warm_up

        for backend, profile in ((spec, spec_profile), (reference, ref_profile)):
            warm_up(backend, profile)
    checks = []
    turns = 1 if args.turns == "first" else 1_000
    try:
        for item in prompts:
            for check, left_out in check_conversation(spec, reference, spec_profile, item, sampling, turns,
                                                          args.repeat, own):
                checks.append(check)
                if left_out:
                    console.print(escape(f"  {check.label}: {left_out}"))
                symbol, colour = mark_and_colour(check.verdict)
                mark = f"[{colour}]{symbol}[/{colour}]" if colour else symbol
                note = speculation_note(check.speculative)
                console.print(f"{mark} {check.label} " + escape(
                    f"[{item.task}] {check.verdict.line()}" + (f" · {note}" if note else "")))
        loaded = None
        if args.concurrency:
            console.print(f"the same {len(checks)} requests again, {args.concurrency} in flight at once…")
            loaded = under_load.check_under_load(spec, reference, checks, sampling, args.concurrency)
    finally:
        # servers specchat started hold their weights in processes of their own: count them too
        servers_rss = [b.server_peak_rss_bytes() for b in (spec, reference) if hasattr(b, "server_peak_rss_bytes")]
        for backend in (spec, reference, own):
            if backend is not None:
                backend.close()
    totals = summarize(checks) | ({"under_load": loaded} if loaded else {})
    valid = replies_valid(checks)  # None: no constraint
    totals["constraint"] = valid
    strict = getattr(spec, "strict", None)  # None: a server or llama.cpp verifies its own way
    if args.json:
        print(json.dumps({"profile": spec_profile.name, "reference": args.reference or f"{spec_profile.name} (target-only)",
                          "strict": strict, "reference_shares_weights": getattr(reference, "shares_weights", False),
                          "reference_is_another_engine": own is not None,
                          "peak_rss_bytes": peak_rss_bytes(),
                          "server_peak_rss_bytes": sum(r or 0 for r in servers_rss) if servers_rss else None, **totals, "prompts_checked": [c.as_dict() for c in checks]}))
    else:
        how = {True: " (strict verification)", None: "",
               False: " (verification not strict: floating-point near-ties may flip a token, and each near-tie is "
                      "a token the speculative run's own verify row chose)"}[strict]
        checked = f"{totals['prompts']} prompts" if turns == 1 else f"{totals['prompts']} turns of {len(prompts)} prompts"
        unsteady = f", {totals['target_not_reproducible']} target not reproducible" if args.repeat > 1 else ""
        engines = f", {totals['engines_differ']} where the engines differ" if own is not None else ""
        print(f"{checked}: {totals['identical']} identical, {totals['near_ties']} near-ties, "
              f"{totals['mismatches']} mismatches{engines}{unsteady}{how}")
        if own is not None:
            print(f"the reference runs another engine or other settings: each reply was also checked against "
                  f"{spec_profile.name}'s own target-only; a mismatch is the drafter's, 'engines differ' is not")
        if args.repeat > 1:
            steady = totals["prompts"] - totals["target_not_reproducible"]
            print(f"target run-to-run: {steady} of {totals['prompts']} reproduced their reply in all {args.repeat} "
                  "target-only runs" + ("" if steady == totals["prompts"] else
                                        " (the others are not judged: the target itself does not reproduce them)"))
        if loaded:
            print("\n".join(under_load.report(loaded, checks)))
        if valid is not None:
            for bad in valid["invalid"]:
                print(f"  invalid: {bad['id']} {bad['reply']} reply {bad['problem']}")
            print(f"constraint: {valid['valid']} of {valid['replies']} replies valid (speculative and reference)"
                  + ("" if not valid["invalid"] else f"; {len(valid['invalid'])} INVALID: a failure"))
    return EXIT_RUNTIME if totals["mismatches"] or (valid and valid["invalid"]) else EXIT_OK


def add_parser(sub) -> None:
    p = sub.add_parser("verify", **help_text.subcommand("verify"))
    p.add_argument("-p", "--profile", help="the speculative profile (or -m FILE alone)")
    add_model_flag(p)
    p.add_argument("-r", "--reference", help="reference profile (default: the same profile, speculation off)")
    add_prompt_flags(p)
    p.add_argument("--turns", choices=["first", "all"], default="first",
                   help="multi-turn prompts: check the first turn, or every turn as one conversation")
    p.add_argument("--repeat", type=count("--repeat", least=2), default=1, metavar="N",
                   help="run the target-only reference N times (N >= 2), each from a fresh cache: a prompt whose "
                        "runs disagree is 'target not reproducible', not a drafter's mismatch")
    p.add_argument("--concurrency", type=count("--concurrency", least=2), metavar="C",
                   help="server profiles: send the prompts again with C in flight at once and say which replies "
                        "changed under load (a llama-server specchat starts gets C slots)")
    p.add_argument("--json", action="store_true")
    add_sampling_flags(p)
    add_constraint_flags(p)
    p.set_defaults(func=cmd_verify)
