"""`specchat chat`, `ab` and `repl`: the interactive front ends."""
from __future__ import annotations

from specchat import help_text
from specchat.commands.common import chosen_name, needs_profile_or_model
from specchat.constraints import add_constraint_flags
from specchat.model_flag import add_model_flag
from specchat.profiles import DEFAULT_PROFILE


def cmd_chat(args) -> int:
    from specchat.constraints import flag_constraint
    from specchat.tui.app import run_chat

    return run_chat(chosen_name(args) or DEFAULT_PROFILE, constraint=flag_constraint(args))


def cmd_ab(args) -> int:
    from specchat.constraints import flag_constraint
    from specchat.tui.app import run_ab

    needs_profile_or_model(args, "ab", "SPEC")
    # checked before the view starts; without one, the profile's (if any)
    return run_ab(chosen_name(args), args.reference, constraint=flag_constraint(args))


def cmd_repl(args) -> int:
    from specchat.constraints import flag_constraint
    from specchat.repl import run_repl

    return run_repl(chosen_name(args) or DEFAULT_PROFILE, constraint=flag_constraint(args))


def add_parser(sub) -> None:
    p = sub.add_parser("chat", **help_text.subcommand("chat"))
    p.add_argument("-p", "--profile")
    add_model_flag(p)
    add_constraint_flags(p, clearable=False)  # /schema off in the session
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("ab", **help_text.subcommand("ab"))
    p.add_argument("-p", "--profile", help="the speculative profile (or -m FILE alone)")
    add_model_flag(p)
    p.add_argument("-r", "--reference", help="reference profile (default: the same with speculation off)")
    add_constraint_flags(p, clearable=False)  # /schema off in the session
    p.set_defaults(func=cmd_ab)

    p = sub.add_parser("repl", **help_text.subcommand("repl"))
    p.add_argument("-p", "--profile")
    add_model_flag(p)
    add_constraint_flags(p, clearable=False)  # /schema off in the session
    p.set_defaults(func=cmd_repl)
