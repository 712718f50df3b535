"""Suffix decoding's memory across conversations, filled from the history database: bounded, newest
first, in the target's tokens; never a deleted conversation; off per profile; a missing or corrupt
database leaves it empty with one line; finished replies join it and replaced ones leave it."""
from __future__ import annotations

import sqlite3

import pytest

from specchat import suffix_memory
from specchat.backends.speculative.backend import SpeculativeBackend, make_suffix_drafter
from specchat.backends.speculative.suffix import SuffixSettings
from specchat.conversation import Conversation
from specchat.history import History
from specchat.profiles import load_profiles
from tests.native.tiny import make_hf_checkpoint


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from specchat.backends.native.engine import TorchBackend

    path = make_hf_checkpoint(tmp_path_factory.mktemp("suffix-memory") / "t", "llama", seed=21)
    return TorchBackend(path, "hf_dir", precision="float32", threads=2, context=256)


def backend_for(target, profile):
    sx = profile.speculative.suffix
    settings = SuffixSettings(memory=sx.history, memory_replies=sx.history_replies, memory_tokens=sx.history_tokens)
    return SpeculativeBackend(target, make_suffix_drafter(settings), 4)


def profile(**suffix):
    return load_profiles().get("smollm2-suffix").with_overrides({f"speculative.suffix.{k}": v for k, v in suffix.items()})


def remembered(backend) -> list[str]:
    memory = backend.memory
    return [backend.detokenize(memory.sequence(key)) for key in memory.spans]


def chat(history: History, *replies: str) -> int:
    cid = history.new_conversation("smollm2-suffix")
    for text in replies:
        history.add_message(cid, "user", "please")
        history.add_message(cid, "assistant", text)
    return cid


def test_earlier_replies_fill_the_memory_oldest_first_in_the_targets_tokens(target, tmp_path):
    history = History(tmp_path / "h.db")
    chat(history, "the quick brown fox", "jumps over")
    chat(history, "the lazy dog")
    p = profile()
    backend = backend_for(target, p)
    line = suffix_memory.warm(backend, p, history.path)
    assert remembered(backend) == ["the quick brown fox", "jumps over", "the lazy dog"]
    assert backend.memory.sequence(next(iter(backend.memory.spans))) == target.tokenizer.encode("the quick brown fox")
    tokens = sum(len(target.tokenizer.encode(t)) for t in ("the quick brown fox", "jumps over", "the lazy dog"))
    assert line.startswith(f"suffix memory: 3 earlier replies, {tokens} tokens")


def test_the_newest_replies_within_the_bounds(target, tmp_path):
    history = History(tmp_path / "h.db")
    chat(history, *[f"reply number {i} with some words" for i in range(10)])
    p = profile(history_replies=4)
    backend = backend_for(target, p)
    suffix_memory.warm(backend, p, history.path)
    assert remembered(backend) == [f"reply number {i} with some words" for i in range(6, 10)]
    per_reply = len(target.tokenizer.encode("reply number 9 with some words"))
    p = profile(history_tokens=max(100, per_reply * 3 + 1))
    backend = backend_for(target, p)
    suffix_memory.warm(backend, p, history.path)
    assert len(remembered(backend)) == max(100, per_reply * 3 + 1) // per_reply
    assert remembered(backend)[-1] == "reply number 9 with some words"


def test_a_deleted_conversation_is_never_read(target, tmp_path):
    history = History(tmp_path / "h.db")
    chat(history, "kept reply")
    gone = chat(history, "secret reply")
    history.delete_conversation(gone)
    # a database without foreign keys (another tool deleted the conversation row only): orphans stay unread
    orphan = chat(history, "orphaned reply")
    raw = sqlite3.connect(history.path)
    raw.execute("PRAGMA foreign_keys=OFF")
    raw.execute("DELETE FROM conversations WHERE id = ?", (orphan,))
    raw.commit()
    raw.close()
    assert history.db.execute("SELECT COUNT(*) FROM messages WHERE conversation_id = ?", (orphan,)).fetchone()[0] == 2
    p = profile()
    backend = backend_for(target, p)
    suffix_memory.warm(backend, p, history.path)
    assert remembered(backend) == ["kept reply"]


def test_history_off_in_the_profile_means_no_memory_and_nothing_read(target, tmp_path):
    p = profile(history=False)
    backend = backend_for(target, p)
    assert backend.memory is None
    assert suffix_memory.warm(backend, p, tmp_path / "not-even-there.db") is None
    suffix_memory.remember(backend, 1, 2, [5, 6, 7])  # nothing to remember into, nothing fails


@pytest.mark.parametrize("case", ["corrupt", "missing", "session-off", "not-a-history"])
def test_a_missing_or_corrupt_history_starts_empty_with_one_line(target, tmp_path, case):
    path = tmp_path / "h.db"
    if case == "corrupt":
        path.write_bytes(b"SQLite format 3\x00" + b"\xff" * 4000)
    elif case == "not-a-history":
        sqlite3.connect(path).execute("CREATE TABLE other (x)").connection.close()
    p = profile()
    backend = backend_for(target, p)
    line = suffix_memory.warm(backend, p, None if case == "session-off" else path)
    assert line.startswith("suffix memory starts empty: ") and "\n" not in line
    assert backend.memory.sequences == 0
    suffix_memory.remember(backend, None, None, [5, 6, 7])  # the chat goes on, and remembers its replies
    assert backend.memory.sequences == 1


def test_a_slow_read_shows_its_progress(target, tmp_path):
    history = History(tmp_path / "h.db")
    chat(history, *[f"reply {i}" for i in range(5)])
    p = profile()
    said = []
    suffix_memory.warm(backend_for(target, p), p, history.path, progress=said.append, slow_s=0.0)
    assert said and all(line.startswith("reading earlier replies into the suffix memory: ") for line in said)
    quiet = []
    suffix_memory.warm(backend_for(target, p), p, history.path, progress=quiet.append)
    assert quiet == []  # five short replies take no time worth showing


def test_finished_replies_join_the_memory_and_a_replaced_one_leaves_it(target, tmp_path):
    p = profile()
    backend = backend_for(target, p)
    conv = Conversation(History(tmp_path / "h.db"), "smollm2-suffix")
    conv.add("user", "hi")
    first = conv.add("assistant", "hello there")
    suffix_memory.remember(backend, conv.id, first, target.tokenizer.encode("hello there"))
    assert remembered(backend) == ["hello there"]
    suffix_memory.forget(backend, conv.id, conv.ids[-1])  # regenerate: the reply is replaced
    conv.pop_assistant()
    assert remembered(backend) == [] and conv.ids == [conv.ids[0]]
    second = conv.add("assistant", "hi again")
    suffix_memory.remember(backend, conv.id, second, target.tokenizer.encode("hi again"))
    suffix_memory.forget(backend, conv.id)  # a whole conversation deleted
    assert remembered(backend) == []


def test_verify_checks_later_prompts_with_drafts_from_earlier_replies(target):
    from specchat.backends.base import Sampling
    from specchat.prompts import PromptItem
    from specchat.verify import check_conversation

    p = profile()
    backend = backend_for(target, p)
    same = PromptItem("1", ["the quick brown fox jumps"])
    checks = [c for item in (same, PromptItem("2", ["hello world"]), same)
              for c, _ in check_conversation(backend, target, p, item, Sampling(max_tokens=24))]
    assert [c.verdict.kind for c in checks] == ["identical"] * 3
    assert backend.memory.sequences == 3
    # the prompt asked again drafts its whole earlier reply from the memory: fewer passes than the first time
    assert checks[2].speculative.passes < checks[0].speculative.passes
