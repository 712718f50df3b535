"""`specchat train dspark` end to end on a tiny target: a DFlash drafter trained briefly, then a
Markov head trained on top of it, through the CLI; the result loads and drafts in the loop."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specchat.backends.base import Request, Sampling, run_to_summary
from specchat.backends.native.engine import TorchBackend
from specchat.backends.speculative.backend import SpeculativeBackend
from specchat.backends.speculative.dspark import DSparkDrafter, load_dspark
from specchat.cli import main
from tests.native.tiny import CORPUS, make_hf_checkpoint

STEPS = 6


def train(data: Path, init: Path, out: Path, *extra) -> int:
    return main(["train", "dspark", "--data", str(data), "--target", "tiny", "--init", str(init), "--out", str(out),
                 "--rank", "8", "--steps", str(STEPS), "--batch-tokens", "64", "--anchors", "4", "--lr", "0.02",
                 "--checkpoint-every", "2", "--eval-every", "3", "--seed", "5", "--threads", "1", *extra])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target, its replies to a few prompts, a DFlash drafter (2 steps) and a DSpark drafter on it."""
    root = tmp_path_factory.mktemp("train-dspark")
    target = make_hf_checkpoint(root / "target", "llama", seed=21)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in dict.fromkeys(CORPUS)))
    profiles = root / "profiles"
    profiles.mkdir()
    (profiles / "tiny.yaml").write_text(f"backend: torch\nmodel: {target}\ndtype: float32\nthreads: 1\ncontext: 256\n")
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECCHAT_PROFILES_DIR", str(profiles))
    data = root / "data"
    assert main(["train", "data", "--target", "tiny", "--prompts", str(prompts), "--out", str(data),
                 "--max-tokens", "24", "--top-k", "8"]) == 0
    assert main(["train", "dflash", "--data", str(data), "--target", "tiny", "--out", str(root / "dflash"),
                 "--ffn", "64", "--block-size", "4", "--target-layers", "0", "2", "--steps", "2",
                 "--batch-tokens", "64", "--anchors", "4", "--threads", "1"]) == 0
    assert train(data, root / "dflash", root / "dspark") == 0
    mp.undo()
    return target, profiles, data, root / "dflash", root / "dspark"


@pytest.fixture
def tiny_profile(setup, monkeypatch):
    monkeypatch.setenv("SPECCHAT_PROFILES_DIR", str(setup[1]))


def test_writes_dflash_tensors_unchanged_plus_the_markov_head_and_a_card(setup):
    _, _, _, dflash, out = setup
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DSparkDraftModel"] and cfg["block_size"] == 4
    assert cfg["dflash_config"] | {} == json.loads((dflash / "config.json").read_text())["dflash_config"] | {
        "projector_type": "dspark", "markov_rank": 8, "sample_from_anchor": False}
    got, base = load_file(str(out / "model.safetensors")), load_file(str(dflash / "model.safetensors"))
    assert set(got) == set(base) | {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"}
    assert all(torch.equal(got[k], base[k]) for k in base)  # the DFlash drafter stays frozen by default
    assert got["markov_head.markov_w2.weight"].shape == (cfg["vocab_size"], 8)
    assert got["markov_head.markov_w2.weight"].abs().sum() > 0  # it learned something
    card = (out / "README.md").read_text()
    assert "specchat train dspark" in card and "--init" in card and "the DFlash drafter alone" in card
    log = [json.loads(line) for line in (out / "train-log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    assert "eval_tokens_per_pass" in log[-1] and "eval_tokens_per_pass_dflash" in log[-1] and "tv" in log[-1]


def test_trained_drafter_runs_in_the_loop_with_parity(setup):
    target = TorchBackend(setup[0], "hf_dir", precision="float32", threads=1, context=256)
    drafter = DSparkDrafter(load_dspark(setup[4], target.model.cfg), target)
    assert drafter.max_depth == 3  # slot 0 is the committed token, as in the DFlash drafter it came from
    request = Request(messages=[{"role": "user", "content": CORPUS[0]}])
    for sampling in (Sampling(max_tokens=30), Sampling(temperature=0.8, seed=2, max_tokens=30)):
        target.truncate(0)
        ref = run_to_summary(target.stream(request, sampling))
        target.truncate(0)
        out = run_to_summary(SpeculativeBackend(target, drafter, 3).stream(request, sampling))
        assert out.token_ids == ref.token_ids and out.drafts > 0


def test_resumable_and_bad_init_is_one_line(setup, tiny_profile, tmp_path, capsys):
    _, _, data, dflash, reference = setup
    out = tmp_path / "resumed"
    assert train(data, dflash, out, "--stop-at", "3") == 0
    assert train(data, dflash, out) == 0
    assert "resuming from step 3" in capsys.readouterr().err
    want, got = load_file(str(reference / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert train(data, tmp_path / "nowhere", tmp_path / "x") == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("specchat: error")]
    assert len(err) == 1 and "no config.json" in err[0]
