"""Suffix decoding's memory across conversations, from the app's side: earlier replies read from
the history database, in the target's own tokens, handed to the engine's index (the engine never
reads the database).

At load the newest replies are read, up to the profile's `speculative.suffix.history_replies`
replies and `history_tokens` tokens, and only those of conversations that still exist
(history.read_recent_replies). A finished reply is added as it is saved, in the tokens the model
produced; one the user replaces (regenerate) is forgotten with it. A missing, corrupt or
unreadable database leaves the memory empty, said in one line: the chat goes on either way.
Nothing here runs for a profile whose memory is off (`history: false`): its backend has none.
"""
from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Callable, Hashable, Optional, Sequence

from specchat.history import HistoryError, read_recent_replies
from specchat.profiles import Profile

SLOW_S = 1.0  # reading the history longer than this shows its progress
BATCH = 128  # replies tokenized in one call
_unsaved = itertools.count()  # keys of replies that history did not save (history off)


def memory_of(backend):
    """The backend's suffix memory (backends/speculative/suffix.py SuffixIndex), or None."""
    return getattr(backend, "memory", None)


def describe(memory) -> str:
    """How warm the memory is, in a few words."""
    replies = memory.sequences
    return f"{replies} earlier repl{'y' if replies == 1 else 'ies'}, {memory.live_tokens:,} tokens"


def warm(backend, profile: Profile, history_path: Optional[Path],
         progress: Optional[Callable[[str], None]] = None, slow_s: float = SLOW_S) -> Optional[str]:
    """Fill the backend's memory from the history database at `history_path` (None: history is off
    for this session). Returns the line to show the user (None: the backend has no memory)."""
    memory = memory_of(backend)
    if memory is None:
        return None
    if history_path is None:
        return "suffix memory starts empty: history is off for this session"
    if not profile.history:
        return f"suffix memory starts empty: history is off for profile '{profile.name}'"
    sx = profile.speculative.suffix
    started = time.perf_counter()
    try:
        rows = read_recent_replies(history_path, sx.history_replies)
    except HistoryError as e:
        return f"suffix memory starts empty: {e}"
    chosen: list[tuple[Hashable, list[int]]] = []
    total, shown = 0, started
    for at in range(0, len(rows), BATCH):
        batch = rows[at:at + BATCH]
        full = False
        for (conversation, message, _), ids in zip(batch, backend.tokenize_many([text for _, _, text in batch])):
            if total + len(ids) > sx.history_tokens and chosen:
                full = True
                break
            chosen.append(((conversation, message), ids))
            total += len(ids)
        if full:
            break
        if progress is not None and time.perf_counter() - shown > slow_s:
            progress(f"reading earlier replies into the suffix memory: {at + len(batch)} of {len(rows)}")
            shown = time.perf_counter()
    memory.add_many(chosen[::-1])  # the oldest first, as the memory evicts the oldest
    return f"suffix memory: {describe(memory)} ({time.perf_counter() - started:.1f}s)"


def remember(backend, conversation: Optional[int], message: Optional[int], token_ids: Sequence[int]) -> None:
    """A finished reply into the memory (nothing without one, or for an empty reply)."""
    memory = memory_of(backend)
    if memory is None or not token_ids:
        return
    key = (conversation, message) if message is not None else ("unsaved", next(_unsaved))
    memory.add(key, list(token_ids))


def forget(backend, conversation: Optional[int], message: Optional[int] = None) -> None:
    """A reply the user replaced (or, with no `message`, every reply of a deleted conversation)."""
    memory = memory_of(backend)
    if memory is None or conversation is None:
        return
    for key in [k for k in memory.spans if k[0] == conversation and (message is None or k[1] == message)]:
        memory.remove(key)
