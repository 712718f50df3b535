"""Run `python -m MODULE ARGS...` from the current directory and record which lines of some files ran.

    python scripts/mutation/line_trace.py OUT.json FILE[:FILE...] -- -m specchat.cli verify ...

mutation_run.py runs each `specchat verify` check once on the unmutated sandbox under this tracer.
A mutant whose statement never ran in a check cannot change that check's result (the program
takes the same path as the unmutated one), so that check is not run for it ("not reached").

FILEs are paths relative to the current directory; a module imported through a symlink
(specchat/backends -> ../backends) counts for its real file. OUT.json gets
{"exit": code, "seconds": wall time, "lines": {FILE: [line numbers]}}.
The current directory goes first on sys.path, as with `python -m`, so the sandbox's
packages are imported rather than an editable install's.
"""
from __future__ import annotations

import json
import os
import runpy
import sys
import threading
import time


def main() -> int:
    if len(sys.argv) < 5 or "--" not in sys.argv or sys.argv[sys.argv.index("--") + 1] != "-m":
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    out, files = sys.argv[1], sys.argv[2].split(os.pathsep)
    rest = sys.argv[sys.argv.index("--") + 1:]
    module, args = rest[1], rest[2:]
    targets = {os.path.realpath(f): f for f in files}
    hits: dict[str, set[int]] = {f: set() for f in files}
    known: dict[str, set[int] | None] = {}

    def on_call(frame, event, arg):
        name = frame.f_code.co_filename
        lines = known.get(name, False)
        if lines is False:
            rel = targets.get(os.path.realpath(name))
            lines = known[name] = hits[rel] if rel is not None else None
        if lines is None:
            return None
        lines.add(frame.f_lineno)

        def on_line(frame, event, arg):
            if event == "line":
                lines.add(frame.f_lineno)
            return on_line

        return on_line

    sys.path[0] = os.getcwd()
    sys.argv = [module] + args
    code, start = 0, time.monotonic()
    threading.settrace(on_call)
    sys.settrace(on_call)
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.settrace(None)
        threading.settrace(None)
        with open(out, "w") as f:
            json.dump({"exit": code, "seconds": round(time.monotonic() - start, 1),
                       "lines": {k: sorted(v) for k, v in hits.items()}}, f)
    return code


if __name__ == "__main__":
    sys.exit(main())
