"""The A/B view's, the REPL's and verify's reference: on the run's own weights when it is the same
model in the same arithmetic, else an engine of its own (loading.load_reference)."""
import json

import pytest

from specchat import cli
from specchat.backends.native.shared_weights import SharedWeights
from specchat.loading import load_backend, load_reference
from specchat.profiles import get_profile
from tests.native.tiny import make_hf_checkpoint
from tests.scripted import ScriptedBackend


@pytest.fixture
def tiny_torch(isolated_dirs):
    folder = isolated_dirs / "user-profiles"
    folder.mkdir(parents=True, exist_ok=True)
    make_hf_checkpoint(folder / "hf", "llama")
    (folder / "tiny-ngram.yaml").write_text("backend: torch\nmodel: ./hf\ncontext: 128\nthreads: 2\n"
                                            "speculative: {method: ngram, depth: 2}\n")
    (folder / "tiny-bf16.yaml").write_text("backend: torch\nmodel: ./hf\ncontext: 128\nthreads: 2\ndtype: bfloat16\n")
    return get_profile("tiny-ngram")


def refuse_to_load(profile):
    raise AssertionError(f"loaded {profile.name} although the target's weights could serve")


def test_the_same_model_target_only_runs_on_the_loaded_weights(tiny_torch):
    spec = load_backend(tiny_torch)
    ref = load_reference(tiny_torch, spec, tiny_torch.target_only(), refuse_to_load)
    assert isinstance(ref, SharedWeights) and ref.model is spec.target.model and ref.shares_weights


def test_other_arithmetic_or_a_backend_without_weights_loads_its_own(tiny_torch):
    spec = load_backend(tiny_torch)
    loaded = []

    def load(profile):
        loaded.append(profile.name)
        return ScriptedBackend(["x"])
    load_reference(tiny_torch, spec, get_profile("tiny-bf16"), load)  # another dtype: other arithmetic
    load_reference(tiny_torch, ScriptedBackend(["x"]), tiny_torch.target_only(), load)  # no torch target
    spec.target.model.use_static_shapes(compile=True)  # CUDA graphs over a fixed cache
    load_reference(tiny_torch, spec, tiny_torch.target_only(), load)
    assert loaded == ["tiny-bf16", "tiny-ngram:target-only", "tiny-ngram:target-only"]


def test_verify_says_the_reference_shared_the_weights_and_the_memory(tiny_torch, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["one two one two one two"]}) + "\n")
    assert cli.main(["verify", "-p", "tiny-ngram", "--prompts", str(prompts), "--max-tokens", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["reference_shares_weights"] is True and out["peak_rss_bytes"] > 50 * 2**20
    assert out["identical"] == 1
