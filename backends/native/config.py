"""A checkpoint's shape, read from its own config (config.json or GGUF metadata), never from a
table of known models."""
from __future__ import annotations

from dataclasses import dataclass, field


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
    extra: dict = field(default_factory=dict)

    @property
    def rotated(self) -> int:
        """How many leading dims of each head RoPE rotates."""
        return self.rotary_dim or self.head_dim

    @classmethod
    def from_hf(cls, c: dict) -> "ModelConfig":
        c = c.get("text_config", c)
        arch = c.get("model_type", "llama")
        n_heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // n_heads
        partial = float(c.get("partial_rotary_factor") or (c.get("rope_parameters") or {}).get("partial_rotary_factor")
                        or 1.0)
        return cls(
            vocab_size=c["vocab_size"], dim=c["hidden_size"], n_layers=c["num_hidden_layers"],
            n_heads=n_heads, n_kv_heads=c.get("num_key_value_heads") or n_heads, head_dim=head_dim,
            ffn_dim=c["intermediate_size"], norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(c), rope_scaling=_rope_scaling(c),
            max_position=c.get("max_position_embeddings", 4096),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=bool(c.get("attention_bias", arch in ("qwen2", "mimo"))),
            qk_norm=arch.startswith("qwen3"), arch=arch,
            rotary_dim=0 if partial >= 1.0 else int(head_dim * partial))


def _rope_theta(c: dict) -> float:
    params = c.get("rope_parameters") or {}
    return float(c.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(c: dict) -> dict | None:
    s = c.get("rope_scaling") or c.get("rope_parameters")
    if not s:
        return None
    kind = s.get("rope_type") or s.get("type")
    return None if kind in (None, "default") else dict(s, rope_type=kind)
