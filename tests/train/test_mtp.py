"""`specchat train mtp` end to end on a tiny target, and the training head against the engine's head."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from specchat.backends.base import Request, Sampling, run_to_summary
from specchat.backends.native.engine import TorchBackend
from specchat.backends.native.mtp import DRAFT_VOCAB, MtpHead, read_mtp
from specchat.backends.speculative.backend import SpeculativeBackend
from specchat.backends.speculative.mtp import MtpDrafter
from specchat.cli import main
from tests.native.tiny import CORPUS
from tests.train.test_train import isolated_tiny_profile, make_data, profile, tiny  # noqa: F401  (fixtures)

STEPS = 6


def train(profile, data, out, *extra) -> int:
    return main(["train", "mtp", "--data", str(data), "--target", profile, "--out", str(out), "--steps", str(STEPS),
                 "--batch-tokens", "64", "--checkpoint-every", "2", "--eval-every", "3", "--seed", "5",
                 "--draft-vocab", "200", "--top-k", "8", "--threads", "1", *extra])


@pytest.fixture(scope="module")
def mtp_trained(tiny, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("mtp")
    mp = isolated_tiny_profile(root, tiny[1])
    make_data(tiny, "tiny", root / "data")
    assert train("tiny", root / "data", root / "head") == 0
    yield root, root / "data", root / "head"
    mp.undo()


def test_trained_head_is_a_deepseek_layout_head_with_a_draft_vocabulary(tiny, mtp_trained):  # noqa: F811
    _, _, head_dir = mtp_trained
    target = TorchBackend(tiny[1], "hf_dir", precision="float32", threads=1, context=256)
    w = read_mtp(head_dir, target.model.cfg)
    assert w.layout.name == "deepseek" and len(w.layers) == 1 and w.hidden_source == "post_norm"
    assert w.draft_vocab is not None and len(w.draft_vocab) == 200
    tensors = load_file(str(head_dir / "model.safetensors"))
    n = target.model.cfg.n_layers
    assert f"model.layers.{n}.eh_proj.weight" in tensors and DRAFT_VOCAB in tensors
    card = (head_dir / "README.md").read_text()
    assert "specchat train mtp" in card and "held-out" in card
    log = [json.loads(line) for line in (head_dir / "train-log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, STEPS + 1)) and "eval_agree" in log[-1]


def test_speculative_with_trained_head_equals_target_only(tiny, mtp_trained):  # noqa: F811
    target = TorchBackend(tiny[1], "hf_dir", precision="float32", threads=1, context=256)
    head = MtpHead(read_mtp(mtp_trained[2], target.model.cfg), target.model, 256)
    request = Request(messages=[{"role": "user", "content": CORPUS[0]}])
    for sampling in (Sampling(max_tokens=30), Sampling(temperature=0.8, seed=2, max_tokens=30)):
        ref = run_to_summary(target.stream(request, sampling))
        out = run_to_summary(SpeculativeBackend(target, MtpDrafter(head, target.eos_ids), 3).stream(request, sampling))
        assert out.token_ids == ref.token_ids and out.drafts > 0


def test_training_head_computes_what_the_engine_head_computes(tiny, mtp_trained):  # noqa: F811
    """The batched training form and the engine's incremental MTP head agree on the exported weights."""
    from specchat.train.mtp import MtpTrainHead

    target = TorchBackend(tiny[1], "hf_dir", precision="float32", threads=1, context=256)
    cfg = target.model.cfg
    tensors = {k: v.float() for k, v in load_file(str(mtp_trained[2] / "model.safetensors")).items()}
    # the exported (bfloat16-rounded) values, loaded into the training module by name
    model = MtpTrainHead.from_export(cfg, tensors)
    head = MtpHead(read_mtp(mtp_trained[2], cfg), target.model, 64)
    torch.manual_seed(1)
    hidden = torch.randn(7, cfg.dim)
    nxt = torch.randint(0, cfg.vocab_size, (7,))
    want = head.forward(hidden, nxt, 0)
    emb = target.model.embed
    with torch.no_grad():
        got, got2 = model(hidden[None], emb[nxt][None], emb[nxt[1:]][None])
    assert torch.allclose(got[0], want, atol=1e-4), (got[0] - want).abs().max()
    # depth 2, as drafting does it: after the real entries 0..t, the head's own g[t] with x[t+2] at entry t+1
    for t in (0, 3, 5):
        head.forward(hidden[:t + 1], nxt[:t + 1], 0)
        want2 = head.forward(want[t:t + 1], nxt[t + 1:t + 2], t + 1)
        assert torch.allclose(got2[0, t], want2[0], atol=1e-4), (t, (got2[0, t] - want2[0]).abs().max())


def test_training_is_deterministic_and_resumable(tiny, mtp_trained, profile, tmp_path, capsys):  # noqa: F811
    root, data, reference = mtp_trained
    out = tmp_path / "resumed"
    assert train(profile, data, out, "--stop-at", "3") == 0
    assert not (out / "model.safetensors").exists()
    assert train(profile, data, out) == 0
    assert "resuming from step 3" in capsys.readouterr().err
    want, got = load_file(str(reference / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_the_target_states_are_computed_on_the_runs_threads(monkeypatch, tmp_path):
    """`--threads 1` holds for the target's feature pass too, not only for training: a run given
    one core must not take the other while it computes the target's states."""
    from specchat import loading
    from specchat.profiles import load_profiles
    from specchat.train.examples import Example
    from specchat.train.mtp import compute_features

    asked = {}

    class Loaded(Exception):
        pass

    def load_target(profile, **changes):
        asked.update(changes)
        raise Loaded

    monkeypatch.setattr(loading, "load_target", load_target)
    target = load_profiles().get("smollm2")
    assert target.threads == 0  # every core, unless the run says otherwise
    example = Example("a", torch.arange(6), 2, torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 8))
    with pytest.raises(Loaded):
        compute_features(target, [example], (0,), 8, tmp_path, threads=1)
    assert asked["threads"] == 1
