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
