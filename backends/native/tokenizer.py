"""Tokenizer and chat template, always the model's own: read by the `tokenizers` library and rendered by
chat_template.py where that is what transformers does (a tokenizer of its generic class), else through
transformers.

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
from . import chat_template


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


# the named special tokens transformers hands a chat template (its SPECIAL_TOKENS_ATTRIBUTES)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class RustTokenizer:
    """A saved tokenizer of transformers' generic class, read with the `tokenizers` library it wraps and
    its chat template rendered by chat_template.py: what the generic class does, without importing
    transformers at start. `load` returns None for any folder where that would not be exact (a model-
    specific class, legacy special-token files, decoding that cleans up spaces, a template kept as a
    set of named templates); those go through transformers."""

    def __init__(self, tokenizer, template: str, special_tokens: dict[str, str]):
        self.tokenizer, self.template, self.special_tokens = tokenizer, template, special_tokens

    @classmethod
    def load(cls, folder: Path) -> "RustTokenizer | None":
        try:
            config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if (not isinstance(config, dict) or config.get("tokenizer_class") not in GENERIC_CLASSES
                or config.get("clean_up_tokenization_spaces") or not (folder / "tokenizer.json").exists()
                or (folder / "special_tokens_map.json").exists() or (folder / "added_tokens.json").exists()):
            return None
        jinja = folder / "chat_template.jinja"
        template = jinja.read_text(encoding="utf-8") if jinja.exists() else config.get("chat_template")
        if not isinstance(template, str):
            return None
        special = {}
        for name in SPECIAL_TOKEN_NAMES:
            value = config.get(name)
            value = value.get("content") if isinstance(value, dict) else value
            if value is not None:
                special[name] = str(value)
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(folder / "tokenizer.json")), template, special)

    def special_ids(self) -> list[int]:
        return sorted(i for i, token in self.tokenizer.get_added_tokens_decoder().items() if token.special)

    def token_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.tokenizer.token_to_id(token)


class ChatTokenizer:
    """Chat rendering, encoding and decoding, plus the ids that end a reply. `hf` is transformers'
    tokenizer of the same folder, loaded on first use where the folder reads without it."""

    def __init__(self, path: Path, cache_dir: Path | None = None):
        """`path`: a model directory or GGUF file; `cache_dir`: where a GGUF's tokenizer is kept once built."""
        path = Path(path)
        self._path, self._cache_dir, self._hf = path, cache_dir, None
        try:
            folder = path if path.is_dir() else gguf_tokenizer_dir(path, cache_dir) if cache_dir is not None else None
            self.rust = RustTokenizer.load(folder) if folder is not None else None
            if self.rust is None:
                self._hf = _load_hf_tokenizer(path, cache_dir)
        except Exception as e:
            raise BackendError(f"{path}: could not load its tokenizer ({type(e).__name__}: {e}); "
                               "a model directory needs tokenizer.json / tokenizer_config.json") from None
        if not (self.rust.template if self.rust is not None else self._hf.chat_template):
            raise BackendError(f"{path}: the tokenizer has no chat template; use a chat (instruct) model")
        self.eos_ids = self._eos_ids(path)

    @property
    def hf(self):
        """transformers' tokenizer (for what needs its API: constraints, drafter vocabularies, training)."""
        if self._hf is None:
            self._hf = _load_hf_tokenizer(self._path, self._cache_dir)
        return self._hf

    def _eos_ids(self, path: Path) -> frozenset[int]:
        ids = set()
        eos = self.rust.token_id("eos_token") if self.rust is not None else self._hf.eos_token_id
        if eos is not None:
            ids.add(eos)
        gen = path / "generation_config.json" if path.is_dir() else None
        if gen is not None and gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return frozenset(ids)

    def render_chat(self, messages: Sequence[dict]) -> str:
        if self.rust is not None and chat_template.renders_alone(self.rust.template, messages):
            return chat_template.render(self.rust.template, messages, self.rust.special_tokens)
        return self.hf.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)

    def encode_chat(self, messages: Sequence[dict]) -> list[int]:
        # The template writes every special token it wants (BOS included, when it wants one),
        # so the tokenizer must not add its own.
        return self.encode(self.render_chat(messages))

    def encode(self, text: str) -> list[int]:
        if self.rust is not None:
            return self.rust.tokenizer.encode(text, add_special_tokens=False).ids
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` of each text, in one batch (the Rust tokenizer spreads it over the cores)."""
        if not texts:
            return []
        if self.rust is not None:
            return [e.ids for e in self.rust.tokenizer.encode_batch(list(texts), add_special_tokens=False)]
        return [list(ids) for ids in self.hf(list(texts), add_special_tokens=False)["input_ids"]]

    def vocab(self) -> dict[str, int]:
        """Every token (added ones included) and its id."""
        return self.rust.tokenizer.get_vocab(with_added_tokens=True) if self.rust is not None else self.hf.get_vocab()

    def same_special_tokens(self, other: "ChatTokenizer") -> bool:
        """Whether both mark the same ids as special: by the Rust tokenizers' added tokens where both are
        read that way, else by transformers' (whose count of them differs from the Rust view's)."""
        if self.rust is not None and other.rust is not None:
            return self.rust.special_ids() == other.rust.special_ids()
        return sorted(self.hf.all_special_ids) == sorted(other.hf.all_special_ids)

    def decode(self, ids: Sequence[int]) -> str:
        if self.rust is not None:
            return self.rust.tokenizer.decode(list(ids), skip_special_tokens=True)
        return self.hf.decode(list(ids), skip_special_tokens=True)
