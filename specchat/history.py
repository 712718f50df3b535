"""Conversation history: SQLite in `paths.data_dir()/history.db`, saved as it happens.

Each message is committed as soon as it is complete, so a crash loses at most the reply in
progress. The schema is versioned with `PRAGMA user_version` and the database runs in WAL mode
so a reader (another specchat window) never blocks the writer.
"""
from __future__ import annotations

import json
import re
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from specchat import paths

SCHEMA_VERSION = 1

_SCHEMA = [
    """CREATE TABLE IF NOT EXISTS conversations (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        title TEXT NOT NULL DEFAULT '',
        profile TEXT NOT NULL DEFAULT '',
        system TEXT,
        created REAL NOT NULL,
        updated REAL NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS messages (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
        content TEXT NOT NULL,
        profile TEXT,
        stats TEXT,
        created REAL NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id)",
]


class HistoryError(Exception):
    """One line: what is wrong with the history database and what to do."""


@dataclass
class ConversationInfo:
    id: int
    title: str
    profile: str
    created: float
    updated: float
    messages: int


@dataclass
class StoredMessage:
    id: int
    role: str
    content: str
    profile: Optional[str] = None
    stats: dict = field(default_factory=dict)


@dataclass
class StoredConversation:
    id: int
    title: str
    profile: str
    system: Optional[str]
    messages: list[StoredMessage]

    def as_history(self) -> list[dict]:
        return [{"role": m.role, "content": m.content} for m in self.messages if m.role != "system"]


def default_path() -> Path:
    return paths.data_dir() / "history.db"


def read_recent_replies(path: Path | str, limit: int) -> list[tuple[int, int, str]]:
    """(conversation id, message id, text) of the newest `limit` replies, newest first, read without
    writing anything: only replies of conversations that still exist (a deleted conversation's
    messages go with it; one a database without foreign keys left behind is never joined).
    HistoryError (one line) when the database is missing or cannot be read."""
    path = Path(path)
    if not path.is_file():
        raise HistoryError(f"no history database at {path} yet")
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            return db.execute(
                "SELECT m.conversation_id, m.id, m.content FROM messages m JOIN conversations c "
                "ON c.id = m.conversation_id WHERE m.role = 'assistant' ORDER BY m.id DESC LIMIT ?",
                (limit,)).fetchall()
        finally:
            db.close()
    except sqlite3.Error as e:
        raise HistoryError(f"history database {path} cannot be read ({e})") from None


def _title_of(text: str) -> str:
    line = " ".join(text.split())
    return line[:60] + ("…" if len(line) > 60 else "")


class History:
    def __init__(self, path: Path | str | None = None):
        self.path = Path(path) if path is not None else default_path()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
        except sqlite3.DatabaseError as e:
            raise HistoryError(f"history database {self.path} cannot be used ({e}); "
                               "move it aside to start a fresh one") from None

    # -------------------------------------------------------------------- schema
    def _migrate(self) -> None:
        version = self.db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise HistoryError(f"history database {self.path} is schema version {version}, newer than "
                               f"this specchat understands ({SCHEMA_VERSION}); upgrade specchat")
        if version < 1:
            with self.db:
                self.db.execute("BEGIN")
                for stmt in _SCHEMA:
                    self.db.execute(stmt)
                self.db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    @property
    def schema_version(self) -> int:
        return self.db.execute("PRAGMA user_version").fetchone()[0]

    @property
    def journal_mode(self) -> str:
        return self.db.execute("PRAGMA journal_mode").fetchone()[0]

    def close(self) -> None:
        self.db.close()

    # -------------------------------------------------------------------- writes
    def new_conversation(self, profile: str = "", system: Optional[str] = None, title: str = "") -> int:
        now = time.time()
        cur = self.db.execute(
            "INSERT INTO conversations (title, profile, system, created, updated) VALUES (?, ?, ?, ?, ?)",
            (title, profile, system, now, now))
        return int(cur.lastrowid)

    def add_message(self, conversation_id: int, role: str, content: str,
                    profile: Optional[str] = None, stats: Optional[dict] = None) -> int:
        now = time.time()
        with self.db:
            self.db.execute("BEGIN")
            cur = self.db.execute(
                "INSERT INTO messages (conversation_id, role, content, profile, stats, created) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (conversation_id, role, content, profile, json.dumps(stats) if stats else None, now))
            self.db.execute("UPDATE conversations SET updated = ?, "
                            "title = CASE WHEN title = '' AND ? = 'user' THEN ? ELSE title END WHERE id = ?",
                            (now, role, _title_of(content), conversation_id))
        return int(cur.lastrowid)

    def set_system(self, conversation_id: int, system: Optional[str]) -> None:
        self.db.execute("UPDATE conversations SET system = ?, updated = ? WHERE id = ?",
                        (system, time.time(), conversation_id))

    def set_profile(self, conversation_id: int, profile: str) -> None:
        self.db.execute("UPDATE conversations SET profile = ? WHERE id = ?", (profile, conversation_id))

    def delete_last(self, conversation_id: int, role: str) -> None:
        """The conversation's last message, if it has `role`: a regenerated reply is replaced, not
        kept twice; a user turn that got no reply does not stay."""
        self.db.execute(
            "DELETE FROM messages WHERE id = (SELECT id FROM messages WHERE conversation_id = ? "
            "ORDER BY id DESC LIMIT 1) AND role = ?", (conversation_id, role))

    def delete_conversation(self, conversation_id: int) -> None:
        self.db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    # --------------------------------------------------------------------- reads
    def list_conversations(self, limit: int = 200) -> list[ConversationInfo]:
        rows = self.db.execute(
            "SELECT c.id, c.title, c.profile, c.created, c.updated, "
            "(SELECT COUNT(*) FROM messages m WHERE m.conversation_id = c.id) "
            "FROM conversations c ORDER BY c.updated DESC, c.id DESC LIMIT ?", (limit,)).fetchall()
        return [ConversationInfo(*r) for r in rows]

    def load(self, conversation_id: int) -> StoredConversation:
        row = self.db.execute("SELECT id, title, profile, system FROM conversations WHERE id = ?",
                              (conversation_id,)).fetchone()
        if row is None:
            raise HistoryError(f"no conversation {conversation_id} in {self.path}")
        msgs = [StoredMessage(i, role, content, profile, json.loads(stats) if stats else {})
                for i, role, content, profile, stats in self.db.execute(
                    "SELECT id, role, content, profile, stats FROM messages WHERE conversation_id = ? "
                    "ORDER BY id", (conversation_id,))]
        return StoredConversation(row[0], row[1], row[2], row[3], msgs)

    # -------------------------------------------------------------------- export
    def to_markdown(self, conversation_id: int) -> str:
        conv = self.load(conversation_id)
        out = [f"# {conv.title or 'Conversation'}", "", f"*profile: {conv.profile or '?'}*", ""]
        if conv.system:
            out += ["## System", "", conv.system, ""]
        for m in conv.messages:
            head = {"user": "## User", "assistant": "## Assistant", "system": "## System"}[m.role]
            if m.role == "assistant" and m.profile:
                head += f" ({m.profile})"
            out += [head, "", m.content, ""]
        return "\n".join(out)

    def export_markdown(self, conversation_id: int, path: Path | str | None = None) -> Path:
        """Write the conversation as Markdown; default `data_dir()/exports/<id>-<title>.md`."""
        text = self.to_markdown(conversation_id)
        if path is None:
            conv = self.load(conversation_id)
            slug = re.sub(r"[^a-zA-Z0-9]+", "-", conv.title).strip("-").lower()[:40] or "conversation"
            folder = paths.data_dir() / "exports"
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{conversation_id}-{slug}.md"
        path = Path(path).expanduser()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        except OSError as e:
            raise HistoryError(f"cannot write {path}: {e.strerror}") from None
        return path
