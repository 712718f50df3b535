"""The `specchat` command: the parser, built from the subcommands' own modules (specchat/commands/),
and the exit codes every subcommand keeps to.

Exit codes: 0 ok, 2 usage or configuration error (one clear line on stderr), 1 runtime failure.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from specchat import help_text
from specchat.backends.base import BackendError
from specchat.commands import bench, chat, ladder, profiles, run, verify
from specchat.commands.common import EXIT_RUNTIME, EXIT_USAGE, UsageError, err
from specchat.profiles import ProfileError
from specchat.train.cli import add_train_parser


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specchat", **help_text.top_level())
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = ap.add_subparsers(dest="command")
    for command in (chat, run, profiles, bench, ladder, verify):
        command.add_parser(sub)
    add_train_parser(sub)
    return ap


# bare `specchat -m FILE` / `specchat -p PROFILE`: the chat's flags, before any command
CHAT_FLAGS = ("-m", "--model", "-p", "--profile")


def _bare_chat(argv: list[str]) -> list[str]:
    """argv with `chat` put in where it starts with the chat's own flags (after --debug, if any)."""
    lead = [a for a in argv[:1] if a == "--debug"]
    rest = argv[len(lead):]
    if rest and (rest[0].split("=", 1)[0] in CHAT_FLAGS or rest[0][:2] in ("-m", "-p")):
        return [*lead, "chat", *rest]
    return argv


def main(argv: Optional[list[str]] = None) -> int:
    from specchat.model_flag import forget

    forget()  # no -m profile from an earlier command in this process
    parser = build_parser()
    argv = _bare_chat(list(sys.argv[1:] if argv is None else argv))
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            args = parser.parse_args(["chat", *argv])
    except UsageError as e:  # a flag's value its type= refused (_count)
        err(str(e))
        return EXIT_USAGE
    debug = args.debug or bool(os.environ.get("SPECCHAT_DEBUG"))
    try:
        return args.func(args)
    except (ProfileError, BackendError, UsageError) as e:
        if debug:
            raise
        err(str(e))
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a runtime failure: one line, the traceback only with --debug
        if debug:
            raise
        err(f"{type(e).__name__}: {e} (rerun with --debug for the traceback)")
        return EXIT_RUNTIME


if __name__ == "__main__":
    sys.exit(main())
