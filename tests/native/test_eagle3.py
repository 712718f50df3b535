"""EAGLE-3 heads in the four public formats: each read alike, the math against a plain reference
fed transformers' own hidden states, and one clear line for a head that does not fit its target."""
import json

import pytest
import torch

from specchat.backends.base import BackendError
from specchat.backends.native.eagle3 import Eagle3Head, default_taps, detect_format, read_eagle3
from specchat.backends.native.engine import TorchBackend
from tests.native.tiny import make_hf_checkpoint
from tests.speculative.tiny_eagle3 import (FORMATS, make_eagle3_checkpoint, raw_tensors, reference_entries,
                                         reference_fuse, reference_logits, rms)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("e3") / "target", "llama", seed=21)


def engine(path, precision="float32"):
    return TorchBackend(path, "gguf" if path.suffix == ".gguf" else "hf_dir", precision=precision, threads=2,
                        context=128)


def transformers_hidden_states(target_dir, ids):
    """transformers' own hidden states: [j] is the input of layer j (0: the embedding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    with torch.no_grad():
        return [h[0] for h in model(torch.tensor([ids]), output_hidden_states=True).hidden_states]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_reads_the_same_head(tiny_target, tmp_path, fmt):
    base = read_eagle3(make_eagle3_checkpoint(tmp_path / "specforge", tiny_target, "specforge", seed=5),
                       engine(tiny_target).model.cfg)
    w = read_eagle3(make_eagle3_checkpoint(tmp_path / fmt, tiny_target, fmt, seed=5), engine(tiny_target).model.cfg)
    assert w.format == fmt and w.taps == (0, 1, 2)
    assert w.layer.keys() == base.layer.keys() and all(torch.equal(w.layer[k], base.layer[k]) for k in w.layer)
    for name in ("fc", "norm", "lm_head", "draft_ids"):
        assert torch.equal(getattr(w, name), getattr(base, name)), name
    assert (w.cfg.n_heads, w.cfg.n_kv_heads, w.cfg.head_dim, w.cfg.ffn_dim) == (4, 2, 16, 96)


@pytest.mark.parametrize("fmt,norm_before_residual,tap_norms,norm_output", [
    ("specforge", False, None, False), ("speculators", True, None, False), ("eagle", False, None, False),
    ("vllm", True, None, False), ("vllm", False, "norm_before_fc", False), ("vllm", True, None, True),
    ("speculators", True, "fc_norm", True)])
def test_head_matches_the_reference(tiny_target, tmp_path, fmt, norm_before_residual, tap_norms, norm_output):
    path = make_eagle3_checkpoint(tmp_path / fmt, tiny_target, fmt, seed=6, norm_before_residual=norm_before_residual,
                                  tap_norms=tap_norms, norm_output=norm_output)
    target = engine(tiny_target)
    head = Eagle3Head(read_eagle3(path, target.model.cfg), target.model, 128)
    ids = target.tokenize_chat([{"role": "user", "content": "the quick brown fox jumps over the lazy dog"}])
    T = len(ids) - 1
    _, hidden = target.forward(ids, 0, head.hidden_layers)
    o = head.forward(head.fuse(hidden, torch.tensor(ids))[:T], torch.tensor(ids[1:]), 0)  # entry t: (f[t], x[t+1])
    # deeper: the last entry's output fed back with a guessed token, one entry past the real ones
    o2 = head.forward(o[-1:], torch.tensor([7]), T)

    w, cfg = raw_tensors(path), json.loads((path / "config.json").read_text())
    layer_cfg = cfg.get("transformer_layer_config", cfg)
    embed = target.model.embed.float()
    hs = transformers_hidden_states(tiny_target, ids)
    feats = reference_fuse(w, [hs[j][:T] for j in (0, 1, 2)])
    args = (layer_cfg["num_attention_heads"], layer_cfg["num_key_value_heads"], layer_cfg["rope_theta"],
            norm_before_residual)
    ref = reference_entries(w, feats, embed[ids[1:]], torch.arange(T), torch.ones(T, T).tril().bool(), *args)
    fed = rms(ref, w["norm.weight"]) if norm_output else ref  # vLLM's norm_output feeds back norm(o)
    torch.testing.assert_close(o, fed, rtol=1e-4, atol=1e-4)
    visible = torch.ones(T + 1, T + 1).tril().bool()  # the fed-back entry sees the real ones and itself
    ref2 = reference_entries(w, torch.cat([feats, fed[-1:]]), embed[ids[1:] + [7]], torch.arange(T + 1), visible,
                             *args)[-1:]
    torch.testing.assert_close(o2, rms(ref2, w["norm.weight"]) if norm_output else ref2, rtol=1e-4, atol=1e-4)
    vocab = target.model.cfg.vocab_size
    torch.testing.assert_close(head.logits(o), reference_logits(w, ref, vocab), rtol=1e-4, atol=1e-4)
    # the greedy pick over the draft vocabulary is the argmax of the full logits
    assert torch.equal(head.greedy(o), head.logits(o).argmax(-1))
    assert set(head.greedy(o).tolist()) <= set((torch.arange(96) + w["d2t"].long()).tolist())


@pytest.mark.parametrize("fmt", ["specforge", "vllm"])
def test_specforges_nested_ids_name_layer_outputs(tiny_target, tmp_path, fmt):
    path = make_eagle3_checkpoint(tmp_path / fmt, tiny_target, fmt, taps=(1, 2, 2))
    assert json.loads((path / "config.json").read_text())["eagle_config"] == {
        "eagle_aux_hidden_state_layer_ids": [0, 1, 1]}
    assert read_eagle3(path, engine(tiny_target).model.cfg).taps == (1, 2, 2)


def test_speculators_heads_normalise_before_the_residual_unless_told_otherwise(tiny_target, tmp_path):
    cfg = engine(tiny_target).model.cfg
    path = make_eagle3_checkpoint(tmp_path / "s", tiny_target, "speculators", norm_before_residual=False)
    assert read_eagle3(path, cfg).norm_before_residual is False
    config = json.loads((path / "config.json").read_text())
    del config["norm_before_residual"]
    (path / "config.json").write_text(json.dumps(config))
    assert read_eagle3(path, cfg).norm_before_residual is True  # as vLLM reads a speculators config
    # SpecForge's norm_output only says lm_head reads norm(o): it feeds back o all the same
    path = make_eagle3_checkpoint(tmp_path / "f", tiny_target, "specforge", norm_output=True)
    assert read_eagle3(path, cfg).feed_normed is False


def test_the_heads_own_embedding_is_used_when_it_has_one(tiny_target, tmp_path):
    target = engine(tiny_target)
    w = read_eagle3(make_eagle3_checkpoint(tmp_path / "e", tiny_target, with_embed=True), target.model.cfg)
    assert w.embed is not None
    head = Eagle3Head(w, target.model, 64)
    assert torch.equal(head.embed, w.embed)


def test_taps_default_to_the_published_low_middle_high(tiny_target, tmp_path):
    path = make_eagle3_checkpoint(tmp_path / "e", tiny_target, "specforge", taps=(2, 1, 0),
                                  config_edits={"eagle_config": {}})
    head = Eagle3Head(read_eagle3(path, engine(tiny_target).model.cfg), engine(tiny_target).model, 64)
    assert head.taps == (2, 1, 0) == default_taps(3) and head.hidden_layers == (0, 1)
    assert default_taps(32) == (2, 16, 29)


def test_a_full_vocabulary_head_needs_no_d2t(tiny_target, tmp_path):
    target = engine(tiny_target)
    w = read_eagle3(make_eagle3_checkpoint(tmp_path / "e", tiny_target, draft_vocab=None), target.model.cfg)
    assert w.draft_ids is None
    head = Eagle3Head(w, target.model, 64)
    o = head.forward(head.fuse({i: torch.randn(2, 64) for i in head.hidden_layers}, torch.tensor([3, 4])),
                     torch.tensor([5, 6]), 0)
    assert head.logits(o).shape == (2, target.model.cfg.vocab_size) and torch.isfinite(head.logits(o)).all()


def test_the_format_is_told_by_the_config():
    assert detect_format({"architectures": ["Eagle3Speculator"]}) == "speculators"
    assert detect_format({"speculators_model_type": "eagle3"}) == "speculators"
    assert detect_format({"architectures": ["LlamaForCausalLMEagle3"]}) == "specforge"
    assert detect_format({"architectures": ["Eagle3LlamaForCausalLM"]}) == "vllm"
    assert detect_format({"architectures": ["LlamaForCausalLM"], "draft_vocab_size": 32000}) == "eagle"
    assert detect_format({"architectures": ["LlamaForCausalLM"]}) is None


@pytest.mark.parametrize("edit,message", [
    (dict(config_edits={"hidden_size": 32}), "the head's hidden size is 32, its target's 64"),
    (dict(config_edits={"vocab_size": 999}), "vocabulary is 999 tokens, its target's 320"),
    (dict(taps=(1, 2, 3)), r"tap layer ids \[1, 2, 3\] do not fit a target of 3 layers"),
    (dict(taps=(0, 0, 0)), r"tap layer ids \[0, 0, 0\] do not fit"),
    (dict(taps=(1, 2)), r"'fc' has shape \(64, 128\), a head for this target needs \(64, 192\)"),
    (dict(drop=("fc.weight",)), "EAGLE-3 tensor fc.weight missing"),
    (dict(drop=("hidden_norm.weight",)), "hidden_norm.weight missing"),
    (dict(tap_norms="fc_norm", drop=("fc_norm.1.weight",)), "fc_norm.1.weight missing"),
    (dict(config_edits={"draft_vocab_size": None, "architectures": ["LlamaForCausalLM"], "eagle_config": None}),
     "not an EAGLE-3 head"),
    (dict(draft_vocab=None, drop=("lm_head.weight",)), "lm_head.weight missing"),
])
def test_a_head_that_does_not_fit_is_one_clear_line(tiny_target, tmp_path, edit, message):
    kwargs = dict(edit)
    if kwargs.get("taps") == (1, 2):  # an fc for two taps, the config naming three
        kwargs["config_edits"] = {"eagle_config": None, "eagle_aux_hidden_state_layer_ids": [0, 1, 2]}
    path = make_eagle3_checkpoint(tmp_path / "e", tiny_target, "specforge", **kwargs)
    with pytest.raises(BackendError, match=message) as e:
        read_eagle3(path, engine(tiny_target).model.cfg)
    assert "\n" not in str(e.value)


def test_d2t_outside_the_vocabulary_is_refused(tiny_target, tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_eagle3_checkpoint(tmp_path / "e", tiny_target, "specforge")
    t = load_file(str(path / "model.safetensors"))
    t["d2t"] = t["d2t"] + 1000
    save_file(t, str(path / "model.safetensors"))
    with pytest.raises(BackendError, match="d2t maps the draft vocabulary .* outside the target's 320"):
        read_eagle3(path, engine(tiny_target).model.cfg)


def test_a_directory_without_weights_or_a_file_is_refused(tiny_target, tmp_path):
    cfg = engine(tiny_target).model.cfg
    path = make_eagle3_checkpoint(tmp_path / "e", tiny_target, "specforge")
    (path / "model.safetensors").unlink()
    with pytest.raises(BackendError, match="no \\*.safetensors or pytorch_model.bin"):
        read_eagle3(path, cfg)
    (tmp_path / "f.bin").write_bytes(b"x")
    with pytest.raises(BackendError, match="an EAGLE-3 head is a directory"):
        read_eagle3(tmp_path / "f.bin", cfg)


def test_head_on_an_int4_target_runs_the_int4_kernel(tiny_ggufs, tiny_dirs, tmp_path):
    target = engine(tiny_ggufs["Q4_1"], "int4")
    head = Eagle3Head(read_eagle3(make_eagle3_checkpoint(tmp_path / "e", tiny_dirs["llama"]), target.model.cfg),
                      target.model, 64)
    assert head.fc.quantized and head.layer.attention.qkv.quantized and head.out.head.quantized
    o = head.forward(head.fuse({i: torch.randn(3, 64) for i in head.hidden_layers}, torch.tensor([4, 5, 6])),
                     torch.tensor([5, 6, 7]), 0)
    assert torch.isfinite(head.logits(o)[:, head.out.ids]).all()
