"""MTP heads in the three public layouts: loading, the math against an independent reference
built from transformers' own decoder layer, and clear errors for what the engine cannot run."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specchat.backends.base import BackendError
from specchat.backends.native.engine import TorchBackend
from specchat.backends.native.mtp import MtpHead, read_mtp, unsupported_main_model
from tests.native.tiny import MTP_LAYOUT_FAMILY, add_mtp_head, make_hf_checkpoint, mtp_tensor_names


@pytest.fixture(scope="module", params=sorted(MTP_LAYOUT_FAMILY))
def with_mtp(request, tmp_path_factory):
    layout = request.param
    ckpt = make_hf_checkpoint(tmp_path_factory.mktemp(layout) / "m", MTP_LAYOUT_FAMILY[layout], seed=3)
    add_mtp_head(ckpt, layout, seed=4)
    return layout, ckpt


def reference(ckpt, layout, hidden, next_tokens):
    """The MTP math written out with transformers' decoder layer (a one-layer model of the target's
    family whose final norm is the MTP's final norm)."""
    from transformers import AutoConfig, AutoModel

    cfg = AutoConfig.from_pretrained(ckpt)
    n, eps = cfg.num_hidden_layers, cfg.rms_norm_eps
    mtp = load_file(str(ckpt / "mtp.safetensors"))
    main = load_file(str(ckpt / "model.safetensors"))
    names = mtp_tensor_names(layout, n)
    off = 1.0 if layout == "qwen3_next" else 0.0

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (w + off)

    embed = main["model.embed_tokens.weight"]
    e, h = rms(embed[next_tokens], mtp[names["embed_norm"]]), rms(hidden, mtp[names["hidden_norm"]])
    u = (torch.cat([h, e], -1) if layout == "mimo" else torch.cat([e, h], -1)) @ mtp[names["proj"]].T
    cfg.num_hidden_layers = 1
    model = AutoModel.from_config(cfg).float()
    p = names["layer"]
    own = {names[r] for r in ("embed_norm", "hidden_norm", "proj", "final_norm")}
    sd = {"layers.0." + k[len(p):]: v + (off if "norm" in k else 0.0) for k, v in mtp.items()
          if k.startswith(p) and k not in own}
    sd |= {"norm.weight": mtp[names["final_norm"]] + off, "embed_tokens.weight": embed}
    model.load_state_dict(sd, strict=True)
    with torch.no_grad():
        g = model(inputs_embeds=u[None]).last_hidden_state[0]
    head = main.get("lm_head.weight", embed)
    return g, g @ head.T


def test_head_matches_reference_in_every_layout(with_mtp):
    layout, ckpt = with_mtp
    engine = TorchBackend(ckpt, "hf_dir", precision="float32", threads=1, context=64)  # main loader skips MTP
    w = read_mtp(ckpt, engine.model.cfg)
    assert w.layout.name == layout and len(w.layers) == 1
    head = MtpHead(w, engine.model, 64)
    torch.manual_seed(0)
    hidden = torch.randn(6, engine.model.cfg.dim)
    tokens = torch.randint(0, engine.model.cfg.vocab_size, (6,))
    g = head.forward(hidden, tokens, 0)
    ref_g, ref_logits = reference(ckpt, layout, hidden, tokens)
    assert torch.allclose(g, ref_g, atol=1e-4), (g - ref_g).abs().max()
    assert torch.allclose(head.logits(g), ref_logits, atol=1e-3)
    # entries fed in two passes (cache reuse) give the same states
    head.forward(hidden[:4], tokens[:4], 0)
    assert torch.allclose(head.forward(hidden[4:], tokens[4:], 4), g[4:], atol=1e-5)
    # rolling back: rerun entry 2 with a different token, then 3.. see the new entry
    head.forward(hidden[:2], tokens[:2], 0)
    assert torch.allclose(head.forward(hidden[2:], tokens[2:], 2), g[2:], atol=1e-5)


def test_main_model_ignores_the_mtp_tensors(with_mtp):
    layout, ckpt = with_mtp
    plain = make_hf_checkpoint(ckpt.parent / "plain", MTP_LAYOUT_FAMILY[layout], seed=3)
    a = TorchBackend(ckpt, "hf_dir", precision="float32", threads=1, context=32)
    b = TorchBackend(plain, "hf_dir", precision="float32", threads=1, context=32)
    ids = [5, 6, 7, 8]
    assert torch.equal(a.forward(ids, 0)[0], b.forward(ids, 0)[0])


def _rewrite(ckpt, change):
    t = load_file(str(ckpt / "mtp.safetensors"))
    change(t)
    save_file(t, str(ckpt / "mtp.safetensors"))


def test_clear_errors(tmp_path):
    ckpt = make_hf_checkpoint(tmp_path / "m", "qwen3", seed=1)
    cfg = TorchBackend(ckpt, "hf_dir", precision="float32", threads=1, context=32).model.cfg
    with pytest.raises(BackendError, match="no MTP head found.*specchat train mtp"):
        read_mtp(ckpt, cfg)
    written = add_mtp_head(ckpt, "qwen3_next")
    q = "mtp.layers.0.self_attn.q_proj.weight"

    _rewrite(ckpt, lambda t: t.__setitem__(q, torch.cat([t[q], t[q]])))  # Qwen3-Next's output gate
    with pytest.raises(BackendError, match="gated attention"):
        read_mtp(ckpt, cfg)
    _rewrite(ckpt, lambda t: (t.__setitem__(q, written[q]), t.__setitem__("mtp.layers.0.mlp.experts.0.up_proj.weight",
                                                                          torch.zeros(4, 4))))
    with pytest.raises(BackendError, match="mixture-of-experts"):
        read_mtp(ckpt, cfg)
    _rewrite(ckpt, lambda t: (t.pop("mtp.layers.0.mlp.experts.0.up_proj.weight"), t.pop("mtp.fc.weight"),
                              t.__setitem__("mtp.fc.weight", torch.zeros(8, 8))))
    with pytest.raises(BackendError, match="'proj' has shape"):
        read_mtp(ckpt, cfg)
    _rewrite(ckpt, lambda t: t.pop("mtp.layers.0.self_attn.o_proj.weight"))
    with pytest.raises(BackendError, match="o_proj.weight missing"):
        read_mtp(ckpt, cfg)


