"""Files derived from a model file (a GGUF's tokenizer, its tensor index), kept under a cache
directory the caller chooses.

An entry is named by the source file's path, size and modification time and by the versions of
whatever derived it, so a changed file or a new version of the deriving package gets a fresh
entry instead of a stale one.
"""
from __future__ import annotations

import hashlib
from pathlib import Path


def derived_path(cache_dir: Path, kind: str, source: Path, *versions: str, suffix: str = "") -> Path:
    """Where the `kind` derived from `source` lives under `cache_dir`."""
    st = source.stat()
    key = "|".join([str(source.resolve()), str(st.st_size), str(st.st_mtime_ns), *versions])
    return Path(cache_dir) / kind / (hashlib.sha256(key.encode()).hexdigest()[:24] + suffix)
