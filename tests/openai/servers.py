"""Servers for the openai backend's tests, all on loopback.

`LlamaCppServer`: llama-cpp-python's real OpenAI-compatible server on the default GGUF, run by
`scripts/llamacpp_server.py` in a child process. `ReplayServer`: answers with responses recorded
by hand from vLLM's, SGLang's and llama-server's documented formats (`recorded/`), for the
speculative metrics that only those servers report.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
RECORDED = Path(__file__).parent / "recorded"
MODEL = "smollm2-135m-instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaCppServer:
    def __init__(self, gguf: Path, log_dir: Path, api_key_env: str | None = None, env: dict | None = None):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.log = log_dir / f"server-{self.port}.log"
        cmd = [sys.executable, str(ROOT / "scripts" / "llamacpp_server.py"), "--model", str(gguf),
               "--port", str(self.port), "--n-ctx", "2048", "--threads", "1"]  # spinning worker threads crawl on a busy 2-core machine
        if api_key_env:
            cmd += ["--api-key-env", api_key_env]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                         env={**os.environ, **(env or {})})
        self._wait_ready()

    def _wait_ready(self, timeout: float = 120.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}): {self.log.read_text()[-2000:]}")
            try:
                httpx.get(f"{self.base_url}/models", timeout=1.0)  # any answer (even 401) means it is up
                return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not come up in {timeout:.0f}s: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        """Die at once, the way a crashed server goes."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


class ReplayServer:
    """`/<kind>/v1/...` for kind in vllm, vllm-per-request (started with --per-request-spec-decode-metrics),
    sglang, llama-server: the recorded reply of that server.
    vLLM's /metrics answers the counters before a request, then after it, in turn. Kind `silent`
    starts a reply and then sends nothing."""

    def __init__(self):
        self.requests: list[tuple[str, dict, dict]] = []  # (path, headers, body)
        self.metrics_calls = 0
        replay = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code: int, body: bytes, kind: str = "application/json"):
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                kind, _, rest = self.path.lstrip("/").partition("/")
                if rest == "v1/models":
                    self._send(200, json.dumps({"object": "list", "data": [{"id": "Qwen/Qwen3-8B"}]}).encode())
                elif rest == "metrics" and kind.startswith("vllm"):
                    name = "vllm-metrics-before.txt" if replay.metrics_calls % 2 == 0 else "vllm-metrics-after.txt"
                    replay.metrics_calls += 1
                    self._send(200, (RECORDED / name).read_bytes(), "text/plain; version=0.0.4")
                else:
                    self._send(404, b'{"detail":"Not Found"}')

            def do_POST(self):
                kind, _, rest = self.path.lstrip("/").partition("/")
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                replay.requests.append((self.path, dict(self.headers), body))
                if rest != "v1/chat/completions":
                    self._send(404, b'{"detail":"Not Found"}')
                elif body.get("model") != "Qwen/Qwen3-8B":  # as vLLM answers
                    self._send(404, json.dumps({"object": "error", "message": f"The model `{body.get('model')}` "
                                                "does not exist.", "type": "NotFoundError", "param": None,
                                                "code": 404}).encode())
                elif kind == "silent":  # headers, then nothing for a long while (a long prefill)
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    self.wfile.flush()
                    time.sleep(5)
                elif kind == "not-sse":  # a proxy or a non-OpenAI server: a stream request answered as JSON
                    self._send(200, (RECORDED / "sglang-response.json").read_bytes())
                elif not body.get("stream"):
                    self._send(200, (RECORDED / f"{kind}-response.json").read_bytes())
                else:
                    self._send(200, (RECORDED / f"{kind}-stream.txt").read_bytes(), "text/event-stream")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def base_url(self, kind: str) -> str:
        return f"http://127.0.0.1:{self.port}/{kind}/v1"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class InFlightServer:
    """An OpenAI-compatible server on loopback whose reply depends on whether other requests were
    in flight with it, as a batching server's may: alone it streams the tokens of `alone`; with
    others, those of `crowded`. Each request waits `hold_s` before it answers, so that requests
    sent together overlap even on a busy machine. Token ids come with the text, in llama-server's
    logprobs format."""

    def __init__(self, alone: str = " a b c d", crowded: str = " a b x d", hold_s: float = 1.0,
                 drop_crowded: bool = False, stall_crowded: bool = False):
        """drop_crowded: a request with others in flight gets its connection closed mid-reply;
        stall_crowded: it sends one chunk and then nothing more until the server stops."""
        self.in_flight = 0
        self.most_in_flight = 0
        lock = threading.Lock()
        server = self
        ids = {piece: n for n, piece in enumerate(sorted(set(alone.split()) | set(crowded.split())), 10)}

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                body = json.dumps({"object": "list", "data": [{"id": MODEL}]}).encode()
                self.send_response(200 if self.path == "/v1/models" else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path != "/v1/chat/completions":
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                with lock:
                    server.in_flight += 1
                    server.most_in_flight = max(server.most_in_flight, server.in_flight)
                    crowd = server.in_flight
                end = time.monotonic() + hold_s
                while time.monotonic() < end:  # the most in flight at any time while it waits
                    time.sleep(0.02)
                    with lock:
                        crowd = max(crowd, server.in_flight)
                text = alone if crowd == 1 else crowded
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                try:
                    if drop_crowded and crowd > 1:  # a server that falls over under load
                        self.wfile.write(b'data: {"choices": [{"index": 0, "delta": {"content": " a"}}]}\n\n')
                        self.wfile.flush()
                        self.close_connection = True
                        self.connection.shutdown(2)
                        return
                    if stall_crowded and crowd > 1:  # a server that hangs under load, connection open
                        self.wfile.write(b'data: {"choices": [{"index": 0, "delta": {"content": " a"}}]}\n\n')
                        self.wfile.flush()
                        server.stopped.wait()
                        return
                    for piece in text.split():
                        delta = {"content": " " + piece}
                        logprobs = {"content": [{"id": ids[piece], "token": " " + piece, "logprob": -0.1,
                                                 "top_logprobs": []}]}
                        chunk = {"object": "chat.completion.chunk", "model": MODEL,
                                 "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": None}]}
                        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    end = {"object": "chat.completion.chunk", "model": MODEL,
                           "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
                    self.wfile.write(f"data: {json.dumps(end)}\n\ndata: [DONE]\n\n".encode())
                    self.wfile.flush()
                finally:
                    with lock:
                        server.in_flight -= 1

        self.stopped = threading.Event()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        self.httpd.shutdown()
        self.httpd.server_close()
