"""A checkpoint's shape, read from its own config (config.json or GGUF metadata), never from a
table of known models."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..base import BackendError

# the config.json keys the engine cannot do without, and what it builds from each
REQUIRED = {"vocab_size": "the embeddings and the output head", "hidden_size": "every layer's width",
            "num_hidden_layers": "the layer stack", "num_attention_heads": "the attention layers",
            "intermediate_size": "the MLP layers"}
COMPLETE = "is this a complete Hugging Face model directory? fix the file or download the model again"
# layer types (config.json `layer_types`) the engine runs; any other is refused by name
ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"
LAYER_TYPES = (ATTENTION, LINEAR_ATTENTION)
# attention over a row's last `sliding_window` keys (Gemma 3), read from GGUF metadata only so far
SLIDING_ATTENTION = "sliding_attention"
# model types whose norms are zero-centred (weight stored as w, applied as 1 + w) and whose attention
# has the sigmoid output gate: the Qwen3.5 / Qwen3-Next hybrids
GATED_HYBRIDS = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


@dataclass(frozen=True)
class LinearAttentionShape:
    """A Gated DeltaNet layer's shape (Qwen3.5 / Qwen3-Next `linear_*` keys)."""
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int
    # value heads in llama.cpp's order, [K0, K1, K0, K1, ...] (its converter's, for ggml's broadcast),
    # rather than Hugging Face's [K0, K0, K1, K1, ...]: a GGUF's tensors run in the order they are stored
    tiled: bool = False

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: q, k and v."""
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim

    @property
    def value_dim(self) -> int:
        return self.v_heads * self.v_dim


@dataclass
class ModelConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position: int = 4096
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    arch: str = "llama"
    rotary_dim: int = 0  # leading dims of a head that RoPE rotates (0: all of them); partial_rotary_factor
    output_gate: bool = False  # q_proj also yields a sigmoid gate on the attention output (gated attention)
    zero_centred: bool = False  # norms stored as w, applied as 1 + w (folded in at load)
    layer_types: tuple[str, ...] = ()  # per layer ATTENTION, LINEAR_ATTENTION or SLIDING_ATTENTION; (): attention
    linear: LinearAttentionShape | None = None  # the linear-attention layers' shape, if any
    moe: "MoeShape | None" = None  # the routed-expert MLPs' shape and placement, if any
    sliding_window: int = 0  # the keys a SLIDING_ATTENTION layer's row sees, its own included
    rope_local_theta: float = 0.0  # the sliding layers' RoPE base, never scaled (0: rope_theta)
    embed_scale: float = 1.0  # looked-up embedding rows times this (Gemma: sqrt(dim))
    query_scale: float = 0.0  # attention scores' scale (0: 1 / sqrt(head_dim))
    gelu: bool = False  # the MLP's gate through GELU's tanh form (Gemma), not SiLU
    logit_softcap: float = 0.0  # logits as cap * tanh(logits / cap), where above 0
    extra: dict = field(default_factory=dict)

    def is_sliding(self, layer: int) -> bool:
        """Whether layer `layer` attends over a sliding window of keys rather than all of them."""
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING_ATTENTION

    @property
    def compiles(self) -> bool:
        """Whether the engine builds compiled decode graphs for it: not yet where a row's experts
        depend on its values (an exported graph would run every expert) nor for sliding windows."""
        return self.moe is None and not self.sliding_window

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of routed experts rather than dense."""
        return self.moe is not None and layer in self.moe.sparse_layers

    def is_linear(self, layer: int) -> bool:
        """Whether layer `layer` is a (recurrent) linear-attention layer rather than attention."""
        return bool(self.layer_types) and self.layer_types[layer] == LINEAR_ATTENTION

    @property
    def hybrid(self) -> bool:
        return LINEAR_ATTENTION in self.layer_types

    @property
    def rotated(self) -> int:
        """How many leading dims of each head RoPE rotates."""
        return self.rotary_dim or self.head_dim

    @classmethod
    def from_hf(cls, c: dict, source: str = "config.json") -> "ModelConfig":
        """`source`: the file `c` came from, named in the BackendError for a key it lacks."""
        c = c.get("text_config", c)
        if not isinstance(c, dict):
            raise BackendError(f"{source}: `text_config` is not an object; {COMPLETE}")
        arch = c.get("model_type", "llama")
        if c.get("kv_lora_rank") or c.get("q_lora_rank"):
            raise BackendError(f"{source}: {arch} uses multi-head latent attention (`kv_lora_rank`), which the torch "
                               "engine does not run; use backend: llamacpp (a GGUF of it) or a server (backend: openai)")

        def count(key: str, default: int | None = None) -> int:
            return hf_count(c, key, source, default)

        moe = moe_shape(c, source)
        n_heads = count("num_attention_heads")
        head_dim = count("head_dim", 0) or count("hidden_size") // n_heads
        params = c.get("rope_parameters") or {}
        if not isinstance(params, dict):
            raise BackendError(f"{source}: `rope_parameters` is {json.dumps(params)}, not an object; {COMPLETE}")
        partial = hf_number(c if c.get("partial_rotary_factor") is not None else params, "partial_rotary_factor",
                            source, 0.25 if arch in GATED_HYBRIDS else 1.0, at_most=1.0)  # transformers' default
        return cls(
            vocab_size=count("vocab_size"), dim=count("hidden_size"), n_layers=count("num_hidden_layers"),
            n_heads=n_heads, n_kv_heads=count("num_key_value_heads", 0) or n_heads, head_dim=head_dim,
            # a model whose every MLP is routed experts (Qwen3.5-MoE) has no dense width
            ffn_dim=count("intermediate_size", 0 if moe and moe.all_sparse else None),
            norm_eps=hf_number(c, "rms_norm_eps", source, 1e-6),
            rope_theta=hf_number(c if c.get("rope_theta") is not None else params, "rope_theta", source, 10000.0),
            rope_scaling=_rope_scaling(c, source),
            max_position=count("max_position_embeddings", 4096),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=bool(c.get("attention_bias", arch in ("qwen2", "mimo"))),
            qk_norm=arch.startswith("qwen3") or bool(c.get("use_qk_norm")), arch=arch, moe=moe,
            rotary_dim=0 if partial >= 1.0 else int(head_dim * partial),
            output_gate=arch in GATED_HYBRIDS, zero_centred=arch in GATED_HYBRIDS, **_hybrid_layers(c, source))


