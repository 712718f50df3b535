"""The EAGLE-3 drafter in the loop: every draft is what the head predicts when recomputed from
scratch over the committed sequence (deeper guesses from its own fed-back outputs), and profiles
load a head in any public format."""
import pytest
import torch

from specchat.backends.base import BackendError, Request, Sampling, run_to_summary
from specchat.backends.native.sampling import sample
from specchat.backends.speculative.backend import SpeculativeBackend
from specchat.loading import load_speculative
from specchat.profiles import Profile
from specchat.verify import fresh
from tests.speculative.conftest import PROMPTS, compare, eagle3_drafter
from tests.speculative.tiny_eagle3 import FORMATS, make_eagle3_checkpoint


def scratch_draft(target, head_dir, seq, n, depth, sampling):
    """The draft for position n of `seq` from a fresh head: every real entry (f[t], x[t+1]) for
    t < n - 1 at once, then the head's own outputs fed back one guess at a time."""
    head = eagle3_drafter(fresh(target), head_dir).head
    ids = seq[:n]
    _, hidden = fresh(target).forward(ids, 0, head.hidden_layers)
    o = head.forward(head.fuse(hidden, torch.tensor(ids))[:n - 1], torch.tensor(ids[1:n]), 0)[-1:]
    out = []
    for i in range(depth):
        token = int(head.greedy(o)[0]) if sampling.greedy else int(
            sample(head.logits(o), [n + i], sampling)[0])
        out.append(token)
        if i + 1 < depth:
            o = head.forward(o, torch.tensor([token]), n - 1 + i)
    return out


@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("sampling", [Sampling(max_tokens=24), Sampling(temperature=0.8, seed=3, max_tokens=24)],
                         ids=["greedy", "t0.8"])
def test_every_draft_equals_a_fresh_recomputation(target, eagle3_head, depth, sampling):
    drafter = eagle3_drafter(target, eagle3_head)
    proposals = []
    propose = drafter.propose

    def recording(tokens, d):
        draft = propose(tokens, d)
        proposals.append((len(tokens), d, draft.tokens))
        return draft

    drafter.propose = recording
    out = run_to_summary(SpeculativeBackend(fresh(target), drafter, depth).stream(Request(messages=PROMPTS[1]),
                                                                                  sampling))
    seq = target.prompt_ids(Request(messages=PROMPTS[1])) + out.token_ids
    assert len(proposals) > 5
    for n, d, tokens in proposals:
        expected = scratch_draft(target, eagle3_head, seq, n, d, sampling)
        assert tokens == expected[:len(tokens)] and (len(tokens) == d or tokens[-1] in target.eos_ids), n


def test_rejection_sampling_keeps_the_target_distribution_and_drafts(target, drafters):
    _, out, _ = compare(target, drafters["eagle3"]("rejection"), 3, Sampling(temperature=1.0, seed=4, max_tokens=30),
                        acceptance="rejection")
    assert out.tokens == 30 and out.draft_tokens > 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_profiles_load_a_head_in_every_format(tiny_pair, tmp_path, fmt):
    head = make_eagle3_checkpoint(tmp_path / fmt, tiny_pair[0], fmt, seed=14)
    profile = Profile(name="t", model=str(tiny_pair[0]), dtype="float32", context=256,
                      speculative={"method": "eagle3", "depth": 3, "drafter": str(head)})
    spec = load_speculative(profile)
    sampling = Sampling(max_tokens=20)
    out = run_to_summary(spec.stream(Request(messages=PROMPTS[0]), sampling))
    ref = run_to_summary(fresh(spec.target).stream(Request(messages=PROMPTS[0]), sampling))
    spec.close()
    assert out.token_ids == ref.token_ids and out.draft_tokens > 0


def test_a_profile_with_a_head_for_another_model_is_one_line(tiny_pair, tmp_path):
    head = make_eagle3_checkpoint(tmp_path / "e", tiny_pair[0], config_edits={"vocab_size": 1000})
    profile = Profile(name="t", model=str(tiny_pair[0]), dtype="float32", context=256,
                      speculative={"method": "eagle3", "drafter": str(head)})
    with pytest.raises(BackendError, match=r"^profile 't': .*vocabulary is 1000 tokens, its target's 320"):
        load_speculative(profile)
    with pytest.raises(ValueError, match="method 'eagle3' needs `drafter`"):
        Profile(name="t", model=str(tiny_pair[0]), speculative={"method": "eagle3"})


def test_the_shipped_head_fits_its_profile():
    """profiles/drafters/smollm2-eagle3: at most 30 MB, SpecForge's layout, a card that says how to
    make it again, and the profile that drafts with it."""
    import json

    from specchat.profiles import load_profiles

    profile = load_profiles().profiles["smollm2-eagle3"]
    assert profile.speculative.method == "eagle3"
    path = profile.resolve_path(profile.speculative.drafter)
    assert (path / "model.safetensors").stat().st_size <= 30e6
    assert json.loads((path / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    card = (path / "README.md").read_text()
    assert "specchat train eagle3" in card and "specchat train unpack" in card


@pytest.mark.slow
@pytest.mark.parametrize("temperature", ["0", "0.7"])
def test_verify_the_shipped_head_on_the_real_default_model(default_gguf, tmp_path, temperature):
    import json
    import subprocess
    import sys

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": [
        "Explain in three sentences why the sky is blue."]}) + "\n")
    done = subprocess.run([sys.executable, "-m", "specchat.cli", "verify", "-p", "smollm2-eagle3", "--prompts",
                           str(prompts), "--max-tokens", "48", "--temperature", temperature, "--json",
                           # every pass drafts: the draft gate's timing on a loaded machine must not decide
                           "--set", "speculative.adaptive=false"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["identical"] == 1 and out["mismatches"] == 0 and out["strict"] is True
    assert out["prompts_checked"][0]["mean_accepted"] > 1.0  # the head's guesses are taken
