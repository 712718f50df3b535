"""Tokenizer and chat template, always the model's own, through transformers.

Building a tokenizer from GGUF metadata is slow, so with a `cache_dir` the result is saved once
(see derived_files.py) and loaded from there later.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Sequence

from ..base import BackendError
from ..derived_files import derived_path


def gguf_tokenizer_dir(gguf_path: Path, cache_dir: Path) -> Path:
    from importlib.metadata import version  # transformers' own, without importing it

    return derived_path(cache_dir, "tokenizers", gguf_path, version("transformers"))


# the class transformers itself builds for a tokenizer.json without a model-specific tokenizer class
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _from_dir(folder: Path):
    """AutoTokenizer.from_pretrained(folder); where the folder's config names the generic class (every
    tokenizer specchat saves from a GGUF but gemma's and qwen2's), that class itself, which is what
    AutoTokenizer makes of it: without the auto machinery's imports, a few tenths of a second of
    every start (scripts/bench_start.py)."""
    try:
        named = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        named = None
    if named in GENERIC_CLASSES:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def _load_hf_tokenizer(path: Path, cache_dir: Path | None):
    if path.is_dir():
        return _from_dir(path)
    cached = gguf_tokenizer_dir(path, cache_dir) if cache_dir is not None else None
    if cached is not None and (cached / "tokenizer_config.json").exists():
        return _from_dir(cached)
    if cache_dir is None:
        return _from_gguf(path)
    tok = _from_gguf(path)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
    tok.save_pretrained(str(tmp))
    try:
        os.replace(tmp, cached)  # atomic: another process may have saved it meanwhile
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    # the saved one, as every later start loads it: a tokenizer transformers builds from GGUF metadata
    # need not tokenize as it does once saved (gemma3's, of a byte-level BPE vocabulary, did not)
    return _from_dir(cached)


def _from_gguf(path: Path):
    """A GGUF's own tokenizer, built from its metadata. AutoTokenizer first reads the file's model
    config, which transformers does for some architectures only (not glm4moe): for the others, the
    fast tokenizer straight from the vocabulary and merges, which is all a tokenizer needs."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except ValueError as e:
        if "is not supported" not in str(e):
            raise
        return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)


class ChatTokenizer:
    """Chat rendering, encoding and decoding, plus the ids that end a reply."""

    def __init__(self, path: Path, cache_dir: Path | None = None):
        """`path`: a model directory or GGUF file; `cache_dir`: where a GGUF's tokenizer is kept once built."""
        path = Path(path)
        try:
            self.hf = _load_hf_tokenizer(path, cache_dir)
        except Exception as e:
            raise BackendError(f"{path}: could not load its tokenizer ({type(e).__name__}: {e}); "
                               "a model directory needs tokenizer.json / tokenizer_config.json") from None
        if not self.hf.chat_template:
            raise BackendError(f"{path}: the tokenizer has no chat template; use a chat (instruct) model")
        self.eos_ids = self._eos_ids(path)

    def _eos_ids(self, path: Path) -> frozenset[int]:
        ids = set()
        if self.hf.eos_token_id is not None:
            ids.add(self.hf.eos_token_id)
        gen = path / "generation_config.json" if path.is_dir() else None
        if gen is not None and gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return frozenset(ids)

    def render_chat(self, messages: Sequence[dict]) -> str:
        return self.hf.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)

    def encode_chat(self, messages: Sequence[dict]) -> list[int]:
        # The template writes every special token it wants (BOS included, when it wants one),
        # so the tokenizer must not add its own.
        return self.encode(self.render_chat(messages))

    def encode(self, text: str) -> list[int]:
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` of each text, in one batch (the Rust tokenizer spreads it over the cores)."""
        return [list(ids) for ids in self.hf(list(texts), add_special_tokens=False)["input_ids"]] if texts else []

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)
