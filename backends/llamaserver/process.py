"""One llama-server process on a loopback port: started, waited for until healthy, stopped.

The server runs under a keeper (`keeper.py`) that stops it as soon as this process is gone, however
it went, so no server is left behind. Its output goes to a log file; when it fails to start, the
log's own error line is what the user sees.
"""
from __future__ import annotations

import atexit
import contextlib
import socket
import subprocess
import sys
import time
import weakref
from pathlib import Path
from typing import Optional, Sequence

import httpx

from ..base import BackendError

HOST = "127.0.0.1"
PORT_TRIES = 3  # a free port can be taken between choosing it and the server binding it
_BIND_FAILED = ("couldn't bind", "address already in use", "failed to bind")
_running: "weakref.WeakSet[ServerProcess]" = weakref.WeakSet()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def port_taken(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return True
    return False


def log_error_line(log: Path) -> Optional[str]:
    """The line of a server log that says why it stopped (the last error, else the last line)."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return None
    errors = [ln for ln in lines if any(w in ln.lower() for w in ("error", "failed", "invalid", "unknown", "cannot"))]
    line = (errors or lines or [None])[-1]
    return None if line is None else " ".join(line.split())[:240]


class ServerProcess:
    """`binary args...` plus `--host 127.0.0.1 --port P`, running until `stop()`."""

    def __init__(self, binary: Path, args: Sequence[str], *, log: Path, port: Optional[int] = None,
                 startup_timeout_s: float = 120.0, where: str = "llama-server"):
        self.binary, self.args, self.log = Path(binary), list(args), Path(log)
        self.fixed_port, self.startup_timeout_s, self.where = port, startup_timeout_s, where
        self.port: Optional[int] = None
        self.keeper: Optional[subprocess.Popen] = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> "ServerProcess":
        if not self.binary.is_file():
            raise BackendError(f"{self.where}: no llama-server at {self.binary}: fix llama_server.binary, "
                               "or leave it unset to build one")
        if self.fixed_port is not None and port_taken(self.fixed_port):
            raise BackendError(f"{self.where}: port {self.fixed_port} on {HOST} is already taken by another program: "
                               "choose another llama_server.port, or leave it unset for a free one")
        for attempt in range(1 if self.fixed_port is not None else PORT_TRIES):
            self.port = self.fixed_port if self.fixed_port is not None else free_port()
            self._spawn()
            try:
                self._wait_healthy()
                return self
            except _PortLost:
                self.stop()
                if self.fixed_port is not None or attempt == PORT_TRIES - 1:
                    raise BackendError(f"{self.where}: port {self.port} on {HOST} was taken before llama-server "
                                       "could use it: run again, or choose llama_server.port") from None
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")

    def _spawn(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "specchat.backends.llamaserver.keeper", str(self.binary), *self.args,
               "--host", HOST, "--port", str(self.port)]
        with open(self.log, "wb") as out:
            out.write((" ".join(cmd[3:]) + "\n").encode())
            out.flush()
            # Its own session: the terminal's Ctrl-C cancels a reply in specchat, not the server under it.
            self.keeper = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                                           start_new_session=True)
        _running.add(self)

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(timeout=2.0) as client:
            while True:
                code = self.keeper.poll()
                if code is not None:
                    line = log_error_line(self.log) or f"exit status {code}"
                    if any(w in line.lower() for w in _BIND_FAILED):
                        raise _PortLost()
                    raise BackendError(f"{self.where}: llama-server stopped while starting ({line}); "
                                       f"its log: {self.log}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise BackendError(f"{self.where}: llama-server was not ready after {self.startup_timeout_s:g}s "
                                       f"(still loading? raise llama_server.startup_timeout_s); its log: {self.log}")
                time.sleep(0.1)

    def alive(self, settle_s: float = 0.0) -> bool:
        """Whether the server still runs; `settle_s`: give a server that just died time to be seen dead
        (its keeper exits right after it)."""
        if self.keeper is None:
            return False
        try:
            self.keeper.wait(settle_s) if settle_s else None
        except subprocess.TimeoutExpired:
            pass
        return self.keeper.poll() is None

    def peak_rss_bytes(self) -> Optional[int]:
        """The server's own peak resident memory (Linux; None elsewhere or once it is gone)."""
        if self.keeper is None:
            return None
        try:
            pids = Path(f"/proc/{self.keeper.pid}/task/{self.keeper.pid}/children").read_text().split()
            for line in Path(f"/proc/{pids[0]}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except (OSError, IndexError, ValueError):
            pass
        return None

    def stop(self) -> None:
        """Stop the server and wait until it is gone (closing the keeper's stdin is the signal)."""
        keeper, self.keeper = self.keeper, None
        if keeper is None:
            return
        with contextlib.suppress(OSError):
            keeper.stdin.close()
        try:
            keeper.wait(10)
        except subprocess.TimeoutExpired:
            keeper.kill()
            keeper.wait()
        _running.discard(self)


class _PortLost(Exception):
    pass


@atexit.register
def _stop_all() -> None:
    for server in list(_running):
        server.stop()
