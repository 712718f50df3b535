"""Runs one server process for specchat and makes sure it never outlives specchat.

    python -m specchat.backends.llamaserver.keeper BINARY ARGS...

specchat holds the write end of this process's stdin. When specchat closes it, exits, crashes or
is killed (SIGKILL included), the read here returns and the server is stopped. The server itself
is started with the kernel's parent-death signal, so killing this keeper kills it too. The keeper
exits with the server's exit status when the server stops on its own.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading

STOP_GRACE_S = 5.0
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the keeper goes (Linux; elsewhere stdin EOF still works)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: keeper BINARY ARGS...", file=sys.stderr)
        return 2
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent if os.name == "posix" else None)
    except OSError as e:
        print(f"keeper: cannot start {argv[0]}: {e.strerror or e}", file=sys.stderr, flush=True)
        return 127

    def watch_parent() -> None:
        try:
            while sys.stdin.buffer.read(4096):
                pass
        except (OSError, ValueError):
            pass
        stop(proc)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop(proc))
    threading.Thread(target=watch_parent, daemon=True).start()
    code = proc.wait()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    status = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(status)  # not sys.exit: the thread blocked reading stdin would stall interpreter shutdown