def read_hf_json(path: Path) -> dict:
    """A model directory's config.json as a dict; one that is missing, unreadable or not a JSON
    object is a BackendError naming the file."""
    file = Path(path) / "config.json"
    try:
        c = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BackendError(f"{path}: no config.json; {COMPLETE}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise BackendError(f"{file}: could not be read ({type(e).__name__}: {e}); check the file") from None
    except json.JSONDecodeError as e:
        raise BackendError(f"{file} is not valid JSON ({e}); {COMPLETE}") from None
    if not isinstance(c, dict):
        raise BackendError(f"{file} holds a JSON {type(c).__name__}, not an object; {COMPLETE}")
    return c


def read_hf_config(path: Path) -> ModelConfig:
    """A model directory's shape, from its config.json."""
    return ModelConfig.from_hf(read_hf_json(path), source=str(Path(path) / "config.json"))


def hf_count(c: dict, key: str, source: str, default: int | None = None) -> int:
    """`c[key]` as a positive whole number; absent (or null), `default`, or a BackendError naming
    the file and the key when there is no default; any other value a BackendError."""
    value = c.get(key)
    if value is None and default is not None:
        return default
    why = f"the engine needs it to build {REQUIRED[key]}" if key in REQUIRED else "the engine reads it"
    if value is None:
        raise BackendError(f"{source} has no `{key}`: {why}; {COMPLETE}")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BackendError(f"{source}: `{key}` is {json.dumps(value)}, not a whole number of 1 or more: {why}; "
                           f"{COMPLETE}")
    return value


def hf_number(c: dict, key: str, source: str, default: float, at_most: float | None = None) -> float:
    """`c[key]` as a finite number above 0 (and at most `at_most`); absent (or null), `default`; a
    string, NaN, infinity, zero or a negative number is a BackendError naming the file and the key."""
    value = c.get(key)
    if value is None:
        return default
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0
            or (at_most is not None and value > at_most)):
        bound = f" and at most {at_most:g}" if at_most is not None else ""
        raise BackendError(f"{source}: `{key}` is {json.dumps(value)}, not a number above 0{bound}: the engine "
                           f"reads it; {COMPLETE}")
    return float(value)


