"""`specchat train replayssm` end to end on a tiny target: a recurrent (Gated DeltaNet) draft model
the engine loads as such, deterministic and resumable, and lossless as `method: replayssm`."""
from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from specchat.backends.base import Request, Sampling, run_to_summary
from specchat.backends.native.engine import TorchBackend
from specchat.backends.speculative.backend import SpeculativeBackend, SpeculativeSettings, make_drafter
from specchat.cli import main
from tests.native.tiny import CORPUS
from tests.train.test_train import STEPS, isolated_tiny_profile, make_data, profile, tiny  # noqa: F401 (fixtures)


def train(profile, data, out, *extra) -> int:
    return main(["train", "replayssm", "--data", str(data), "--target", profile, "--out", str(out), "--layers", "2",
                 "--hidden", "32", "--linear-heads", "1", "--linear-head-dim", "16", "--ffn", "64",
                 "--steps", str(STEPS), "--batch-tokens", "64", "--checkpoint-every", "2", "--eval-every", "3",
                 "--seed", "5", "--threads", "1", *extra])


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("trained-rssm")
    mp = isolated_tiny_profile(root, tiny[1])
    make_data(tiny, "tiny", root / "data")
    assert train("tiny", root / "data", root / "rssm") == 0
    mp.undo()
    return root / "data", root / "rssm"


def test_the_drafter_is_recurrent_and_carded(trained):
    _, out = trained
    engine = TorchBackend(out, "hf_dir", threads=1, context=256)
    cfg = engine.model.cfg
    assert cfg.n_layers == 2 and all(cfg.is_linear(i) for i in range(2))
    assert engine.model.cache.k == [None, None]  # no KV cache at all: a fixed-size state
    card = (out / "README.md").read_text()
    assert "Gated DeltaNet (recurrent)" in card and "specchat train replayssm" in card and "--linear-heads 1" in card
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3_5ForCausalLM"]


def test_method_replayssm_is_lossless_with_it(tiny, trained):
    target = TorchBackend(tiny[1], "hf_dir", precision="float32", threads=1, context=256)
    drafter = make_drafter(SpeculativeSettings(method="replayssm", drafter=trained[1], depth=3), target)
    assert drafter.name == "replayssm" and drafter.engine.rollback == "replay"
    request = Request(messages=[{"role": "user", "content": CORPUS[0]}])
    for sampling in (Sampling(max_tokens=30), Sampling(temperature=0.8, seed=2, max_tokens=30)):
        ref = run_to_summary(target.stream(request, sampling))
        out = run_to_summary(SpeculativeBackend(target, drafter, 3).stream(request, sampling))
        assert out.token_ids == ref.token_ids and out.drafts > 0


def test_training_is_deterministic_and_resumable(trained, profile, tmp_path, capsys):  # noqa: F811
    data, reference = trained
    want = load_file(str(reference / "model.safetensors"))
    out = tmp_path / "resumed"
    assert train(profile, data, out, "--stop-at", "3") == 0 and not (out / "model.safetensors").exists()
    assert train(profile, data, out) == 0
    assert "resuming from step 3" in capsys.readouterr().err
    got = load_file(str(out / "model.safetensors"))
    assert want.keys() == got.keys() and all((want[k] == got[k]).all() for k in want)


def test_an_attention_model_is_not_a_replayssm_drafter(tiny):
    from specchat.backends.base import BackendError

    target = TorchBackend(tiny[1], "hf_dir", precision="float32", threads=1, context=256)
    with pytest.raises(BackendError, match="method replayssm drafts with a recurrent model"):
        make_drafter(SpeculativeSettings(method="replayssm", drafter=tiny[1], depth=3), target)
