import json

import pytest

from specchat import bench, cli
from specchat.profiles import load_profiles
from tests.native.tiny import make_hf_checkpoint


def test_speculative_profiles_get_their_target_only_reference():
    ps = load_profiles()
    rows = bench.plan([ps.get("smollm2-ngram")])
    assert [(label, p.method, ref) for label, p, ref in rows] == [
        ("smollm2-ngram", "ngram", "smollm2-ngram:target-only"), ("smollm2-ngram:target-only", "none", None)]
    rows = bench.plan([ps.get("smollm2"), ps.get("smollm2-ngram")])
    assert [ref for _, _, ref in rows] == [None, "smollm2"]  # an existing target-only row is reused
    # ... but only one that runs the target as the speculative profile does
    other = ps.get("smollm2").with_overrides({"threads": 1, "sampling.temperature": 0.7})
    rows = bench.plan([other, ps.get("smollm2-ngram")])
    assert [ref for _, _, ref in rows] == [None, "smollm2-ngram:target-only", None]
    compiled = ps.get("smollm2-ngram").with_overrides({"compile": True})  # other graphs, other speed
    rows = bench.plan([ps.get("smollm2"), compiled])
    assert [ref for _, _, ref in rows] == [None, "smollm2-ngram:target-only", None]
    assert rows[2][1].compile


def test_a_user_profile_extending_a_shipped_one_shares_its_reference(isolated_dirs):
    folder = isolated_dirs / "user-profiles"
    folder.mkdir()
    (folder / "my-mtp.yaml").write_text("extends: smollm2-mtp\nspeculative: {depth: 2}\n")
    ps = load_profiles()
    rows = bench.plan([ps.get("smollm2"), ps.get("my-mtp")])
    assert [ref for _, _, ref in rows] == [None, "smollm2"]  # the named default model, wherever the profile lives


@pytest.fixture
def tiny_spec_profile(isolated_dirs):
    folder = isolated_dirs / "user-profiles"
    make_hf_checkpoint(folder / "tiny", "llama")
    (folder / "tiny-ngram.yaml").write_text("backend: torch\nmodel: ./tiny\ndtype: float32\ncontext: 256\nthreads: 2\n"
                                            "speculative: {method: ngram, depth: 3}\n")
    return "tiny-ngram"


@pytest.mark.parametrize("mode", [[], ["--sequential"]])
def test_bench_measures_speedup_against_the_reference(tiny_spec_profile, tmp_path, capsys, mode):
    prompts = tmp_path / "p.txt"
    prompts.write_text("the quick brown fox\nhello world, how are you today?\n")
    assert cli.main(["bench", "-p", tiny_spec_profile, "--prompts", str(prompts), "--max-tokens", "12", "--json",
                     *mode]) == 0
    rows = {r["label"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    spec, ref = rows["tiny-ngram"], rows["tiny-ngram:target-only"]
    assert spec["reference"] == "tiny-ngram:target-only" and spec["speedup"] > 0
    assert spec["prompts"] == ref["prompts"] == 2 and spec["tokens"] == ref["tokens"]
    assert spec["mean_accepted"] >= 1.0 and ref["speedup"] is None
    # every pass counts: target-only emits one token per pass, drafting at most mean_accepted
    assert ref["tokens_per_pass"] == 1.0 and 1.0 <= spec["tokens_per_pass"] <= spec["mean_accepted"]