def _hybrid_layers(c: dict, source: str) -> dict:
    """`layer_types` (or the `full_attention_interval` it is built from) and the linear layers'
    shape. A layer type the engine does not run is a BackendError naming it."""
    n = hf_count(c, "num_hidden_layers", source)
    types = c.get("layer_types")
    if types is None and c.get("model_type") in GATED_HYBRIDS:
        interval = hf_count(c, "full_attention_interval", source, 4)  # transformers' rule for these models
        types = [ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n)]
    if not types:
        return {}
    types = ["full_attention" if t == "attention" else t for t in types]
    unknown = sorted({str(t) for t in types} - set(LAYER_TYPES))
    if unknown or len(types) != n:
        what = (f"layer type '{unknown[0]}', which the torch engine does not run yet (it runs "
                f"{' and '.join(LAYER_TYPES)})" if unknown else f"{len(types)} entries for {n} layers")
        raise BackendError(f"{source}: `layer_types` has {what}; use backend: llamacpp or a server (backend: openai)")
    if LINEAR_ATTENTION not in types:
        return {"layer_types": tuple(types)}

    def count(key: str, default: int | None = None) -> int:
        return hf_count(c, key, source, default)

    linear = LinearAttentionShape(k_heads=count("linear_num_key_heads", 16), v_heads=count("linear_num_value_heads", 32),
                                  k_dim=count("linear_key_head_dim", 128), v_dim=count("linear_value_head_dim", 128),
                                  conv_kernel=count("linear_conv_kernel_dim", 4))
    if linear.v_heads % linear.k_heads:
        raise BackendError(f"{source}: linear_num_value_heads ({linear.v_heads}) is not a multiple of "
                           f"linear_num_key_heads ({linear.k_heads}); {COMPLETE}")
    return {"layer_types": tuple(types), "linear": linear}


# rope scaling kinds the engine computes (layers.rope_inv_freq) and the numbers each one reads
ROPE_SCALING_KEYS = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}


def _rope_scaling(c: dict, source: str = "config.json") -> dict | None:
    s = c.get("rope_scaling") or c.get("rope_parameters")
    if not s:
        return None
    if not isinstance(s, dict):
        raise BackendError(f"{source}: `rope_scaling` is {json.dumps(s)}, not an object; {COMPLETE}")
    kind = s.get("rope_type") or s.get("type")
    if kind in (None, "default"):
        return None
    if kind not in ROPE_SCALING_KEYS:
        raise BackendError(f"{source}: rope scaling '{kind}' is not supported by the torch engine (it runs "
                           f"{' and '.join(ROPE_SCALING_KEYS)}); use backend: llamacpp or a server (backend: openai)")
    for key in ROPE_SCALING_KEYS[kind]:
        if s.get(key) is None:
            raise BackendError(f"{source}: `rope_scaling` ({kind}) has no `{key}`; {COMPLETE}")
        hf_number(s, key, f"{source}: rope_scaling", 1.0)
    if kind == "llama3":
        hf_count(s, "original_max_position_embeddings", f"{source}: rope_scaling")
        if s["high_freq_factor"] <= s["low_freq_factor"]:
            raise BackendError(f"{source}: rope_scaling's high_freq_factor ({s['high_freq_factor']}) is not above "
                               f"its low_freq_factor ({s['low_freq_factor']}); {COMPLETE}")
    return dict(s, rope_type=kind)


# ---- mixture-of-experts MLPs ----

# config keys that count a model's routed experts, by family (GLM-4.5 / DeepSeek, Qwen, Mixtral)
EXPERT_COUNT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")
# model types whose router renormalises its top-k weights whatever the config says (no flag in transformers)
ALWAYS_RENORMALISED = ("qwen3_5_moe", "qwen3_5_moe_text")
# transformers' default for `norm_topk_prob` where a config leaves it out, per model type
NORM_TOPK_DEFAULT = {"qwen3_moe": False, "qwen3_next": True, "glm4_moe": True}
# model types that score experts with a sigmoid and a selection bias (GLM-4.5, DeepSeek-V3's noaux_tc)
SIGMOID_ROUTERS = ("glm4_moe", "deepseek_v3")