def test_deepseek_head_of_another_model_is_refused(tmp_path):
    ckpt = make_hf_checkpoint(tmp_path / "m", "llama", seed=1)
    add_mtp_head(ckpt, "deepseek")
    cfg = TorchBackend(ckpt, "hf_dir", precision="float32", threads=1, context=32).model.cfg
    from dataclasses import replace

    with pytest.raises(BackendError, match="belongs to another model"):
        read_mtp(ckpt, replace(cfg, n_layers=2))


def test_unsupported_main_models_are_named():
    assert "latent attention" in unsupported_main_model({"model_type": "deepseek_v3", "n_routed_experts": 256,
                                                         "kv_lora_rank": 512})
    assert "latent attention" in unsupported_main_model({"model_type": "deepseek_v3", "kv_lora_rank": 512})
    assert "sliding_attention layers" in unsupported_main_model(
        {"model_type": "gemma3", "layer_types": ["sliding_attention", "full_attention"]})
    # hybrids with linear attention run, and routed experts (backends/native/moe.py)
    assert unsupported_main_model({"model_type": "qwen3_next", "num_hidden_layers": 2,
                                   "layer_types": ["linear_attention", "full_attention"]}) is None
    assert unsupported_main_model({"model_type": "qwen3_next", "num_hidden_layers": 2, "num_experts": 8,
                                   "mlp_only_layers": [0, 1]}) is None
    assert unsupported_main_model({"model_type": "qwen3_next", "num_hidden_layers": 2, "num_experts": 8,
                                   "mlp_only_layers": [0]}) is None
    assert unsupported_main_model({"model_type": "mimo"}) is None


def test_builtin_head_of_an_unsupported_model_says_so(tmp_path):
    from specchat.loading import load_speculative
    from specchat.profiles import Profile

    ckpt = make_hf_checkpoint(tmp_path / "m", "llama", seed=1)
    add_mtp_head(ckpt, "deepseek")
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(cfg | {"kv_lora_rank": 512}))  # DeepSeek-V3's latent attention
    profile = Profile(name="x", model=str(ckpt), speculative={"method": "mtp"})
    with pytest.raises(BackendError, match=r"multi-head latent attention \(`kv_lora_rank`\), which the torch engine "
                                           "does not run; use backend: llamacpp"):
        load_speculative(profile)


def test_head_on_an_int4_target_runs_the_int4_kernel(tiny_dirs, tiny_ggufs, tmp_path):
    """On an int4 target the head's matrices are quantized to the same kernel (faster guesses);
    its states stay close to the float head's."""
    import shutil

    ckpt = shutil.copytree(tiny_dirs["llama"], tmp_path / "with-mtp")
    add_mtp_head(ckpt, "deepseek", seed=5)
    int4 = TorchBackend(tiny_ggufs["Q4_1"], precision="int4", threads=1, context=64)
    dense = TorchBackend(tiny_ggufs["Q4_1"], precision="bfloat16", threads=1, context=64)
    assert int4.model.runs_int4 and not dense.model.runs_int4
    heads = [MtpHead(read_mtp(ckpt, e.model.cfg), e.model, 64) for e in (int4, dense)]
    layer = heads[0].layers[0]["layer"]
    assert all(lin.quantized for lin in (layer.attention.qkv, layer.attention.o, layer.mlp.gate_up,
                                                layer.mlp.down, heads[0].layers[0]["proj"]))
    torch.manual_seed(0)
    hidden, tokens = torch.randn(5, int4.model.cfg.dim), torch.tensor([3, 9, 4, 1, 7])
    g_int4, g_dense = (h.forward(hidden, tokens, 0) for h in heads)
    assert torch.nn.functional.cosine_similarity(g_int4, g_dense).min() > 0.95


def test_int4_quantization_round_trip():
    from specchat.backends.native.int4 import Int4Rows, int4_linear

    torch.manual_seed(1)
    w = torch.randn(16, 64)
    q = Int4Rows.quantize(w)
    step = q.scale.repeat_interleave(32, dim=1)
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-6).all()
    x = torch.randn(3, 64)
    y = int4_linear(w)(x.to(torch.bfloat16)).float()
    assert torch.allclose(y, x @ q.dequantize().T, atol=0.1, rtol=0.02)
    assert Int4Rows.fits(w) and not Int4Rows.fits(torch.randn(16, 48))


def test_greedy_pick_equals_argmax_of_full_logits(with_mtp):
    layout, ckpt = with_mtp
    engine = TorchBackend(ckpt, "hf_dir", precision="float32", threads=1, context=32)
    weights = read_mtp(ckpt, engine.model.cfg)
    weights.draft_vocab = torch.arange(0, engine.model.cfg.vocab_size, 3)  # a draft vocabulary: every third id
    for w in (weights, read_mtp(ckpt, engine.model.cfg)):
        head = MtpHead(w, engine.model, 32)
        g = head.forward(torch.randn(4, engine.model.cfg.dim), torch.tensor([1, 2, 3, 4]), 0)
        assert torch.equal(head.greedy(g), head.logits(g).argmax(-1))
