"""What reading a server's event stream costs on this CPU: httpx-sse (backends/openai/http.py's
EventStream) against the hand-written parser it replaced (commit 03eb0ac), on the same stream.

The stream is synthesized from tests/openai/recorded/llama-server-stream.txt: its content chunks
(text, logprobs with token ids) repeated to `--events` events, its final chunk (usage, timings with
draft_n / draft_n_accepted) and `[DONE]`. It is fed from memory, so only parsing is timed: httpx
decoding the bytes, splitting lines, assembling events and json.loads of each payload.
Two chunkings: one event per network read (how llama-server and vLLM flush a token) and 64 KiB
reads (a client that fell behind). Reported: microseconds per event, median of `--repeats` runs,
and json.loads alone as the floor both parsers share.

    python scripts/sse_parse_bench.py [--events 2000] [--repeats 31]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from importlib.metadata import version
from pathlib import Path
from typing import Callable, Iterator

import httpx

from specchat.backends.openai.http import EventStream

RECORDED = Path(__file__).resolve().parents[1] / "tests" / "openai" / "recorded" / "llama-server-stream.txt"


def old_parser(response: httpx.Response) -> Iterator[dict]:
    """The hand-written parser as it was before 03eb0ac, kept here only to time against."""
    data: list[str] = []
    for line in response.iter_lines():
        if line.startswith("data:"):
            data.append(line[5:].lstrip())
            if data[-1] == "[DONE]":
                return
            try:
                payload = json.loads("\n".join(data))
            except json.JSONDecodeError:
                continue
            data = []
            if isinstance(payload, dict):
                yield payload
        elif not line.strip():
            data = []


def library_parser(response: httpx.Response) -> Iterator[dict]:
    return iter(EventStream(response))


def synthesized_events(n: int) -> list[bytes]:
    events = [e + "\n\n" for e in RECORDED.read_text().split("\n\n") if e.strip()]
    content = [e for e in events if '"content":"' in e and '"timings"' not in e]
    final = [e for e in events if '"timings"' in e]
    body = [content[i % len(content)] for i in range(n - 1)] + final + ["data: [DONE]\n\n"]
    return [e.encode() for e in body]


def response_of(reads: list[bytes]) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=iter(reads),
                          request=httpx.Request("POST", "http://127.0.0.1:8080/v1/chat/completions"))


def one_run(parse: Callable[[httpx.Response], Iterator[dict]], reads: list[bytes], events: int) -> float:
    response = response_of(reads)
    start = time.perf_counter()
    got = sum(1 for _ in parse(response))
    elapsed = time.perf_counter() - start
    assert got == events, (got, events)
    return elapsed


def us_per_event(reads: list[bytes], events: int, repeats: int) -> tuple[float, float]:
    """(hand-written, httpx-sse) microseconds per event. The runs alternate, so a busy machine
    slows both alike rather than whichever ran while it was busy."""
    old, new = [], []
    for i in range(repeats):
        pair = (old_parser, library_parser) if i % 2 == 0 else (library_parser, old_parser)
        for parse in pair:
            (old if parse is old_parser else new).append(one_run(parse, reads, events))
    return statistics.median(old) / events * 1e6, statistics.median(new) / events * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=31)
    args = ap.parse_args()
    per_event = synthesized_events(args.events)
    whole = b"".join(per_event)
    bulk = [whole[i:i + 65536] for i in range(0, len(whole), 65536)]
    payloads = [e[len(b"data: "):].strip() for e in per_event[:-1]]

    # Both parsers must agree before their times mean anything.
    assert list(old_parser(response_of(per_event))) == list(library_parser(response_of(per_event)))
    print(f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, "
          f"httpx {httpx.__version__}, httpx-sse {version('httpx-sse')}; {args.events} events, {len(whole) / 1024:.0f} KiB, "
          f"median of {args.repeats}")
    floor = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for p in payloads:
            json.loads(p)
        floor.append(time.perf_counter() - start)
    print(f"  json.loads alone:        {statistics.median(floor) / args.events * 1e6:6.1f} us/event")
    for label, reads in (("one event a read", per_event), ("64 KiB reads", bulk)):
        old, new = us_per_event(reads, args.events, args.repeats)
        print(f"  {label + ':':24s} hand-written {old:6.1f} us/event · httpx-sse {new:6.1f} us/event "
              f"({new / old:.2f}x, {new - old:+.1f} us)")


if __name__ == "__main__":
    main()
