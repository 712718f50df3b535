"""The llama-server profiles as a user runs them."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def specchat(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "specchat.cli", *args], capture_output=True, text=True, timeout=timeout)


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
    assert report["prompts"] == 2 and report["identical"] + report["near_ties"] + report["mismatches"] == 2
    assert all(p["by"] == "tokens" for p in report["prompts_checked"])  # every token named by id, drafts included
    assert subprocess.run(["pgrep", "-f", str(server_binary)], capture_output=True).returncode == 1  # none left
