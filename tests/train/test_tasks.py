"""`specchat train tasks` on a tiny random target: material written, then worked on in stages, each
stage's prompt holding what the earlier ones wrote; resumable; packed with per-kind counts."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from specchat.cli import main
from specchat.train import tasks
from specchat.train.store import read_manifest
from tests.native.tiny import make_hf_checkpoint

RUN = ["--top-k", "8", "--batch", "2", "--max-tokens", "12", "--dtype", "float32", "--threads", "1"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    return root, make_hf_checkpoint(root / "target", "llama", seed=4)


@pytest.fixture
def target(checkpoint, isolated_dirs):
    """The tiny checkpoint as profile `tiny`, in this test's own profile directory."""
    root, path = checkpoint
    d = Path(os.environ["SPECCHAT_PROFILES_DIR"])
    d.mkdir(parents=True, exist_ok=True)
    (d / "tiny.yaml").write_text(f"backend: torch\nmodel: {path}\ndtype: float32\nthreads: 1\ncontext: 256\n")
    return root, path


@pytest.fixture
def short_material(monkeypatch):
    """A random model writes a few bytes, not 400 characters: any text counts as material."""
    for name in ("MIN_DOCUMENT_CHARS", "MIN_TRANSLATION_CHARS", "MIN_PROBLEM_CHARS"):
        monkeypatch.setattr(tasks, name, 1)


def samples(out):
    """{id: (prompt text, reply text)} of a data directory, decoded with the target's tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out.parent / "target"))
    shards, got = {}, {}
    for m in read_manifest(out):
        ids = shards.setdefault(m["shard"], load_file(str(out / m["shard"]))["tokens"])
        seq = ids[m["offset"]:m["offset"] + m["prompt_len"] + m["reply_len"]].tolist()
        got[m["id"]] = (tok.decode(seq[:m["prompt_len"]], skip_special_tokens=True),
                        tok.decode(seq[m["prompt_len"]:], skip_special_tokens=True).strip())
    return got


def test_documents_are_written_then_worked_on(target, short_material):
    root, _ = target
    out = root / "documents"
    assert main(["train", "tasks", "--target", "tiny", "--kind", "documents", "--count", "3", "--out", str(out),
                 *RUN]) == 0
    got = samples(out)
    for i in range(3):
        doc = got[f"documents:{i}~write"][1]
        assert "about 300 words about" in got[f"documents:{i}~write"][0]
        for stage in ("summary", "points", "edit", "translate", "question"):
            prompt, _ = got[f"documents:{i}~{stage}"]
            assert doc in prompt  # the stage works on the document this item wrote
        question = got[f"documents:{i}~question"][1]
        if question:
            assert question in got[f"documents:{i}~answer"][0] and doc in got[f"documents:{i}~answer"][0]
        if got[f"documents:{i}~translate"][1]:
            assert got[f"documents:{i}~translate"][1] in got[f"documents:{i}~back"][0]
    assert got["documents:0~write"][1] != got["documents:1~write"][1]

    # resumable: a larger count writes only the new item; what was there stays as it was
    before = (out / "manifest.jsonl").read_text()
    assert main(["train", "tasks", "--target", "tiny", "--kind", "documents", "--count", "4", "--out", str(out),
                 *RUN]) == 0
    after = (out / "manifest.jsonl").read_text()
    assert after.startswith(before)
    assert {json.loads(line)["id"].split("~")[0] for line in after[len(before):].splitlines()} == {"documents:3"}

    # the material is seeded per item: the same batch written again is the same text
    again = root / "documents-again"
    assert main(["train", "tasks", "--target", "tiny", "--kind", "documents", "--count", "2", "--out", str(again),
                 *RUN]) == 0
    assert samples(again) == {k: v for k, v in got.items() if k.split("~")[0] in ("documents:0", "documents:1")}


def test_another_kind_into_the_same_directory_is_one_line(target, capsys):
    root, _ = target
    out = root / "mixed"
    assert main(["train", "tasks", "--target", "tiny", "--kind", "math", "--count", "1", "--out", str(out), *RUN]) == 0
    assert main(["train", "tasks", "--target", "tiny", "--kind", "code", "--count", "1", "--out", str(out), *RUN]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "holds data made with other settings" in err and "Traceback" not in err


def test_code_that_is_no_code_is_not_worked_on(target):
    """Explanations, edits and tests only of replies that hold a Python function."""
    root, _ = target
    out = root / "code"
    assert main(["train", "tasks", "--target", "tiny", "--kind", "code", "--count", "2", "--out", str(out), *RUN]) == 0
    got = samples(out)
    for i in range(2):
        stages = {k.split("~")[1] for k in got if k.startswith(f"code:{i}~")}
        assert stages == ({"write", "explain", "edit", "tests"} if "def " in got[f"code:{i}~write"][1] else {"write"})


def test_a_follow_up_user_turn_is_written_after_the_conversation_so_far(target):
    from specchat.backends.native.tokenizer import ChatTokenizer
    from specchat.paths import cache_dir
    from specchat.train.self_prompts import user_turn_prefix

    tok = ChatTokenizer(target[1], cache_dir())
    history = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"}]
    prefix = user_turn_prefix(tok, None, history)
    full = tok.encode_chat(history + [{"role": "user", "content": "And then?"}])
    assert full[:len(prefix)] == prefix and len(prefix) > len(tok.encode_chat(history[:1]))
    assert "Hello! How can I help?" in tok.decode(prefix)


def test_packed_tasks_count_their_kinds_and_say_how_to_make_them_again(target, short_material, tmp_path):
    from specchat.profiles import load_profiles
    from specchat.train.card import data_commands

    root, _ = target
    out = root / "math"
    assert main(["train", "tasks", "--target", "tiny", "--kind", "math", "--count", "2", "--out", str(out), *RUN]) == 0
    corpus = tmp_path / "corpus"
    assert main(["train", "corpus", "--data", str(out), "--out", str(corpus)]) == 0
    info = json.loads((corpus / "info.json").read_text())
    lines = read_manifest(out)
    assert info["replies"] == len(lines) == 4
    assert info["by_kind"] == {stage: {"replies": 2, "reply_tokens": sum(m["reply_len"] for m in lines
                                                                          if m["id"].endswith("~" + stage))}
                               for stage in ("problem", "solution")}
    with np.load(corpus / "tokens.npz") as z:
        assert z["tokens"].dtype == np.uint16
    (command,) = data_commands(load_profiles().profiles["tiny"], [out])
    assert command == (f"specchat train tasks --target tiny --kind math --count 2 --out {out} --top-k 8 "
                       "--temperature 0.8 --seed 0 --batch 2 --dtype float32 --max-tokens 12")
