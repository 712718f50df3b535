"""`specchat ladder`: one speculative profile at every draft depth."""
from __future__ import annotations

import json

from specchat import help_text
from specchat.commands.common import (EXIT_OK, UsageError, add_prompt_flags, add_sampling_flags, chosen_profile,
                                      needs_profile_or_model, overridden, prompt_set, run_line)
from specchat.model_flag import add_model_flag


def cmd_ladder(args) -> int:
    from rich.console import Console
    from rich.markup import escape

    from specchat import ladder, plot

    depths = ladder.parse_depths(args.depths)
    if args.plot and (problem := plot.plot_problem(args.plot)):
        raise UsageError(problem)
    needs_profile_or_model(args, "ladder", "SPEC")
    profile = overridden(chosen_profile(args, args.profile), args)
    ladder.check(profile)
    prompts = prompt_set(args)
    console = Console(stderr=True)
    console.print(f"[bold]{escape(profile.name)}[/bold]: loading…")
    result = ladder.run_ladder(profile, depths, prompts,
                               on_run=lambda label, r: console.print(escape(run_line(label, r)), highlight=False))
    if args.plot:
        plot.write_ladder_plot(result, args.plot)
        console.print(f"chart written to {escape(args.plot)}", highlight=False)
    if args.json:
        print(json.dumps(ladder.to_json(result)))
    else:
        Console().print(ladder.render(result))
    return EXIT_OK


def add_parser(sub) -> None:
    p = sub.add_parser("ladder", **help_text.subcommand("ladder"))
    p.add_argument("-p", "--profile", help="a speculative profile (e.g. smollm2-mtp), or -m FILE alone")
    add_model_flag(p)
    p.add_argument("--depths", default="1-6", help="draft depths: a range like 1-6 or a list like 1,2,4 (default 1-6)")
    add_prompt_flags(p)
    p.add_argument("--plot", metavar="FILE", help="also draw the chart (matplotlib) into FILE: .png or .svg")
    p.add_argument("--json", action="store_true")
    add_sampling_flags(p)
    p.set_defaults(func=cmd_ladder)
