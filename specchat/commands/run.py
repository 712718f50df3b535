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
from specchat.live import background_note, stats_line
from specchat.model_flag import add_model_flag, engine_line, engine_of


def cmd_run(args) -> int:
    from specchat.constraints import constraint_of
    from specchat.loading import load_backend, messages_for, sampling_of
    from specchat.stdin_text import StdinText

    prompt = args.prompt if args.prompt is not None else StdinText().read()
    if not prompt.strip():
        raise UsageError("empty prompt: pass it as an argument or on stdin")
    profile = overridden(chosen_profile(args, args.profile), args)
    if args.model is not None:  # which engine -m's file runs on, and why: said once
        print(engine_line(profile), file=sys.stderr)
    backend = load_backend(profile, background=True, start_background=False)  # started after the reply
    request = Request(messages=messages_for(profile, [{"role": "user", "content": prompt}], args.system),
                      constraint=constraint_of(profile))
    cancel = threading.Event()
    summary: Optional[Summary] = None
    try:
        events = backend.stream(request, sampling_of(profile), cancel)  # a refused prompt: exit 2
        try:
            for ev in events:
                if isinstance(ev, Summary):
                    summary = ev
                elif not args.json:
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
        except BackendError as e:  # the reply broke off (a server that died, timed out): a runtime failure
            if not args.json:
                sys.stdout.write("\n")
            err(str(e))
            return EXIT_RUNTIME
        note = background_note(backend)
    except KeyboardInterrupt:
        cancel.set()
        return 130
    finally:
        backend.close()
    assert summary is not None
    if args.json:
        engine, why = engine_of(profile)
        out = {"profile": profile.name, "backend": profile.backend, "engine": engine, "engine_reason": why,
               "method": profile.method,
               "depth": profile.speculative.depth if profile.method != "none" else 0, **summary.as_dict()}
        out["decode_tok_s"] = summary.decode_tok_s
        print(json.dumps(out))
    else:
        sys.stdout.write("\n")
        if args.stats:
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
    add_sampling_flags(p)
    add_constraint_flags(p)
    p.set_defaults(func=cmd_run)
