"""`specchat profiles` and `specchat pull`: what runs here, and fetching a model."""
from __future__ import annotations

import json

from specchat import help_text
from specchat.commands.common import EXIT_OK
from specchat.profiles import load_profiles


def cmd_profiles(args) -> int:
    from rich.console import Console

    from specchat import availability

    ps = load_profiles()
    found = availability.classify(ps, probe_servers=not args.no_probe, unprobed="server not asked (--no-probe)")
    if args.json:
        print(json.dumps(availability.as_json(ps, found)))
    else:
        availability.print_listing(Console(), found, wide=args.wide)
    return EXIT_OK


def cmd_pull(args) -> int:
    from specchat.models import pull

    path = pull(args.name, force=args.force)
    print(path)
    return EXIT_OK


def add_parser(sub) -> None:
    p = sub.add_parser("profiles", **help_text.subcommand("profiles"))
    p.add_argument("--json", action="store_true", help="as JSON, with each profile's group and reason")
    p.add_argument("--wide", action="store_true", help="descriptions too, and nothing cut to the terminal's width")
    p.add_argument("--no-probe", action="store_true", help="do not ask servers whether they answer")
    p.set_defaults(func=cmd_profiles)

    p = sub.add_parser("pull", **help_text.subcommand("pull"))
    p.add_argument("name", nargs="?", default="smollm2-135m-instruct")
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=cmd_pull)
