"""`specchat bench`: decode speed, acceptance and speed-up over a prompt set."""
from __future__ import annotations

import json

from specchat import help_text
from specchat.commands.common import (EXIT_OK, add_prompt_flags, add_sampling_flags, chosen_profile, count,
                                      overridden, prompt_set, run_line)
from specchat.constraints import add_constraint_flags
from specchat.model_flag import add_model_flag


def cmd_bench(args) -> int:
    from rich.console import Console
    from rich.markup import escape

    from specchat import bench

    # None: the default profile, or with -m alone the profile -m builds; with -m, every -p on its file
    profiles = [overridden(chosen_profile(args, n), args) for n in (args.profile or [None])]
    if args.concurrency:
        from specchat.under_load import profile_for_load

        profiles = [profile_for_load(p, "profile", args.concurrency) for p in profiles]
    prompts = prompt_set(args)
    console = Console(stderr=True)
    extra = []
    if args.transformers:
        from specchat.loading import load_transformers

        base = next((p for p in profiles if p.backend == "torch"), profiles[0]).target_only()
        for dtype in args.transformers:
            ref = base.model_copy(update={"name": f"transformers-{dtype}", "dtype": dtype})
            extra.append((ref.name, lambda ref=ref: load_transformers(ref), ref))
    results = bench.bench(
        profiles, prompts, interleave=not args.sequential,
        on_load=lambda label: console.print(f"[bold]{label}[/bold]: loading…"),
        on_run=lambda label, r: console.print(escape(run_line(label, r)), highlight=False),
        extra_rows=extra, repeat=args.repeat, concurrency=args.concurrency or 1)
    if args.json:
        print(json.dumps(bench.to_json(results)))
    else:
        Console().print(bench.render(results))
    return EXIT_OK


def add_parser(sub) -> None:
    p = sub.add_parser("bench", **help_text.subcommand("bench"))
    p.add_argument("-p", "--profile", action="append", help="profile to run (repeatable)")
    add_model_flag(p, " (each -p's)")
    add_prompt_flags(p)
    add_sampling_flags(p)
    p.add_argument("--sequential", action="store_true",
                   help="load and measure one profile at a time (default: all loaded, taking turns per prompt)")
    p.add_argument("--transformers", action="append", metavar="DTYPE", choices=["float32", "bfloat16"],
                   help="add a transformers `generate` reference row in this dtype (repeatable)")
    p.add_argument("--repeat", type=count("--repeat"), default=1, metavar="N",
                   help="run each prompt N times per profile and keep its median-speed run (default 1)")
    p.add_argument("--concurrency", type=count("--concurrency", least=2), metavar="C",
                   help="server profiles: then every prompt again with C in flight at once: throughput at C, and "
                        "which replies changed under load (a llama-server specchat starts gets C slots)")
    p.add_argument("--json", action="store_true")
    add_constraint_flags(p)
    p.set_defaults(func=cmd_bench)
