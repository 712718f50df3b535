"""HTTP to an OpenAI-compatible server: JSON requests, a server-sent-event stream, and every
failure turned into one `BackendError` line that says what to fix.

The API key lives only in the client's Authorization header: it is never part of a message,
a repr or a log line.
"""
from __future__ import annotations

import contextlib
import json
import socket
import threading
from typing import Iterator, Optional
from urllib.parse import urlsplit

import httpx
from httpx_sse import EventSource, SSEError

from ..base import BackendError
from .chunks import error_message

CONNECT_TIMEOUT_S = 10.0


def server_root(base_url: str) -> str:
    """`http://host:8000/v1` -> `http://host:8000`: where /metrics, /tokenize and friends live."""
    url = base_url.rstrip("/")
    return url[:-len("/v1")] if url.endswith("/v1") else url


def _one_line(text: str, limit: int = 240) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[:limit - 1] + "…"


class ServerConnection:
    def __init__(self, base_url: str, *, api_key: Optional[str] = None, api_key_env: Optional[str] = None,
                 timeout_s: float = 60.0, where: str = "the server"):
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise BackendError(f"{where}: server.base_url {base_url!r} is not an http(s) URL "
                               "(e.g. http://127.0.0.1:8000/v1)")
        self.base_url = base_url.rstrip("/")
        self.root = server_root(self.base_url)
        self.where = where
        self.api_key_env = api_key_env
        self.has_key = bool(api_key)
        self.timeout_s = timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = self._new_client()
        self._retired: list[httpx.Client] = []

    def _new_client(self) -> httpx.Client:
        return httpx.Client(headers=self._headers, timeout=httpx.Timeout(
            self.timeout_s, connect=min(self.timeout_s, CONNECT_TIMEOUT_S)))

    def reset(self) -> None:
        """Drop pooled connections: after a reply broke off, the server has usually closed its end,
        and reusing that connection would fail the next request too. The old client is closed only
        with the connection: other replies in flight on it (requests sent concurrently) go on."""
        self._retired.append(self.client)
        self.client = self._new_client()

    def __repr__(self) -> str:
        return f"ServerConnection({self.base_url!r}, key={'from $' + self.api_key_env if self.has_key else 'none'})"

    def close(self) -> None:
        for client in [*self._retired, self.client]:
            client.close()
        self._retired.clear()

    def url(self, path: str, root: bool = False) -> str:
        return (self.root if root else self.base_url) + path

    # -------------------------------------------------------------------- errors
    def transport_error(self, e: Exception, url: str, during: str = "") -> BackendError:
        if isinstance(e, httpx.ConnectTimeout):
            return BackendError(f"{self.where}: no answer from {url} within {CONNECT_TIMEOUT_S:.0f}s: "
                                "is the host right and reachable?")
        if isinstance(e, httpx.ConnectError):
            return BackendError(f"{self.where}: cannot connect to {url} ({_reason(e)}): is the server running "
                                "on that host and port? (server.base_url)")
        if isinstance(e, httpx.ReadTimeout):
            return BackendError(f"{self.where}: {url} sent nothing for {self.timeout_s:g}s{during}: the server is "
                                "stuck or overloaded; raise server.timeout_s if it is just slow")
        if isinstance(e, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
            return BackendError(f"{self.where}: the server closed the connection{during} ({_reason(e)}): "
                                "it may have crashed or been stopped")
        if isinstance(e, httpx.TimeoutException):
            return BackendError(f"{self.where}: {url} timed out after {self.timeout_s:g}s{during}; "
                                "raise server.timeout_s if the server is just slow")
        return BackendError(f"{self.where}: {url}: {type(e).__name__}: {_reason(e)}")

    def status_error(self, response: httpx.Response, model: Optional[str] = None) -> BackendError:
        code, url = response.status_code, str(response.request.url)
        try:
            message = error_message(response.json())
        except (ValueError, json.JSONDecodeError):
            message = None
        message = _one_line(message or response.reason_phrase or "")
        if code in (401, 403):
            fix = (f"check the key in ${self.api_key_env}" if self.has_key else
                   "the server wants a key: name the environment variable that holds it in server.api_key_env")
            return BackendError(f"{self.where}: {url} refused the API key (HTTP {code}): {fix}")
        if code == 404 and model and message and model in message:
            return BackendError(f"{self.where}: the server has no model {model!r} (HTTP 404: {message}); "
                                "fix `model:` to a name the server serves (GET /v1/models lists them)")
        if code == 404:
            return BackendError(f"{self.where}: {url} not found (HTTP 404): is server.base_url the "
                                "OpenAI-compatible root (usually ending in /v1)?")
        error = BackendError(f"{self.where}: the server answered HTTP {code} for {url}: {message}")
        error.status, error.said = code, message  # for a caller that knows what the request asked
        return error

    # ------------------------------------------------------------------ requests
    def request(self, method: str, path: str, *, root: bool = False, body: Optional[dict] = None,
                model: Optional[str] = None, ok_404: bool = False) -> Optional[httpx.Response]:
        """One request; a non-2xx answer becomes a BackendError (or None for a 404 when `ok_404`)."""
        url = self.url(path, root)
        try:
            response = self.client.request(method, url, json=body)
        except httpx.HTTPError as e:
            self.reset()
            raise self.transport_error(e, url) from None
        if ok_404 and response.status_code in (404, 405):
            return None
        if response.is_error:
            raise self.status_error(response, model)
        return response

    def post_json(self, path: str, body: dict, *, root: bool = False, ok_404: bool = False,
                  model: Optional[str] = None) -> Optional[dict]:
        response = self.request("POST", path, root=root, body=body, ok_404=ok_404, model=model)
        return None if response is None else _json(response, self.where)

    @contextlib.contextmanager
    def events(self, path: str, body: dict, cancel: Optional[threading.Event] = None,
               model: Optional[str] = None, root: bool = False) -> Iterator["EventStream"]:
        """POST and iterate over the JSON payloads of the server-sent events until `[DONE]`.

        A set `cancel` closes the connection even while the server is silent (a long prefill):
        the server sees the client go and stops generating."""
        url = self.url(path, root)
        try:
            with self.client.stream("POST", url, json=body) as response:
                if response.is_error:
                    response.read()
                    raise self.status_error(response, model)
                finished = threading.Event()
                if cancel is not None:
                    threading.Thread(target=_close_on_cancel, args=(cancel, finished, response), daemon=True).start()
                try:
                    yield EventStream(response, self.where)
                finally:
                    finished.set()
        except BackendError:
            raise
        except Exception as e:
            if cancel is not None and cancel.is_set():
                return  # the connection we closed ourselves on cancel
            self.reset()
            if isinstance(e, httpx.HTTPError):
                raise self.transport_error(e, url, " mid-reply") from None
            if isinstance(e, httpx.StreamError):
                raise BackendError(f"{self.where}: the reply stream from {url} broke off mid-reply") from None
            raise


def _reason(e: Exception) -> str:
    text = str(e) or type(e).__name__
    if "refused" in text.lower():
        return "connection refused"
    return _one_line(text, 120)


def _json(response: httpx.Response, where: str) -> dict:
    try:
        data = response.json()
    except (ValueError, json.JSONDecodeError):
        raise BackendError(f"{where}: {response.request.url} did not answer JSON; is it an OpenAI-compatible "
                           "server?") from None
    if not isinstance(data, dict):
        raise BackendError(f"{where}: {response.request.url} answered an unexpected JSON {type(data).__name__}")
    return data


def _close_on_cancel(cancel: threading.Event, finished: threading.Event, response: httpx.Response) -> None:
    """Wake the reader blocked on a silent server: shutting the socket down ends its read at once
    (closing it from this thread would not); the reader's side then closes the response."""
    while not finished.is_set():
        if cancel.wait(0.05):
            stream = response.extensions.get("network_stream")
            sock = stream.get_extra_info("socket") if stream is not None else None
            if sock is not None and not finished.is_set():
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            return


class EventStream:
    """The JSON payloads of a server-sent event stream (parsed by httpx-sse); `done` once the server
    said `[DONE]`. Events that are not a JSON object (keep-alives, other fields) carry nothing we use.

    httpx-sse rather than our own line loop: it ends lines only at CR / LF / CRLF as the SSE spec says
    (the loop it replaced split at U+2028 and NEL too, as str.splitlines does, and lost any token that
    held one) and dispatches an event at its blank line, so a payload over several data lines needs no
    guessing; under 1 us an event more (scripts/sse_parse_bench.py, docs/servers.md)."""

    def __init__(self, response: httpx.Response, where: str = "the server"):
        self.response = response
        self.where = where
        self.done = False

    def __iter__(self) -> Iterator[dict]:
        try:
            for event in EventSource(self.response).iter_sse():
                if event.data == "[DONE]":
                    self.done = True
                    return
                try:
                    payload = json.loads(event.data)
                except json.JSONDecodeError:
                    continue
                if isinstance(payload, dict):
                    yield payload
        except SSEError:
            kind = self.response.headers.get("content-type", "") or "no content type"
            raise BackendError(f"{self.where}: {self.response.request.url} answered a stream request with {kind}, "
                               "not server-sent events: is it an OpenAI-compatible server?") from None
