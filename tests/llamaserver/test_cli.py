"""The llama-server profiles as a user runs them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


TAG = f"specchat-test-{uuid.uuid4().hex}"  # in the environment of every process these tests start


def specchat(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "specchat.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "SPECCHAT_TEST_TAG": TAG})


def tagged_processes() -> list[int]:
    """Processes still running that these tests started (their environment carries TAG)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if TAG.encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return found


def test_run_and_verify_a_llama_server_profile(server_binary, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"question_id": i, "category": "copy", "turns": [t]}) for i, t in enumerate(
        ["Repeat exactly, twice: one two three four five six.", "Name the days of the week."])))
    run = specchat("run", "-p", "smollm2-llamaserver-ngram", "--max-tokens", "40", "--stats",
                   "Repeat exactly, three times: the quick brown fox jumps over the lazy dog.")
    assert run.returncode == 0, run.stderr
    assert "tok/pass" in run.stderr and run.stdout.strip()
    verify = specchat("verify", "-p", "smollm2-llamaserver-ngram", "--prompts", str(prompts), "--max-tokens", "32",
                      "--json")
    assert verify.returncode in (0, 1), verify.stderr
    report = json.loads(verify.stdout)
    assert report["server_peak_rss_bytes"] > 50e6  # two servers, each with the 100 MB model
    assert report["prompts"] == 2 and report["identical"] + report["near_ties"] + report["mismatches"] == 2
    assert all(p["by"] == "tokens" for p in report["prompts_checked"])  # every token named by id, drafts included
    assert tagged_processes() == []  # no llama-server (nor its keeper) outlives specchat


def test_verify_repeated_and_under_load_on_the_real_llama_server(server_binary, tmp_path):
    """The peer the noise-floor checks are for: llama-server with two slots (continuous batching)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"question_id": i, "category": "list", "turns": [t]}) for i, t in enumerate(
        ["Name the days of the week.", "Count from one to ten in words."])))
    verify = specchat("verify", "-p", "smollm2-llamaserver-ngram", "--prompts", str(prompts), "--max-tokens", "24",
                      "--repeat", "2", "--concurrency", "2", "--json")
    assert verify.returncode in (0, 1), verify.stderr
    report = json.loads(verify.stdout)
    assert report["reference_runs"] == 2 and 0 <= report["target_reproducible_rate"] <= 1
    load = report["under_load"]
    assert load["concurrency"] == 2 and load["replies"] == 2
    for side in ("reference", "speculative"):
        assert 0 <= load[side]["changed"] <= 2 and load[side]["loaded_tok_s"] > 0
    for checked in report["prompts_checked"]:
        assert checked["reference_runs"] == 2 and set(checked["under_load"]) == {"reference_changed_at",
                                                                                  "speculative_changed_at"}
    assert tagged_processes() == []  # every server (both sides, two slots each) is gone
