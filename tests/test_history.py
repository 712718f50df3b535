import sqlite3
import subprocess
import sys
import textwrap

import pytest

from specchat import paths
from specchat.conversation import Conversation, last_code_block
from specchat.history import SCHEMA_VERSION, History, HistoryError


def test_save_reopen_and_schema(tmp_path):
    h = History(tmp_path / "h.db")
    assert h.schema_version == SCHEMA_VERSION == 1 and h.journal_mode == "wal"
    cid = h.new_conversation("smollm2", system="be kind")
    h.add_message(cid, "user", "What is 2+2?\nThanks")
    h.add_message(cid, "assistant", "4", profile="smollm2", stats={"tokens": 1})
    h.close()
    h2 = History(tmp_path / "h.db")
    conv = h2.load(cid)
    assert conv.title == "What is 2+2? Thanks" and conv.system == "be kind"
    assert conv.as_history() == [{"role": "user", "content": "What is 2+2?\nThanks"},
                                 {"role": "assistant", "content": "4"}]
    assert conv.messages[1].stats == {"tokens": 1}
    [info] = h2.list_conversations()
    assert info.id == cid and info.messages == 2


def test_newer_schema_is_refused_in_one_line(tmp_path):
    db = sqlite3.connect(tmp_path / "h.db")
    db.execute("PRAGMA user_version = 99")
    db.close()
    with pytest.raises(HistoryError) as e:
        History(tmp_path / "h.db")
    assert "newer" in str(e.value) and "\n" not in str(e.value)


def test_not_a_database_is_one_line(tmp_path):
    (tmp_path / "h.db").write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(HistoryError) as e:
        History(tmp_path / "h.db")
    assert "move it aside" in str(e.value)


def test_each_message_is_committed_when_complete(tmp_path):
    """A crash right after a message loses nothing already complete."""
    db = tmp_path / "h.db"
    code = textwrap.dedent(f"""
        import os
        from specchat.history import History
        h = History({str(db)!r})
        c = h.new_conversation("p")
        h.add_message(c, "user", "saved before the crash")
        os._exit(1)
    """)
    subprocess.run([sys.executable, "-c", code], check=False, cwd=str(paths.shipped_profiles_dir().parent))
    conv = History(db).load(1)
    assert [m.content for m in conv.messages] == ["saved before the crash"]


def test_export_markdown_default_and_chosen_path(tmp_path):
    h = History()
    cid = h.new_conversation("smollm2")
    h.add_message(cid, "user", "Show code")
    h.add_message(cid, "assistant", "```py\nx = 1\n```", profile="smollm2")
    out = h.export_markdown(cid)
    assert out.parent == paths.data_dir() / "exports" and out.name.startswith(f"{cid}-show-code")
    text = out.read_text()
    assert "## User\n\nShow code" in text and "## Assistant (smollm2)\n\n```py\nx = 1\n```" in text
    chosen = h.export_markdown(cid, tmp_path / "sub" / "c.md")
    assert chosen.read_text() == text


def test_conversation_regenerate_and_failure_turns_history_off(tmp_path):
    errors = []
    h = History(tmp_path / "h.db")
    conv = Conversation(h, "p", on_error=errors.append)
    conv.add("user", "q")
    conv.add("assistant", "a1")
    assert conv.pop_assistant() == "a1"
    conv.add("assistant", "a2")
    assert [m.content for m in h.load(conv.id).messages] == ["q", "a2"]
    h.db.close()  # the database goes away mid-session
    conv.add("user", "still works")
    assert conv.messages[-1]["content"] == "still works" and conv.history is None
    assert len(errors) == 1 and "history is off" in errors[0]


def test_last_code_block():
    assert last_code_block("a\n```py\nx\n```\nb\n```\ny\nz\n```") == "y\nz"
    assert last_code_block("```\nunterminated") == "unterminated"
    assert last_code_block("no code") is None
