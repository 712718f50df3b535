"""Mixture-of-experts targets (Qwen3-MoE, GLM-4.5, Qwen3.5-MoE, Qwen3-Next) in the torch engine,
against transformers' own classes; verify blocks that are exact and read each expert once."""
import json

import pytest
import torch

from specchat.backends.base import BackendError, Request, Sampling, run_to_summary
from specchat.backends.native.engine import TorchBackend
from specchat.backends.native.moe import RoutedExperts, Router
from tests.native.tiny import assert_reply_and_logits_match
from tests.native.tiny_moe import MOE_FAMILIES, fuse_experts, make_moe_checkpoint, moe_config

# float32 engine vs transformers' float32 forward: the same math, summed in other orders. On an AMX
# Xeon one prefill row of the qwen3_5_moe checkpoint parts by up to 1.8e-4 (21 of its 320 logits
# past 1e-4; every decode row within 4e-5): summation order, not a wrong expert.
ATOL = 3e-4


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    seeds = {"qwen3_moe": 31, "glm4_moe": 32, "qwen3_5_moe": 33, "qwen3_next": 35}  # replies of 10+ tokens
    return {family: make_moe_checkpoint(root / family, family, seed=seeds[family]) for family in MOE_FAMILIES}


def engine(path, precision="float32", context=256) -> TorchBackend:
    return TorchBackend(path, "hf_dir", precision=precision, threads=2, context=context)


def random_ids(n, seed=0):
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_greedy_reply_and_its_logits_equal_transformers(moe_dirs, family):
    """A whole greedy reply streamed by the engine is transformers' greedy reply, and every logit of
    it (prefill, then one-token decode) is transformers' within ATOL."""
    from transformers import AutoModelForCausalLM

    path = moe_dirs[family]
    ref, e = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval(), engine(path)
    assert e.model.cfg.moe is not None
    assert_reply_and_logits_match(e, ref, max_tokens=32, atol=ATOL)


def test_fused_expert_layout_is_the_same_model(moe_dirs, tmp_path):
    """`experts.gate_up_proj` / `experts.down_proj` stacks (transformers' in-memory layout, shipped
    by some checkpoints) load to the same weights as per-expert tensors."""
    ids = random_ids(24)
    for family in ("qwen3_5_moe", "glm4_moe"):
        fused = fuse_experts(moe_dirs[family], tmp_path / family)
        assert torch.equal(engine(fused).forward(ids, 0)[0], engine(moe_dirs[family]).forward(ids, 0)[0])


def test_sharded_checkpoint_is_the_same_model(moe_dirs, tmp_path):
    """Experts spread over several safetensors shards (model.safetensors.index.json), as published."""
    import shutil

    from transformers import AutoModelForCausalLM

    src = moe_dirs["glm4_moe"]
    sharded = shutil.copytree(src, tmp_path / "sharded", ignore=shutil.ignore_patterns("*.safetensors"))
    AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).save_pretrained(str(sharded),
                                                                                        max_shard_size="200KB")
    assert len(list(sharded.glob("*.safetensors"))) > 2 and (sharded / "model.safetensors.index.json").exists()
    ids = random_ids(24)
    assert torch.equal(engine(sharded).forward(ids, 0)[0], engine(src).forward(ids, 0)[0])


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe", "qwen3_5_moe"])
@pytest.mark.parametrize("precision", ["bfloat16", "int4"])
def test_verify_block_rows_are_one_token_passes_bitwise(moe_dirs, family, precision):
    """Row-exact blocks of 2..8 rows: every row's final state is bitwise the one-token pass's,
    though the block runs each chosen expert once on all the rows that chose it."""
    e, blocks = engine(moe_dirs[family], precision), engine(moe_dirs[family], precision)
    assert e.row_exact_supported
    ids = random_ids(40, seed=3)
    e.forward(ids[:20], 0)
    blocks.forward(ids[:20], 0)
    singles = torch.cat([e.forward([t], 20 + i, head=False)[0] for i, t in enumerate(ids[20:28])])
    for k in (2, 5, 8):
        block, _ = blocks.forward(ids[20:20 + k], 20, row_exact=True, head=False)
        blocks.truncate(20)  # a hybrid's state returns to the start of its last pass
        assert torch.equal(block, singles[:k]), k


def test_int4_quantizes_the_experts(moe_dirs):
    e = engine(moe_dirs["qwen3_moe"], "int4")
    layer = e.model.layers[1].mlp
    assert isinstance(layer, RoutedExperts)
    assert all(lin.quantized for lin in layer.expert_linears())
    reply = run_to_summary(e.stream(Request(messages=[{"role": "user", "content": "hello"}]), Sampling(max_tokens=8)))
    assert len(reply.token_ids) == 8


