"""`specchat chat`, `ab` and `repl`: the interactive front ends."""
from __future__ import annotations

from specchat import help_text
from specchat.profiles import DEFAULT_PROFILE


def cmd_chat(args) -> int:
    from specchat.tui.app import run_chat

    return run_chat(args.profile or DEFAULT_PROFILE)


def cmd_ab(args) -> int:
    from specchat.tui.app import run_ab

    return run_ab(args.profile, args.reference)


def cmd_repl(args) -> int:
    from specchat.repl import run_repl

    return run_repl(args.profile or DEFAULT_PROFILE)


def add_parser(sub) -> None:
    p = sub.add_parser("chat", **help_text.subcommand("chat"))
    p.add_argument("-p", "--profile")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("ab", **help_text.subcommand("ab"))
    p.add_argument("-p", "--profile", required=True)
    p.add_argument("-r", "--reference", help="reference profile (default: the same with speculation off)")
    p.set_defaults(func=cmd_ab)

    p = sub.add_parser("repl", **help_text.subcommand("repl"))
    p.add_argument("-p", "--profile")
    p.set_defaults(func=cmd_repl)
