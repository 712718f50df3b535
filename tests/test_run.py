"""`specchat run` keeps history as the chat does: each prompt and reply written to the history
database with its figures, and a suffix profile's memory warmed from it, so a repeated run drafts
from the earlier reply; `--no-history` and a profile's `history: false` write and read nothing."""
from __future__ import annotations

import json

import pytest

from specchat import cli
from specchat.history import History, default_path
from tests.native.tiny import make_hf_checkpoint

PROMPT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("run-history") / "m", "llama", seed=1)  # 40 tokens, none drafted from the prompt


def run(model_dir, capsys, *flags: str) -> dict:
    assert cli.main(["run", "-p", "smollm2-suffix", "--set", f"model={model_dir}", "--set", "dtype=float32",
                     "--set", "compile=false", "--json", "--max-tokens", "40", *flags, PROMPT]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_second_run_drafts_from_the_first_runs_reply(model_dir, capsys):
    first = run(model_dir, capsys)
    assert first["history"] is True and "0 earlier replies" in first["suffix_memory"]
    second = run(model_dir, capsys)
    assert "1 earlier reply" in second["suffix_memory"]
    assert second["token_ids"] == first["token_ids"] and first["tokens"] >= 20
    assert second["tokens_per_pass"] > first["tokens_per_pass"]
    history = History()
    kept = [history.load(c.id) for c in reversed(history.list_conversations())]
    assert [[m.role for m in conv.messages] for conv in kept] == [["user", "assistant"]] * 2
    assert all(conv.profile == "smollm2-suffix" and conv.messages[0].content == PROMPT for conv in kept)
    stats = kept[1].messages[1].stats
    assert stats["tokens_per_pass"] == round(second["tokens_per_pass"], 3) and stats["method"].startswith("suffix")
    assert kept[1].messages[1].content == second["text"]


@pytest.mark.parametrize("off", [["--no-history"], ["--set", "history=false"]])
def test_history_off_writes_nothing_and_reads_nothing(model_dir, capsys, off):
    first = run(model_dir, capsys)  # kept: a run that reads the history would draft from it
    before = History().list_conversations()
    second = run(model_dir, capsys, *off)
    assert "starts empty" in second["suffix_memory"] and second["tokens_per_pass"] <= first["tokens_per_pass"]
    assert second["token_ids"] == first["token_ids"]
    assert [c.id for c in History().list_conversations()] == [c.id for c in before]
    if off == ["--no-history"]:
        assert second["history"] is False


def test_no_database_is_created_when_history_is_off(model_dir, capsys):
    run(model_dir, capsys, "--no-history")
    assert not default_path().exists()
