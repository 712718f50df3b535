"""Both engines' MTP on one file: llama-server's draft-mtp (method mtp, backend llamaserver) on the tiny
qwen35 GGUF with MTP layers (tests/native/tiny_mtp.py) that the native engine drafts from too
(tests/native/test_gguf_mtp.py). The server loads the file's nextn layers, drafts with them, streams
token ids with its counters, and its greedy tokens are the native engine's; and with the file's head
taught the target's replies (tiny_mtp.teach_mtp_head), both engines draft and accept alike.

llama-server streams no chunk for a token whose text ends inside a UTF-8 character (it holds the
bytes until the character is complete, and the chunk that sends them names only its own token), so
such a token's id never arrives: the tiny vocabulary's byte tokens make that common here. The
backend counts such tokens (`tokens_predicted`) and leaves the reply's ids out; the comparison below
takes that into account: every id the server streams is the native engine's, in order, and its text,
token count and ending are the native reply's."""
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
from specchat.loading import load_speculative
from specchat.profiles import Profile

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
    streamed = [t for s in steps for t in s.token_ids]
    assert len(streamed) >= 8 and last.token_ids in (streamed, [])  # ids with gaps are left out of the summary
    assert last.spec_source == "llama-server /metrics" and last.draft_tokens > 0
    native = TorchBackend(path, threads=2, context=256, precision="float32")
    want = run_to_summary(native.stream(Request(messages=PROMPT), Sampling(max_tokens=24)))
    assert is_subsequence(streamed, want.token_ids) and streamed[:5] == want.token_ids[:5]
    # every token counted, those whose ids were withheld too: the same reply, ended the same way
    assert (last.text, last.tokens, last.stop_reason) == (want.text, want.tokens, want.stop_reason)


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


# prompts without digits: the tiny tokenizer's vocabulary, read back from a GGUF, splits numbers into
# single digits (Qwen3.5's rule) where the checkpoint's tokenizer does not
MESSAGES = ["the quick brown fox", "Paris is the capital of France.", "hello world, how are you today?",
            "speculative decoding is lossless when verified", "Berlin is the capital of Germany."]


@pytest.fixture(scope="module")
def taught(mtp_ggufs, tmp_path_factory):
    """The tiny qwen35 with its MTP head taught the target's greedy replies to MESSAGES, as a GGUF."""
    import shutil

    from transformers import AutoTokenizer

    from tests.native.convert import convert
    from tests.native.tiny_mtp import teach_mtp_head

    root = tmp_path_factory.mktemp("taught")
    ckpt = shutil.copytree(mtp_ggufs["qwen35", "hf"], root / "qwen35")
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    teach_mtp_head(ckpt, [tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True,
                                                  return_dict=True)["input_ids"] for m in MESSAGES])
    return convert([(ckpt, root / "qwen35-taught-F32.gguf", "f32")])[0]


@pytest.mark.parametrize("depth", [1, 3])
def test_both_engines_accept_alike_from_the_files_taught_head(server_binary, taught, tmp_path, depth):
    """The same file, the same prompts: specchat's MTP and llama-server's draft-mtp draft as many
    tokens and accept as many (measured, 160 tokens: 75 of 75 on both at depth 1; 88 of 186 on both
    at depth 3, where the head's own state stands in for the target's past the first guess; a tenth
    allowed for float differences between the engines). A head read or fed otherwise on one side
    (another hidden state, the concatenation swapped, the norms' 1 missing) would accept next to
    nothing there."""
    native = load_speculative(Profile(name="t", model=str(taught), dtype="float32", context=256, threads=2,
                                      speculative={"method": "mtp", "depth": depth, "adaptive": False}))
    settings = LlamaServerSettings(taught, "taught", context=512, threads=2,
                                   spec=tuple(speculation_args("mtp", depth=depth)))
    server = LlamaServerBackend(server_binary, settings, log=tmp_path / "server.log")
    counts = {}
    try:
        for name, engine in (("native", native), ("llama-server", server)):
            drafted = accepted = 0
            for m in MESSAGES:
                reply = run_to_summary(engine.stream(Request(messages=[{"role": "user", "content": m}]),
                                                     Sampling(max_tokens=32)))
                drafted, accepted = drafted + reply.draft_tokens, accepted + reply.accepted_tokens
            counts[name] = drafted, accepted
    finally:
        native.close()
        server.close()
    (drafted, accepted), (server_drafted, server_accepted) = counts["native"], counts["llama-server"]
    assert drafted >= 50 and accepted >= (0.9 if depth == 1 else 0.25) * drafted, counts
    assert abs(accepted - server_accepted) <= 0.1 * drafted and abs(drafted - server_drafted) <= 0.1 * drafted, counts


@pytest.mark.asyncio
async def test_one_ab_view_holds_both_engines_mtp_on_the_file(server_binary, taught):
    """`specchat ab -p native-mtp -r server-mtp`, driven through Pilot: specchat's MTP and llama-server's
    draft-mtp on the same file side by side, both drafting from the file's taught head and accepting,
    and the verdict no mismatch of specchat's drafter (the other engine is judged as `verify` judges
    one, against the speculative profile's own target-only)."""
    from pathlib import Path

    from specchat.tui.app import SpecChatApp
    from tests.tui.conftest import ab_open, wait_until

    profiles = Path(os.environ["SPECCHAT_PROFILES_DIR"])
    profiles.mkdir(parents=True, exist_ok=True)
    (profiles / "native-mtp.yaml").write_text(f"model: {taught}\ndtype: float32\ncontext: 256\nthreads: 2\n"
                                              "compile: false\nspeculative: {method: mtp, depth: 1, adaptive: false}\n")
    (profiles / "server-mtp.yaml").write_text(f"backend: llamaserver\nmodel: {taught}\ncontext: 512\nthreads: 2\n"
                                              "speculative: {method: mtp, depth: 1}\n")
    app = SpecChatApp("native-mtp", start_ab=True, ab_reference="server-mtp", history=False)
    async with app.run_test(size=(140, 32)) as pilot:
        await wait_until(pilot, lambda: ab_open(pilot.app, ready=True), timeout=300, what="A/B ready")
        ab = pilot.app.screen
        ab.query_one("#ab-prompt").text = MESSAGES[1]
        await pilot.click("#ab-prompt")
        await pilot.press("enter")
        await wait_until(pilot, lambda: ab.verdict is not None and not ab.running, timeout=300, what="verdict")
        spec, ref = ab.panes["spec"].summary, ab.panes["ref"].summary
        assert ab.verdict.ok and ab.verdict.kind != "mismatch", ab.verdict
        assert spec.accepted_tokens > 0 and ref.accepted_tokens > 0  # both drafted from the head, and hit
        # the same reply as far as both went: each runs to its own context's end (llama-server's two tokens
        # earlier here), and a last character the server never completes it never sends
        assert ref.spec_source == "llama-server /metrics" and spec.text.startswith(ref.text)
        assert len(ref.text) >= len(spec.text) - 2
    app.exit()
