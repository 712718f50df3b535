"""Both engines' MTP on one file: llama-server's draft-mtp (method mtp, backend llamaserver) on the tiny
qwen35 GGUF with MTP layers (tests/native/tiny_mtp.py) that the native engine drafts from too
(tests/native/test_gguf_mtp.py). The server loads the file's nextn layers, drafts with them, streams
token ids with its counters, and its greedy tokens are the native engine's.

llama-server streams no chunk for a token whose text ends inside a UTF-8 character (it holds the
bytes until the character is complete, and the chunk that sends them names only its own token), so
such a token's id never arrives: the tiny vocabulary's byte tokens make that common here. The
comparison below takes that into account: every id the server streams is the native engine's, in
order, and its text is the native reply's."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from specchat.backends.base import Request, Sampling, Step, Summary, run_to_summary
from specchat.backends.llamaserver.backend import LlamaServerBackend, LlamaServerSettings
from specchat.backends.llamaserver.flags import speculation_args
from specchat.backends.native.engine import TorchBackend

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the first test may build llama-server

PROMPT = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog. Paris is the capital of"}]


def is_subsequence(part: list[int], whole: list[int]) -> bool:
    it = iter(whole)
    return all(any(t == w for w in it) for t in part)


def test_llama_servers_draft_mtp_runs_the_files_own_mtp_layers(server_binary, mtp_ggufs, tmp_path):
    path = mtp_ggufs["qwen35"]
    settings = LlamaServerSettings(path, "tiny-qwen35", context=512, threads=2,
                                   spec=tuple(speculation_args("mtp", depth=2)))
    log = tmp_path / "server.log"
    try:
        server = LlamaServerBackend(server_binary, settings, log=log)
    except Exception as e:  # noqa: BLE001 - a llama.cpp that cannot run this file's MTP: say why
        pytest.skip(f"llama-server did not start draft-mtp on the tiny qwen35 file: {e}")
    try:
        assert server.spec_label == "draft-mtp ×2"
        events = list(server.stream(Request(messages=PROMPT), Sampling(max_tokens=24)))
    finally:
        server.close()
    assert "creating MTP draft context" in log.read_text(errors="replace")  # its nextn layers, not a fallback
    steps, last = events[:-1], events[-1]
    assert steps and all(isinstance(e, Step) for e in steps) and isinstance(last, Summary)
    assert last.token_ids == [t for s in steps for t in s.token_ids] and len(last.token_ids) >= 8
    assert last.spec_source == "llama-server /metrics" and last.draft_tokens > 0
    native = TorchBackend(path, threads=2, context=256, precision="float32")
    want = run_to_summary(native.stream(Request(messages=PROMPT), Sampling(max_tokens=24)))
    assert is_subsequence(last.token_ids, want.token_ids) and last.token_ids[:5] == want.token_ids[:5]
    assert want.text.startswith(last.text) and len(last.text) >= len(want.text) // 2


def specchat(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "specchat.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ))


def test_one_bench_runs_both_engines_mtp_on_the_file(server_binary, mtp_ggufs, tmp_path):
    """`specchat bench` with a native MTP profile and a llama-server MTP profile on the same file, each
    against its own engine's target-only: four rows, both MTP rows on the file's head. (Their tokens
    per pass are 1.0 here: the tiny head is random, its guesses land on neither engine.)"""
    path = mtp_ggufs["qwen35"]
    native = tmp_path / "native-mtp.yaml"
    native.write_text(f"model: {path}\ndtype: float32\ncontext: 256\nthreads: 2\ncompile: false\n"
                      "speculative: {method: mtp, depth: 2, adaptive: false}\n")
    server = tmp_path / "server-mtp.yaml"
    server.write_text(f"backend: llamaserver\nmodel: {path}\ncontext: 512\nthreads: 2\n"
                      "speculative: {method: mtp, depth: 2}\n")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question_id": 0, "turns": ["the quick brown fox"]}) + "\n")
    done = specchat("bench", "-p", str(native), "-p", str(server), "--prompts", str(prompts), "--max-tokens", "16",
                    "--json")
    assert done.returncode == 0, done.stderr
    rows = {row["label"]: row for row in json.loads(done.stdout)["rows"]}
    assert set(rows) == {"native-mtp", "server-mtp", "native-mtp:target-only", "server-mtp:target-only"}
    for label, backend in (("native-mtp", "torch"), ("server-mtp", "llamaserver")):
        row = rows[label]
        assert (row["backend"], row["method"], row["depth"], row["model"]) == (backend, "mtp", 2, str(path))
        assert row["tokens"] > 0 and row["reference"] == f"{label}:target-only"
