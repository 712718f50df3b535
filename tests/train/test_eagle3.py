"""`specchat train eagle3` end to end on a tiny target: the head it writes is read as a SpecForge
head, drafts losslessly, and the training form computes what the engine's head computes at every
step of the training-time test."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from specchat.backends.base import Request, Sampling, run_to_summary
from specchat.backends.native.eagle3 import Eagle3Head, read_eagle3
from specchat.backends.native.engine import TorchBackend
from specchat.backends.speculative.backend import SpeculativeBackend
from specchat.backends.speculative.eagle3 import Eagle3Drafter
from specchat.cli import main
from tests.native.tiny import CORPUS
from tests.train.test_train import isolated_tiny_profile, make_data, profile, tiny  # noqa: F401  (fixtures)

STEPS = 6


def train(profile, data, out, *extra) -> int:
    return main(["train", "eagle3", "--data", str(data), "--target", profile, "--out", str(out), "--steps",
                 str(STEPS), "--batch-tokens", "64", "--checkpoint-every", "2", "--eval-every", "3", "--seed", "5",
                 "--draft-vocab", "200", "--top-k", "8", "--threads", "1", *extra])


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("eagle3")
    mp = isolated_tiny_profile(root, tiny[1])
    make_data(tiny, "tiny", root / "data")
    assert train("tiny", root / "data", root / "head") == 0
    yield root, root / "data", root / "head"
    mp.undo()


def target_of(tiny):  # noqa: F811
    return TorchBackend(tiny[1], "hf_dir", precision="float32", threads=1, context=256)


def test_the_trained_head_is_a_specforge_head_with_a_draft_vocabulary(tiny, trained):  # noqa: F811
    head_dir = trained[2]
    w = read_eagle3(head_dir, target_of(tiny).model.cfg)
    assert w.format == "specforge" and w.taps == (2, 1, 0) and w.draft_ids is not None and len(w.draft_ids) == 200
    tensors = load_file(str(head_dir / "model.safetensors"))
    assert {"midlayer.hidden_norm.weight", "fc.weight", "d2t", "t2d"} <= tensors.keys()
    assert int(tensors["t2d"].sum()) == 200 and "embed_tokens.weight" not in tensors
    card = (head_dir / "README.md").read_text()
    assert "specchat train eagle3" in card and "held-out" in card and "--ttt-steps 3" in card
    log = [json.loads(line) for line in (head_dir / "train-log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    assert {"eval_agree", "eval_agree2", "eval_agree3"} <= log[-1].keys()


def test_speculative_with_the_trained_head_equals_target_only(tiny, trained):  # noqa: F811
    target = target_of(tiny)
    head = Eagle3Head(read_eagle3(trained[2], target.model.cfg), target.model, 256)
    request = Request(messages=[{"role": "user", "content": CORPUS[0]}])
    for sampling in (Sampling(max_tokens=30), Sampling(temperature=0.8, seed=2, max_tokens=30)):
        ref = run_to_summary(target.stream(request, sampling))
        spec = SpeculativeBackend(target, Eagle3Drafter(head, target.eos_ids), 3)
        out = run_to_summary(spec.stream(request, sampling))
        assert out.token_ids == ref.token_ids and out.drafts > 0


def test_every_training_time_test_step_computes_what_drafting_computes(tiny, trained):  # noqa: F811
    """The batched unroll and the engine's incremental head agree on the exported weights: step s
    at anchor t is the head after real entries 0..t, fed its own output s times."""
    from specchat.train.eagle3 import Eagle3TrainHead

    target = target_of(tiny)
    cfg = target.model.cfg
    tensors = {k: v.float() for k, v in load_file(str(trained[2] / "model.safetensors")).items()}
    model = Eagle3TrainHead.from_export(cfg, tensors)
    head = Eagle3Head(read_eagle3(trained[2], cfg), target.model, 64)
    torch.manual_seed(1)
    T, steps = 7, 3
    hidden = {i: torch.randn(T, cfg.dim) for i in head.hidden_layers}
    tokens = torch.randint(0, cfg.vocab_size, (T + steps,))
    emb = target.model.embed.float()
    taps = torch.cat([hidden[j - 1] if j else emb[tokens[:T]] for j in head.taps], -1)
    with torch.no_grad():
        outs = model.unroll(taps[None], emb[tokens[1:]][None], steps)
    f = head.fuse(hidden, tokens[:T])
    for t in (0, 3, 6):
        o = head.forward(f[:t + 1], tokens[1:t + 2], 0)[-1:]
        torch.testing.assert_close(outs[0][0, t:t + 1], o, atol=1e-4, rtol=1e-4)
        for s in range(1, steps):
            o = head.forward(o, tokens[t + 1 + s:t + 2 + s], t + s)
            torch.testing.assert_close(outs[s][0, t:t + 1], o, atol=1e-4, rtol=1e-4, msg=f"anchor {t}, step {s}")


def test_training_is_deterministic_and_resumable(tiny, trained, profile, tmp_path, capsys):  # noqa: F811
    _, data, reference = trained
    out = tmp_path / "resumed"
    assert train(profile, data, out, "--stop-at", "3") == 0
    assert not (out / "model.safetensors").exists()
    assert train(profile, data, out) == 0
    assert "resuming from step 3" in capsys.readouterr().err
    want, got = load_file(str(reference / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_taps_past_the_target_are_one_line(trained, profile, capsys):  # noqa: F811
    _, data, _ = trained
    assert main(["train", "eagle3", "--data", str(data), "--target", profile, "--out", str(trained[0] / "x"),
                 "--taps", "1", "5", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--taps 1 5: each must be 0..2" in err and len(err.splitlines()) == 1
