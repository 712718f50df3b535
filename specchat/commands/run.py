"""`specchat run`: one prompt, streamed to stdout."""
from __future__ import annotations

import json
import sys
import threading
from typing import Optional

from specchat import help_text
from specchat.backends.base import BackendError, Request, Summary
from specchat.commands.common import (EXIT_OK, EXIT_RUNTIME, UsageError, add_sampling_flags, chosen_profile, err,
                                      overridden)
from specchat.constraints import add_constraint_flags
from specchat.live import background_note, reply_stats, stats_line
from specchat.model_flag import add_model_flag, engine_line, engine_of


def open_history(keep: bool):
    """The history database a run writes to and a suffix memory reads from (None: off, or it cannot
    be opened, which is said in one line and the run goes on)."""
    from specchat.history import History, HistoryError

    if not keep:
        return None
    try:
        return History()
    except HistoryError as e:
        print(f"specchat: note: {e}; this run is not kept", file=sys.stderr)
        return None


def keep_reply(history, profile, system: Optional[str], prompt: str, text: str, stats: dict) -> None:
    """The prompt and its reply (what there is of it) as one conversation in the history, as the chat
    keeps its turns; a database that fails says so in one line and loses the reply from history only."""
    from specchat.conversation import Conversation

    if history is None or not text:
        return
    conv = Conversation(history, profile.name, on_error=lambda m: print(f"specchat: note: {m}", file=sys.stderr))
    conv.system = system
    conv.add("user", prompt)
    conv.add("assistant", text, stats=stats)


def cmd_run(args) -> int:
    from specchat import suffix_memory
    from specchat.constraints import constraint_of
    from specchat.loading import load_backend, messages_for, sampling_of
    from specchat.stdin_text import StdinText

    prompt = args.prompt if args.prompt is not None else StdinText().read()
    if not prompt.strip():
        raise UsageError("empty prompt: pass it as an argument or on stdin")
    profile = overridden(chosen_profile(args, args.profile), args)
    if args.model is not None:  # which engine -m's file runs on, and why: said once
        print(engine_line(profile), file=sys.stderr)
    history = open_history(profile.history and not args.no_history)
    backend = load_backend(profile, background=True, start_background=False)  # started after the reply
    # earlier replies into a suffix drafter's memory, as the chat does, so repeated runs draft from them
    memory_line = suffix_memory.warm(backend, profile, history.path if history else None)
    system = args.system if args.system is not None else profile.system
    request = Request(messages=messages_for(profile, [{"role": "user", "content": prompt}], args.system),
                      constraint=constraint_of(profile))
    cancel = threading.Event()
    summary: Optional[Summary] = None
    text: list[str] = []
    try:
        events = backend.stream(request, sampling_of(profile), cancel)  # a refused prompt: exit 2
        try:
            for ev in events:
                if isinstance(ev, Summary):
                    summary = ev
                    shown = "".join(text)
                    if not args.json and summary.text.startswith(shown):  # the detokenizer's last bytes
                        sys.stdout.write(summary.text[len(shown):])
                    continue
                text.append(ev.text)
                if not args.json:
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
        except BackendError as e:  # the reply broke off (a server that died, timed out): a runtime failure
            keep_reply(history, profile, system, prompt, "".join(text), {"error": str(e)})
            if not args.json:
                sys.stdout.write("\n")
            err(str(e))
            return EXIT_RUNTIME
        note = background_note(backend)
    except KeyboardInterrupt:
        cancel.set()
        keep_reply(history, profile, system, prompt, "".join(text), {"stop_reason": "cancelled"})
        return 130
    finally:
        backend.close()
    assert summary is not None
    keep_reply(history, profile, system, prompt, summary.text or "".join(text), reply_stats(summary, profile.method_label))
    if args.json:
        engine, why = engine_of(profile)
        out = {"profile": profile.name, "backend": profile.backend, "engine": engine, "engine_reason": why,
               "method": profile.method,
               "depth": profile.speculative.depth if profile.method != "none" else 0, **summary.as_dict()}
        out["decode_tok_s"] = summary.decode_tok_s
        out["history"] = history is not None
        if memory_line is not None:
            out["suffix_memory"] = memory_line
        print(json.dumps(out))
    else:
        sys.stdout.write("\n")
        if args.stats:
            if memory_line is not None:
                print(memory_line, file=sys.stderr)
            print(stats_line(summary, stop=True), file=sys.stderr)
    if note:
        print(f"specchat: {note}", file=sys.stderr)
    if summary.error:
        err(summary.error)
        return EXIT_RUNTIME
    return EXIT_OK


def add_parser(sub) -> None:
    p = sub.add_parser("run", **help_text.subcommand("run"))
    p.add_argument("-p", "--profile", help="the profile to run (default: the default profile)")
    add_model_flag(p)
    p.add_argument("prompt", nargs="?", help="the prompt (read from stdin when omitted)")
    p.add_argument("--system", help="system prompt for this run")
    p.add_argument("--json", action="store_true", help="print one JSON summary instead of the text")
    p.add_argument("--stats", action="store_true", help="print a stats line on stderr")
    p.add_argument("--no-history", action="store_true",
                   help="neither write this run to the history database nor draft from earlier replies in it")
    add_sampling_flags(p)
    add_constraint_flags(p)
    p.set_defaults(func=cmd_run)
