"""The chat tokenizer (backends/native/tokenizer.py): a saved tokenizer whose config names transformers'
generic class is read by the `tokenizers` library with its template rendered by chat_template.py, and
renders, encodes and decodes exactly as AutoTokenizer's does, without importing transformers; others
still go through AutoTokenizer."""
from __future__ import annotations

import json
import subprocess
import sys

from transformers import AutoTokenizer

from specchat import paths
from specchat.backends.native.tokenizer import GENERIC_CLASSES, ChatTokenizer, gguf_tokenizer_dir

CHATS = [[{"role": "user", "content": "Héllo 👋, what is 2+2?\n\tTabs   and spaces."}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write `print(1)`"},
          {"role": "assistant", "content": "print(1)"}, {"role": "user", "content": "Now in C:"}]]


def test_the_generic_class_is_what_autotokenizer_makes_of_the_saved_tokenizer(default_gguf):
    ours = ChatTokenizer(default_gguf, paths.cache_dir())
    folder = gguf_tokenizer_dir(default_gguf, paths.cache_dir())
    assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"] in GENERIC_CLASSES
    auto = AutoTokenizer.from_pretrained(str(folder))
    assert ours.rust is not None
    assert type(ours.hf) is type(auto)
    for chat in CHATS:
        text = auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert ours.render_chat(chat) == text
        ids = auto(text, add_special_tokens=False)["input_ids"]
        assert ours.encode_chat(chat) == ids
        assert ours.decode(ids) == auto.decode(ids, skip_special_tokens=True)
    assert ours.eos_ids == frozenset({auto.eos_token_id})
    texts = ["<|im_start|>user\nsays <|im_end|> inside<|im_end|>", "  two leading spaces", "line\r\nbreak",
             "ｆｕｌｌｗｉｄｔｈ and e\u0301 combined", "", "\x00 nul and \ufffd", "tab\tand 中文"]
    want = [auto(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert [ours.encode(t) for t in texts] == want == ours.encode_many(texts)
    special = [auto.convert_tokens_to_ids("<|im_start|>"), *want[0], auto.eos_token_id]
    assert ours.decode(special) == auto.decode(special, skip_special_tokens=True)


def test_a_chat_starts_without_importing_transformers(default_gguf):
    """transformers' import is most of a second of every start (scripts/bench_start.py)."""
    code = ("import sys; from specchat import paths; from specchat.backends.native.tokenizer import ChatTokenizer;"
            f"t = ChatTokenizer({str(default_gguf)!r}, paths.cache_dir());"
            "ids = t.encode_chat([{'role': 'user', 'content': 'hi'}]); t.decode(ids);"
            "print(len(ids), 'transformers' in sys.modules)")
    ChatTokenizer(default_gguf, paths.cache_dir())  # the saved tokenizer exists before the child starts
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert int(out[0]) > 10 and out[1] == "False"


def test_a_model_specific_class_still_goes_through_autotokenizer(tiny_dirs, tmp_path):
    folder = tmp_path / "tok"
    AutoTokenizer.from_pretrained(str(tiny_dirs["llama"])).save_pretrained(str(folder))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "GPT2Tokenizer"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for name in ("config.json",):  # the tiny checkpoint's own files, so that the folder is a model
        (folder / name).write_bytes((tiny_dirs["llama"] / name).read_bytes())
    tok = ChatTokenizer(folder)
    assert type(tok.hf) is type(AutoTokenizer.from_pretrained(str(folder)))
    assert type(tok.hf).__name__ not in GENERIC_CLASSES


def test_a_draft_model_is_checked_against_the_target_tokenizer_either_way_it_is_read(tiny_dirs, tmp_path):
    """check_same_tokenizer compares vocabularies and special tokens without transformers where both
    tokenizers are read by the Rust library, and through transformers where one is not."""
    from types import SimpleNamespace

    import pytest

    from specchat.backends.base import BackendError
    from specchat.backends.speculative.drafters import check_same_tokenizer

    def engine(folder):
        tok = ChatTokenizer(folder)
        return SimpleNamespace(tokenizer=tok, eos_ids=tok.eos_ids, model=SimpleNamespace(cfg=SimpleNamespace(vocab_size=10**6)))

    base = tiny_dirs["llama"]
    target = engine(base)
    assert target.tokenizer.rust is not None and target.tokenizer.vocab() == target.tokenizer.hf.get_vocab()
    check_same_tokenizer(target, engine(base), "same")

    def variant(name, change):
        folder = tmp_path / name
        folder.mkdir()
        for f in base.iterdir():  # the tiny checkpoint's files (its generation config names its ends)
            if f.is_file():
                (folder / f.name).write_bytes(f.read_bytes())
        data = json.loads((folder / "tokenizer.json").read_text())
        change(data)
        (folder / "tokenizer.json").write_text(json.dumps(data))
        return engine(folder)

    def unmark_special(data):
        next(t for t in data["added_tokens"] if t["content"] == "<|im_start|>")["special"] = False

    def swap_two(data):
        vocab = data["model"]["vocab"]
        a, b = sorted(vocab, key=vocab.get)[100:102]
        vocab[a], vocab[b] = vocab[b], vocab[a]

    with pytest.raises(BackendError, match="special tokens differ"):
        check_same_tokenizer(target, variant("special", unmark_special), "d1")
    with pytest.raises(BackendError, match="vocabularies differ"):
        check_same_tokenizer(target, variant("vocab", swap_two), "d2")
    generic = variant("same-again", lambda data: None)
    generic.tokenizer.rust = None  # read through transformers: its own count of special tokens
    check_same_tokenizer(target, generic, "mixed")