@dataclass(frozen=True)
class MoeShape:
    """Routed-expert MLPs (../shared/reference/hybrid-moe-eagle3.md, sections 1.7 and 3).

    Router: `scoring` "softmax" (Qwen: softmax over every expert, top-k, renormalised when
    `renormalise`) or "sigmoid" (GLM-4.5: sigmoid scores, chosen by score + a correction bias
    within the `topk_group` best of `n_group` groups, weighted by the unbiased scores, renormalised
    when `renormalise`); then every weight times `scaling`. Shared experts: an always-on MLP of
    `shared_dim` (0: none), behind a sigmoid gate when `shared_gate` (Qwen3-Next / Qwen3.5-MoE)."""
    experts: int
    top_k: int
    expert_dim: int
    sparse_layers: tuple[int, ...]
    scoring: str = "softmax"
    renormalise: bool = False
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0
    shared_dim: int = 0
    shared_gate: bool = False
    n_layers: int = 0

    @property
    def all_sparse(self) -> bool:
        return len(self.sparse_layers) == self.n_layers


def moe_shape(c: dict, source: str = "config.json") -> MoeShape | None:
    """The routed-expert MLPs a (text) config describes, or None for a dense model. Placement:
    layers from `first_k_dense_replace` on (GLM-4.5), every `decoder_sparse_step`-th outside
    `mlp_only_layers` (Qwen3-MoE / Qwen3-Next); every layer where a family has neither."""
    experts = next((c[k] for k in EXPERT_COUNT_KEYS if c.get(k)), 0)
    if not experts:
        return None
    arch = c.get("model_type", "")

    def count(key: str, default: int | None = None) -> int:
        return hf_count(c, key, source, default)

    n = count("num_hidden_layers")
    experts = count(next(k for k in EXPERT_COUNT_KEYS if c.get(k)))
    top_k = count("num_experts_per_tok")
    if top_k > experts:
        raise BackendError(f"{source}: `num_experts_per_tok` ({top_k}) is more than the {experts} experts; {COMPLETE}")
    first_dense = c.get("first_k_dense_replace") or 0
    step = count("decoder_sparse_step", 1)
    only_mlp = c.get("mlp_only_layers") or []
    if not isinstance(first_dense, int) or not isinstance(only_mlp, list):
        raise BackendError(f"{source}: `first_k_dense_replace` / `mlp_only_layers` is not a number / a list; "
                           f"{COMPLETE}")
    sparse = tuple(i for i in range(n) if i >= first_dense and (i + 1) % step == 0 and i not in only_mlp)
    if not sparse:
        return None
    scoring = c.get("scoring_func") or ("sigmoid" if arch in SIGMOID_ROUTERS else "softmax")
    if scoring not in ("softmax", "sigmoid"):
        raise BackendError(f"{source}: router scoring '{scoring}' is not one the torch engine runs (softmax, "
                           "sigmoid); use backend: llamacpp or a server (backend: openai)")
    n_group = count("n_group", 1)
    topk_group = count("topk_group", 1)
    if experts % n_group or topk_group > n_group:
        raise BackendError(f"{source}: {experts} experts do not split into `n_group` {n_group} groups of which "
                           f"`topk_group` {topk_group} are kept; {COMPLETE}")
    renormalise = arch in ALWAYS_RENORMALISED or bool(c.get("norm_topk_prob", NORM_TOPK_DEFAULT.get(arch, True)))
    shared_dim = c.get("shared_expert_intermediate_size") or 0
    if not shared_dim and c.get("n_shared_experts"):
        shared_dim = count("n_shared_experts") * count("moe_intermediate_size")
    return MoeShape(experts=experts, top_k=top_k, expert_dim=count("moe_intermediate_size"), sparse_layers=sparse,
                    scoring=scoring, renormalise=renormalise, n_group=n_group, topk_group=topk_group,
                    scaling=hf_number(c, "routed_scaling_factor", source, 1.0), shared_dim=int(shared_dim),
                    shared_gate=arch in ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "qwen2_moe"), n_layers=n)