def test_a_pass_runs_only_the_chosen_experts_each_once(moe_dirs, monkeypatch):
    """One token: top_k experts per sparse layer. A block: each expert its rows chose, once."""
    e = engine(moe_dirs["glm4_moe"], "bfloat16")
    calls = []
    for i, layer in enumerate(e.model.layers):
        if isinstance(layer.mlp, RoutedExperts):
            for j, expert in enumerate(layer.mlp.experts):
                expert.register_forward_hook(lambda m, args, out, key=(i, j): calls.append((key, args[0].shape[0])))
    ids = random_ids(30, seed=5)
    e.forward(ids[:20], 0)
    calls.clear()
    e.forward([ids[20]], 20)
    top_k, sparse = e.model.cfg.moe.top_k, e.model.cfg.moe.sparse_layers
    assert len(calls) == top_k * len(sparse) and all(rows == 1 for _, rows in calls)
    calls.clear()
    chosen = {}
    for layer in sparse:  # which experts each row of the block chooses, layer by layer
        e.model.layers[layer].mlp.router.register_forward_hook(
            lambda m, args, out, layer=layer: chosen.__setitem__(layer, out[1]))
    e.forward(ids[21:27], 21, row_exact=True)
    for layer in sparse:
        per_row = chosen[layer]
        want = {int(x): int((per_row == x).any(dim=1).sum()) for x in per_row.unique()}
        got = {j: rows for (i, j), rows in calls if i == layer}
        assert got == want  # each chosen expert once, on every row that chose it


def test_routers_choose_and_weigh_as_transformers():
    """Qwen's softmax router (renormalised or not) and GLM-4.5's grouped sigmoid router with its
    correction bias and scaling, against transformers' own router modules on random rows."""
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from specchat.backends.native.config import moe_shape

    torch.manual_seed(0)
    h = torch.randn(37, 64)
    cases = [(Qwen3MoeTopKRouter, moe_config("qwen3_moe", 320)), (Glm4MoeTopkRouter, moe_config("glm4_moe", 320))]
    renormalised = moe_config("qwen3_moe", 320)
    renormalised.norm_topk_prob = True
    cases.append((Qwen3MoeTopKRouter, renormalised))
    for cls, cfg in cases:
        theirs = cls(cfg)
        with torch.no_grad():
            theirs.weight.copy_(torch.randn_like(theirs.weight))
            if hasattr(theirs, "e_score_correction_bias"):
                theirs.e_score_correction_bias.copy_(0.3 * torch.rand_like(theirs.e_score_correction_bias))
            _, want_w, want_e = theirs(h)
        shape = moe_shape(cfg.to_dict())
        ours = Router(shape, theirs.weight.detach(), getattr(theirs, "e_score_correction_bias", None))
        got_w, got_e, _ = ours(h)
        # the same experts with the same weights (transformers' GLM router lists them unsorted)
        got_order, want_order = got_e.argsort(dim=1), want_e.argsort(dim=1)
        assert torch.equal(got_e.gather(1, got_order), want_e.gather(1, want_order)), cls.__name__
        assert (got_w.gather(1, got_order) - want_w.gather(1, want_order)).abs().max() < 1e-6, cls.__name__


def test_unknown_expert_layout_and_latent_attention_are_one_line(moe_dirs, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    src = moe_dirs["qwen3_moe"]
    odd = shutil.copytree(src, tmp_path / "odd")
    tensors = load_file(str(src / "model.safetensors"))
    renamed = {k.replace("experts.0.gate_proj", "experts.0.w1"): v for k, v in tensors.items()}
    save_file(renamed, str(odd / "model.safetensors"))
    with pytest.raises(BackendError, match=r"layer 1 has its experts in a layout the torch engine does not know "
                                           r"\(model.layers.1.mlp.experts.0.w1.weight\)"):
        engine(odd)
    cfg = json.loads((src / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps(cfg | {"kv_lora_rank": 512, "model_type": "deepseek_v3"}))
    with pytest.raises(BackendError, match="deepseek_v3 uses multi-head latent attention"):
        engine(odd)
    (odd / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "num_local_experts"}))
    with pytest.raises(BackendError, match="layer 1 has a mixture-of-experts MLP .* config.json names no experts"):
        engine(odd)


def test_a_qwen3_5_moe_checkpoint_needs_no_dense_width(moe_dirs):
    """Qwen3.5-MoE's config has no `intermediate_size` (every MLP is experts): it loads, where a
    dense model without it is still refused by name."""
    cfg = json.loads((moe_dirs["qwen3_5_moe"] / "config.json").read_text())
    assert "intermediate_size" not in cfg
    assert engine(moe_dirs["qwen3_5_moe"]).model.cfg.moe.all_sparse


def test_compile_is_refused_on_a_moe_target_with_one_line(moe_dirs):
    with pytest.raises(BackendError, match="mixture-of-experts model, whose compiled decode graphs .* compile: false"):
        TorchBackend(moe_dirs["qwen3_moe"], "hf_dir", precision="bfloat16", threads=2, context=64, compile=True)


def test_the_row_invariance_probe_covers_the_experts(moe_dirs, monkeypatch):
    """Strict verification is offered only where the experts' matmuls keep row bits too: a CPU
    whose expert kernel rounds a row by its neighbours turns it off (and `verify` says strict: false)."""
    e = engine(moe_dirs["qwen3_moe"], "bfloat16")
    probed = []
    import specchat.backends.native.exact_rows as exact_rows

    monkeypatch.setattr(exact_rows, "_ROWS_PROBED", type(exact_rows._ROWS_PROBED)())
    real = exact_rows.matmuls_keep_row_bits
    monkeypatch.setattr(exact_rows, "matmuls_keep_row_bits", lambda linears, dtype: probed.extend(linears) or real(
        linears, dtype))
    assert e.row_exact_supported
    assert set(map(id, e.model.layers[1].mlp.expert_linears())) <= set(map(id, probed))
