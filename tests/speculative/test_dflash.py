"""DFlash: the drafter forward against a naive reference computation, its context cache, the
loader's checks against the target, and speculative == target-only with a DFlash drafter."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from specchat.backends.base import BackendError, Request, Sampling, run_to_summary
from specchat.backends.native.engine import TorchBackend
from specchat.backends.speculative.backend import SpeculativeBackend
from specchat.backends.speculative.dflash import DFlashDrafter, build_target_layer_ids, load_dflash
from specchat.verify import fresh
from tests.native.tiny import make_hf_checkpoint
from tests.speculative.conftest import PROMPTS, SAMPLINGS
from tests.speculative.tiny_dflash import make_dflash_checkpoint


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("dflash") / "qwen3", "qwen3", seed=31)


@pytest.fixture(scope="module")
def qwen3(qwen3_dir):
    return TorchBackend(qwen3_dir, "hf_dir", precision="float32", threads=2, context=256)


@pytest.fixture(scope="module")
def hf_target(qwen3_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(qwen3_dir), dtype=torch.float32).eval()


def drafter_for(target, ck) -> DFlashDrafter:
    return DFlashDrafter(load_dflash(ck, target.model.cfg), target)


# ---- an independent reference: Hugging Face for the target's hidden states, naive loops for the drafter ----

def rms(x, w, eps=1e-6):
    return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta):
    """x [T, hd]: rotate each pair (j, j + hd/2) by pos * theta^(-2j/hd)."""
    hd = x.shape[-1]
    j = torch.arange(hd // 2, dtype=torch.float64)
    angle = pos[:, None].double() * theta ** (-2 * j / hd)
    c, s = torch.cos(angle).float(), torch.sin(angle).float()
    a, b = x[:, :hd // 2], x[:, hd // 2:]
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)


def reference_logits(hf_target, ck, tokens: list[int]) -> torch.Tensor:
    """Draft logits for positions len(tokens) .. len(tokens) + B - 2, computed from scratch."""
    cfg = json.loads((ck / "config.json").read_text())
    w = {k: v.float() for f in sorted(ck.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    B, H, Hkv, hd = cfg["block_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    n = len(tokens)
    with torch.no_grad():
        hs = hf_target(input_ids=torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i + 1][0] for i in cfg["dflash_config"]["target_layer_ids"]], dim=-1)
        ctx = rms(feats @ w["fc.weight"].T, w["hidden_norm.weight"])
        block = torch.tensor([tokens[-1]] + [cfg["dflash_config"]["mask_token_id"]] * (B - 1))
        x = hf_target.model.embed_tokens.weight[block]
        q_pos, k_pos = torch.arange(n - 1, n - 1 + B), torch.arange(n - 1 + B)
        for i in range(cfg["num_hidden_layers"]):
            p = lambda name: w[f"layers.{i}.{name}.weight"]  # noqa: E731
            h = rms(x, p("input_layernorm"))
            kv_in = torch.cat([ctx, h])
            heads = []
            for head in range(H):
                g = head // (H // Hkv)
                q = rms((h @ p("self_attn.q_proj").T)[:, head * hd:(head + 1) * hd], p("self_attn.q_norm"))
                k = rms((kv_in @ p("self_attn.k_proj").T)[:, g * hd:(g + 1) * hd], p("self_attn.k_norm"))
                v = (kv_in @ p("self_attn.v_proj").T)[:, g * hd:(g + 1) * hd]
                q, k = rope(q, q_pos, cfg["rope_theta"]), rope(k, k_pos, cfg["rope_theta"])
                scores = q @ k.T / math.sqrt(hd)
                if cfg["layer_types"][i] == "sliding_attention":
                    far = k_pos[None, :] <= q_pos[:, None] - cfg["sliding_window"]
                    scores = scores.masked_fill(far, float("-inf"))
                heads.append(torch.softmax(scores, dim=-1) @ v)
            x = x + torch.cat(heads, dim=-1) @ p("self_attn.o_proj").T
            h = rms(x, p("post_attention_layernorm"))
            gate, up = torch.nn.functional.silu(h @ p("mlp.gate_proj").T), h @ p("mlp.up_proj").T
            x = x + (gate * up) @ p("mlp.down_proj").T
        return rms(x, w["norm.weight"])[1:] @ hf_target.lm_head.weight.T


def prompt_ids(target, i=0):
    return target.prompt_ids(Request(messages=PROMPTS[i]))


@pytest.mark.parametrize("layout", ["plain", "sliding", "last-layer"])
def test_forward_matches_a_naive_reference(tmp_path, qwen3_dir, qwen3, hf_target, layout):
    kw = {"plain": {}, "sliding": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5),
          # layer 2 is the target's last: its Hugging Face hidden state is taken after the final norm
          "last-layer": dict(target_layer_ids=(1, 2), layers=1)}[layout]
    ck = make_dflash_checkpoint(tmp_path / "d", qwen3_dir, block_size=5, **kw)
    drafter = drafter_for(qwen3, ck)
    tokens = prompt_ids(qwen3) + [77]
    _, hidden = fresh(qwen3).forward(tokens[:-1], 0, drafter.hidden_layers)
    drafter.start(tokens[:-1], hidden, Sampling())
    got = drafter.draft_logits(tokens, 4)
    want = reference_logits(hf_target, ck, tokens)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def test_context_cache_follows_commits_and_ignores_drafted_blocks(tmp_path, qwen3_dir, qwen3, hf_target):
    ck = make_dflash_checkpoint(tmp_path / "d", qwen3_dir, block_size=4, layers=2, shards=2,
                                layer_types=["full_attention", "sliding_attention"], sliding_window=7)
    drafter = drafter_for(qwen3, ck)
    tokens = prompt_ids(qwen3, 1) + [40, 41, 42, 43, 44, 45, 46]
    P = len(tokens) - 7
    _, hidden = fresh(qwen3).forward(tokens[:P], 0, drafter.hidden_layers)
    drafter.start(tokens[:P], hidden, Sampling())
    n = P + 1
    for step in (1, 3, 2):  # commits of one pass each, with a drafted block in between
        drafter.propose(tokens[:n], 3)
        _, hidden = qwen3.forward(tokens[n - 1:n - 1 + step], n - 1, drafter.hidden_layers)
        drafter.commit(tokens[:n + step], hidden)
        n += step
    got = drafter.draft_logits(tokens[:n], 3)
    torch.testing.assert_close(got, reference_logits(hf_target, ck, tokens[:n]), atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(drafter.draft_logits(tokens[:n], 3), got)  # again, with nothing new committed
    assert torch.is_inference(got)  # drafting records no autograd graph
    drafter.start(tokens[:P], fresh(qwen3).forward(tokens[:P], 0, drafter.hidden_layers)[1], Sampling())
    torch.testing.assert_close(drafter.draft_logits(tokens[:P + 1], 3),
                               reference_logits(hf_target, ck, tokens[:P + 1]), atol=2e-4, rtol=1e-4)


def test_a_float32_cpu_target_drafts_with_the_loaded_model_itself(tmp_path, qwen3_dir, qwen3):
    model = load_dflash(make_dflash_checkpoint(tmp_path / "d", qwen3_dir, block_size=4), qwen3.model.cfg)
    assert DFlashDrafter(model, qwen3).model is model  # no second copy of its weights (int4 and devices get one)


def test_default_target_layers_follow_the_published_rule():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(30, 1) == [15]
    assert build_target_layer_ids(30, 3) == [1, 14, 27]


# ---- the loader refuses a drafter made for another target, in one line ----

MISFITS = {
    "hidden size": (dict(config_edits={"hidden_size": 32}), "hidden size 32 differs from the target's 64"),
    "target depth": (dict(config_edits={"num_target_layers": 36}), "made for a target with 36 layers"),
    "layer ids": (dict(target_layer_ids=(0, 3)), r"target_layer_ids \[0, 3\] must lie in 0..2"),
    "mask token": (dict(mask_token_id=100_000), "mask_token_id 100000 is outside the target's vocabulary"),
    "vocabulary": (dict(config_edits={"vocab_size": 151936}), "vocab_size 151936 differs"),
    "fc inputs": (dict(config_edits={"dflash_config": {"mask_token_id": 5, "target_layer_ids": [1]}}),
                  "fc.weight takes 128 inputs but 1 target layers x hidden 64 = 64"),
    "block size": (dict(block_size=1), "block_size 1 leaves nothing to draft"),
    "layer types": (dict(layer_types=["sliding_attention", "full_attention"]), "sliding_window is not set"),
}


@pytest.mark.parametrize("case", sorted(MISFITS))
def test_loader_refuses_a_drafter_that_does_not_fit(tmp_path, qwen3_dir, qwen3, case):
    kw, message = MISFITS[case]
    ck = make_dflash_checkpoint(tmp_path / "d", qwen3_dir, **kw)
    with pytest.raises(BackendError, match=message) as e:
        load_dflash(ck, qwen3.model.cfg)
    assert "\n" not in str(e.value)


def test_loader_refuses_foreign_or_missing_tensors(tmp_path, qwen3_dir, qwen3):
    from safetensors.torch import save_file

    ck = make_dflash_checkpoint(tmp_path / "d", qwen3_dir)
    w = load_file(str(ck / "model.safetensors"))
    save_file(w | {"embed_tokens.weight": torch.zeros(4, 4)}, str(ck / "model.safetensors"))
    with pytest.raises(BackendError, match="tensors a DFlash drafter does not have"):
        load_dflash(ck, qwen3.model.cfg)
    del w["norm.weight"]
    save_file(w, str(ck / "model.safetensors"))
    with pytest.raises(BackendError, match="tensor norm.weight missing"):
        load_dflash(ck, qwen3.model.cfg)


def test_profile_depth_beyond_the_block_is_refused(tmp_path, qwen3_dir, monkeypatch):
    from specchat.backends.speculative.backend import make_drafter
    from specchat.loading import speculative_settings
    from specchat.profiles import load_profile_file

    ck = make_dflash_checkpoint(tmp_path / "d", qwen3_dir, block_size=4)
    f = tmp_path / "p.yaml"
    f.write_text(f"model: {qwen3_dir}\ndtype: float32\nspeculative:\n  method: dflash\n  drafter: {ck}\n  depth: 4\n")
    target = TorchBackend(qwen3_dir, "hf_dir", precision="float32", threads=1, context=64)
    with pytest.raises(BackendError, match="depth 4 is more than this DFlash drafter proposes per pass"):
        make_drafter(speculative_settings(load_profile_file(f)), target)
    f.write_text(f.read_text().replace("depth: 4", "depth: 3"))
    drafter = make_drafter(speculative_settings(load_profile_file(f)), target)
    assert drafter.block_size == 4 and drafter.max_depth == 3  # a block: the last committed token + 3 guesses


# ---- speculative == target-only ----

@pytest.mark.parametrize("depth", [1, 3, 6])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "t0.8", "t1.2-topk-topp"])
def test_speculative_with_dflash_equals_target_only_on_qwen3(tmp_path_factory, qwen3_dir, qwen3, depth, sampling):
    ck = make_dflash_checkpoint(tmp_path_factory.mktemp("d") / "d", qwen3_dir, block_size=7)
    spec = SpeculativeBackend(qwen3, drafter_for(qwen3, ck), depth)
    for messages in PROMPTS + [PROMPTS[1] + [{"role": "assistant", "content": "fine"},
                                            {"role": "user", "content": "the lazy dog"}]]:
        ref = run_to_summary(fresh(qwen3).stream(Request(messages=messages), sampling))
        out = run_to_summary(fresh(spec).stream(Request(messages=messages), sampling))
        assert out.token_ids == ref.token_ids and out.stop_reason == ref.stop_reason
        assert out.draft_tokens > 0 and max(len(d) for d, _ in out.pass_log) == depth  # it drafts, as deep as asked


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "t0.8", "t1.2-topk-topp"])
def test_strict_dflash_is_bitwise_target_only(tmp_path, tiny_pair, sampling):
    """bfloat16 target, verify blocks row by row: no tolerance at all."""
    target = TorchBackend(tiny_pair[0], "hf_dir", precision="bfloat16", threads=2, context=256)
    spec = SpeculativeBackend(target, drafter_for(target, make_dflash_checkpoint(tmp_path / "d", tiny_pair[0],
                                                                                block_size=5)), 4, strict=True)
    for messages in PROMPTS:
        ref = run_to_summary(fresh(target).stream(Request(messages=messages), sampling))
        out = run_to_summary(fresh(spec).stream(Request(messages=messages), sampling))
        assert out.token_ids == ref.token_ids


def test_rejection_acceptance_gets_the_distributions_drafts_were_sampled_from(tmp_path, qwen3_dir, qwen3):
    from specchat.backends.native.sampling import probs

    ck = make_dflash_checkpoint(tmp_path / "d", qwen3_dir, block_size=5)
    drafter = DFlashDrafter(load_dflash(ck, qwen3.model.cfg), qwen3, want_q=True)
    sampling = Sampling(temperature=0.9, top_k=20, seed=3, max_tokens=20)
    tokens = prompt_ids(qwen3) + [77]
    drafter.start(tokens[:-1], fresh(qwen3).forward(tokens[:-1], 0, drafter.hidden_layers)[1], sampling)
    logits = drafter.draft_logits(tokens, 4)
    drafter.start(tokens[:-1], fresh(qwen3).forward(tokens[:-1], 0, drafter.hidden_layers)[1], sampling)
    draft = drafter.propose(tokens, 4)
    assert len(draft.tokens) == 4 and torch.equal(draft.q, probs(logits, sampling))
    assert all(draft.q[i, t] > 0 for i, t in enumerate(draft.tokens))
    out = run_to_summary(SpeculativeBackend(fresh(qwen3), drafter, 4, acceptance="rejection")
                         .stream(Request(messages=PROMPTS[1]), sampling))
    assert out.stop_reason in ("eos", "max_tokens") and out.drafts > 0


def test_drafter_on_an_int4_target_runs_int4_and_keeps_parity(tmp_path):
    """On an int4 target the drafter's matrices and its full-vocabulary head run on the int4
    kernel; strict verification keeps the reply bit for bit the target's."""
    from tests.native.tiny import make_gguf

    hf = make_hf_checkpoint(tmp_path / "llama", "llama", seed=41)
    target = TorchBackend(make_gguf(tmp_path / "t.gguf", hf, "Q4_1"), precision="int4", threads=2, context=256)
    drafter = drafter_for(target, make_dflash_checkpoint(tmp_path / "d", hf, block_size=4, head_dim=16, heads=4,
                                                         kv_heads=2, seed=42, target_layer_ids=(0, 1)))
    assert drafter.model.layers[0].mlp.gate_up.quantized and drafter.head.quantized
    spec = SpeculativeBackend(target, drafter, 3, strict=True)
    for sampling in SAMPLINGS[:2]:
        request = Request(messages=PROMPTS[1])
        ref = run_to_summary(fresh(target).stream(request, sampling))
        out = run_to_summary(fresh(spec).stream(request, sampling))
        assert out.token_ids == ref.token_ids and out.passes < len(out.token_ids) + 1
