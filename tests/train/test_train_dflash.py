"""`specchat train data` then `specchat train dflash` end to end on a tiny target, through the CLI."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from specchat.backends.base import Request, Sampling, run_to_summary
from specchat.backends.native.engine import TorchBackend
from specchat.backends.speculative.backend import SpeculativeBackend
from specchat.backends.speculative.dflash import DFlashDrafter, load_dflash
from specchat.cli import main
from tests.native.tiny import CORPUS, make_hf_checkpoint

STEPS = 6


def train(data: Path, out: Path, *extra) -> int:
    return main(["train", "dflash", "--data", str(data), "--target", "tiny", "--out", str(out), "--layers", "1",
                 "--ffn", "64", "--block-size", "4", "--target-layers", "0", "2", "--steps", str(STEPS),
                 "--batch-tokens", "64", "--anchors", "4", "--checkpoint-every", "2", "--eval-every", "3",
                 "--seed", "5", "--threads", "1", *extra])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target, its profile, its replies to a few prompts, one trained drafter."""
    root = tmp_path_factory.mktemp("train-dflash")
    target = make_hf_checkpoint(root / "target", "llama", seed=21)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in dict.fromkeys(CORPUS)))
    profiles = root / "profiles"
    profiles.mkdir()
    (profiles / "tiny.yaml").write_text(f"backend: torch\nmodel: {target}\ndtype: float32\nthreads: 1\ncontext: 256\n")
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECCHAT_PROFILES_DIR", str(profiles))
    assert main(["train", "data", "--target", "tiny", "--prompts", str(prompts), "--out", str(root / "data"),
                 "--max-tokens", "24", "--top-k", "8"]) == 0
    assert train(root / "data", root / "dflash") == 0
    mp.undo()
    return target, profiles, root / "data", root / "dflash"


@pytest.fixture
def tiny_profile(setup, monkeypatch):
    monkeypatch.setenv("SPECCHAT_PROFILES_DIR", str(setup[1]))


def test_writes_the_released_layout_and_a_card(setup):
    _, _, _, out = setup
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 4 and cfg["num_target_layers"] == 3 and cfg["hidden_size"] == 64
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 2]
    # no mask token in the tokenizer: its highest added token that is not an end of reply (<|im_start|>)
    assert cfg["dflash_config"]["mask_token_id"] == 1
    names = set(load_file(str(out / "model.safetensors")))
    layer = {f"layers.0.self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
    layer |= {f"layers.0.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm", "mlp.gate_proj",
                                                 "mlp.up_proj", "mlp.down_proj")}
    assert names == {"fc.weight", "hidden_norm.weight", "norm.weight"} | layer
    card = (out / "README.md").read_text()
    assert "specchat train dflash" in card and "specchat train data" in card and "tokens per pass" in card
    log = [json.loads(line) for line in (out / "train-log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, STEPS + 1)) and "eval_tokens_per_pass" in log[-1]


def test_trained_drafter_runs_in_the_loop_with_parity(setup):
    target = TorchBackend(setup[0], "hf_dir", precision="float32", threads=1, context=256)
    drafter = DFlashDrafter(load_dflash(setup[3], target.model.cfg), target)
    request = Request(messages=[{"role": "user", "content": CORPUS[0]}])
    for sampling in (Sampling(max_tokens=30), Sampling(temperature=0.8, seed=2, max_tokens=30)):
        target.truncate(0)
        ref = run_to_summary(target.stream(request, sampling))
        target.truncate(0)
        out = run_to_summary(SpeculativeBackend(target, drafter, 3).stream(request, sampling))
        assert out.token_ids == ref.token_ids and out.drafts > 0


def test_training_is_deterministic_and_resumable(setup, tiny_profile, tmp_path, capsys):
    _, _, data, reference = setup
    out = tmp_path / "resumed"
    assert train(data, out, "--stop-at", "3") == 0
    assert not (out / "model.safetensors").exists()
    assert train(data, out) == 0
    assert "resuming from step 3" in capsys.readouterr().err
    want, got = load_file(str(reference / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert want.keys() == got.keys()
    for k in want:
        assert (want[k] == got[k]).all(), k


def test_changed_settings_and_bad_layers_are_one_line(setup, tiny_profile, tmp_path, capsys):
    _, _, data, _ = setup
    out = tmp_path / "o"
    assert train(data, out, "--stop-at", "2") == 0
    assert train(data, out, "--gamma", "2") == 2
    assert train(data, tmp_path / "p", "--target-layers", "0", "3") == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("specchat: error")]
    assert len(err) == 2 and "other settings" in err[0] and "must lie in 0..2" in err[1]


def test_a_training_block_sees_what_the_drafter_sees_at_inference(setup):
    """The packed, block-masked training forward gives each block the logits the drafter computes
    in the loop for the same committed context (several samples and anchors in one batch)."""
    import torch

    from specchat.train.dflash import make_batch
    from specchat.train.examples import load_examples

    target = TorchBackend(setup[0], "hf_dir", precision="float32", threads=1, context=256)
    model = load_dflash(setup[3], target.model.cfg)
    drafter = DFlashDrafter(model, target)
    examples = [e for e in load_examples([setup[2]]) if len(e.tokens) - e.prompt_len >= 6][:3]
    feats = [torch.cat([target.forward(e.tokens.tolist(), 0, drafter.hidden_layers)[1][k]
                        for k in drafter.hidden_layers], dim=-1) for e in examples]
    anchors = [[e.prompt_len, len(e.tokens) - 3] for e in examples]
    b = make_batch(examples, feats, anchors, model.cfg, gamma=4.0)
    with torch.no_grad():
        h = model(target.model.embed[b.x_ids], model.fuse(b.ctx), b.positions, {"full_attention": b.mask})
        trained = drafter.logits(h).view(-1, 4, target.model.cfg.vocab_size)[:, 1:]
    i = 0
    for e, f, found in zip(examples, feats, anchors):
        for a in found:
            hidden = dict(zip(drafter.hidden_layers, f[:a].split(64, dim=-1)))
            drafter.start(e.tokens[:a].tolist(), hidden, Sampling())
            torch.testing.assert_close(drafter.draft_logits(e.tokens[:a + 1].tolist(), 3), trained[i],
                                       atol=1e-4, rtol=1e-4)
            i += 1
