import json
import subprocess
import sys

import pytest

from specchat import cli
from tests.test_llamacpp import tiny_gguf


@pytest.fixture
def tiny_profile(isolated_dirs):
    folder = isolated_dirs / "user-profiles"
    folder.mkdir(parents=True, exist_ok=True)
    tiny_gguf(folder)
    (folder / "tiny.yaml").write_text("backend: llamacpp\nmodel: ./tiny.gguf\ncontext: 256\nthreads: 2\n"
                                      "sampling: {max_tokens: 10}\n")
    return "tiny"


def test_run_json_has_the_documented_fields(tiny_profile, capsys):
    assert cli.main(["run", "-p", tiny_profile, "hello", "--json", "--max-tokens", "6"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("profile", "backend", "method", "text", "token_ids", "tokens", "passes", "ttft_s",
                "decode_tok_s", "wall_s", "mean_accepted", "accepted_per_position", "stop_reason"):
        assert key in out, key
    assert out["tokens"] == len(out["token_ids"]) <= 6 and out["backend"] == "llamacpp"


def test_run_reads_the_prompt_from_stdin(tiny_profile, capsys, monkeypatch):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("hello from stdin"))
    assert cli.main(["run", "-p", tiny_profile, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] > 0


def test_verify_repeats_the_reference_at_least_twice(capsys):
    for bad in ("1", "0", "two"):
        assert cli.main(["verify", "-p", "smollm2-ngram", "--repeat", bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--repeat" in err and "2 or more" in err


def test_verify_under_load_needs_servers_and_two_in_flight(capsys):
    for argv, says in ((["--concurrency", "2"], "needs server profiles"), (["--concurrency", "1"], "2 or more")):
        assert cli.main(["verify", "-p", "smollm2-ngram", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err


def test_empty_prompt_and_bad_override_are_usage_errors(tiny_profile, capsys):
    assert cli.main(["run", "-p", tiny_profile, "  "]) == 2
    assert cli.main(["run", "-p", tiny_profile, "hi", "--temperature", "-2"]) == 2
    err = capsys.readouterr().err
    assert "empty prompt" in err and "sampling.temperature" in err and "Traceback" not in err


def test_bench_json_per_subtask(tiny_profile, tmp_path, capsys):
    prompts = tmp_path / "q.jsonl"
    prompts.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": [f"Question {i}"]})
                                 for i, c in enumerate(["qa", "qa", "rag", "rag"])))
    assert cli.main(["bench", "-p", tiny_profile, "--prompts", str(prompts), "--max-tokens", "5", "--json"]) == 0
    captured = capsys.readouterr()
    rows = json.loads(captured.out)["rows"]
    assert [r["label"] for r in rows] == ["tiny"]
    assert rows[0]["prompts"] == 4 and set(rows[0]["by_task"]) == {"qa", "rag"}
    assert rows[0]["decode_tok_s"] > 0
    assert "[qa]" in captured.err  # each prompt's line names its subtask


@pytest.mark.slow
def test_run_json_on_the_real_default_model(default_gguf):
    done = subprocess.run([sys.executable, "-m", "specchat.cli", "run", "-p", "smollm2-llamacpp",
                           "What is the capital of France? Answer in one sentence.", "--json", "--max-tokens", "20"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert "Paris" in out["text"] and out["profile"] == "smollm2-llamacpp"
    assert out["tokens"] > 0 and out["decode_tok_s"] > 0


def test_verify_lookup_first_mtp_on_the_real_default_model(default_gguf, tmp_path):
    """The shipped head behind prompt lookup, end to end: a reply that quotes its prompt is
    token-identical to target-only and takes fewer passes than tokens."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "quote", "turns": [
        "Repeat this sentence exactly, twice: The quick brown fox jumps over the lazy dog near the river bank."]}) + "\n")
    done = subprocess.run([sys.executable, "-m", "specchat.cli", "verify", "-p", "smollm2-mtp-lookup", "--prompts",
                           str(prompts), "--max-tokens", "40", "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["identical"] == 1 and out["mismatches"] == 0 and out["strict"] is True
    assert out["prompts_checked"][0]["mean_accepted"] > 1.5


@pytest.mark.parametrize("dtype,how", [("bfloat16", "(strict verification)"),
                                       ("float32", "(verification not strict: floating-point near-ties")])
def test_verify_says_whether_verification_was_strict(tiny_profile, isolated_dirs, tmp_path, capsys, dtype, how):
    """Near-ties can only occur without strict verification, so the summary says which it was."""
    (isolated_dirs / "user-profiles" / "tiny-ngram.yaml").write_text(
        f"backend: torch\nmodel: ./tiny.gguf\ncontext: 256\nthreads: 2\ndtype: {dtype}\n"
        "speculative: {method: ngram, depth: 2}\n")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["one two one two one two"]}) + "\n")
    assert cli.main(["verify", "-p", "tiny-ngram", "--prompts", str(prompts), "--max-tokens", "8"]) == 0
    assert how in capsys.readouterr().out


def test_verify_checks_every_turn_of_a_conversation_that_outgrows_the_context(tiny_profile, isolated_dirs, tmp_path,
                                                                              capsys):
    """--turns all: each user turn in one conversation (continued with the reference's reply), the
    oldest turns left out once they no longer fit, as in the chat."""
    (isolated_dirs / "user-profiles" / "tiny-ngram.yaml").write_text(
        "backend: torch\nmodel: ./tiny.gguf\ncontext: 96\nthreads: 2\nspeculative: {method: ngram, depth: 2}\n")
    prompts = tmp_path / "p.jsonl"
    turns = [f"turn {i}: one two three one two three one two three" for i in range(6)]
    prompts.write_text(json.dumps({"question_id": 7, "category": "mt_bench", "turns": turns}) + "\n")
    args = ["verify", "-p", "tiny-ngram", "--prompts", str(prompts), "--max-tokens", "12", "--turns", "all"]
    assert cli.main(args + ["--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert [c["turn"] for c in out["prompts_checked"]] == [1, 2, 3, 4, 5, 6]
    assert out["prompts"] == 6 and out["mismatches"] == 0
    assert "7.4" in captured.err and "left out" in captured.err
    assert cli.main(args[:-2]) == 0 and "1 prompts:" in capsys.readouterr().out  # the first turn only by default
