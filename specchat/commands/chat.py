"""`specchat chat`, `ab` and `repl`: the interactive front ends."""
from __future__ import annotations

from specchat import help_text
from specchat.constraints import add_constraint_flags
from specchat.profiles import DEFAULT_PROFILE


def cmd_chat(args) -> int:
    from specchat.constraints import flag_constraint
    from specchat.tui.app import run_chat

    return run_chat(args.profile or DEFAULT_PROFILE, constraint=flag_constraint(args))


def cmd_ab(args) -> int:
    from specchat.constraints import flag_constraint
    from specchat.tui.app import run_ab

    # checked before the view starts; without one, the profile's (if any)
    return run_ab(args.profile, args.reference, constraint=flag_constraint(args))


def cmd_repl(args) -> int:
    from specchat.constraints import flag_constraint
    from specchat.repl import run_repl

    return run_repl(args.profile or DEFAULT_PROFILE, constraint=flag_constraint(args))


def add_parser(sub) -> None:
    p = sub.add_parser("chat", **help_text.subcommand("chat"))
    p.add_argument("-p", "--profile")
    add_constraint_flags(p, clearable=False)  # /schema off in the session
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("ab", **help_text.subcommand("ab"))
    p.add_argument("-p", "--profile", required=True)
    p.add_argument("-r", "--reference", help="reference profile (default: the same with speculation off)")
    add_constraint_flags(p, clearable=False)  # /schema off in the session
    p.set_defaults(func=cmd_ab)

    p = sub.add_parser("repl", **help_text.subcommand("repl"))
    p.add_argument("-p", "--profile")
    add_constraint_flags(p, clearable=False)  # /schema off in the session
    p.set_defaults(func=cmd_repl)
