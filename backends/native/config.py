"""A checkpoint's shape, read from its own config (config.json or GGUF metadata), never from a
table of known models."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..base import BackendError

# the config.json keys the engine cannot do without, and what it builds from each
REQUIRED = {"vocab_size": "the embeddings and the output head", "hidden_size": "every layer's width",
            "num_hidden_layers": "the layer stack", "num_attention_heads": "the attention layers",
            "intermediate_size": "the MLP layers"}
COMPLETE = "is this a complete Hugging Face model directory? fix the file or download the model again"


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
    def from_hf(cls, c: dict, source: str = "config.json") -> "ModelConfig":
        """`source`: the file `c` came from, named in the BackendError for a key it lacks."""
        c = c.get("text_config", c)
        if not isinstance(c, dict):
            raise BackendError(f"{source}: `text_config` is not an object; {COMPLETE}")
        arch = c.get("model_type", "llama")

        def count(key: str, default: int | None = None) -> int:
            return hf_count(c, key, source, default)

        n_heads = count("num_attention_heads")
        head_dim = count("head_dim", 0) or count("hidden_size") // n_heads
        partial = float(c.get("partial_rotary_factor") or (c.get("rope_parameters") or {}).get("partial_rotary_factor")
                        or 1.0)
        return cls(
            vocab_size=count("vocab_size"), dim=count("hidden_size"), n_layers=count("num_hidden_layers"),
            n_heads=n_heads, n_kv_heads=count("num_key_value_heads", 0) or n_heads, head_dim=head_dim,
            ffn_dim=count("intermediate_size"), norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(c), rope_scaling=_rope_scaling(c),
            max_position=count("max_position_embeddings", 4096),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=bool(c.get("attention_bias", arch in ("qwen2", "mimo"))),
            qk_norm=arch.startswith("qwen3"), arch=arch,
            rotary_dim=0 if partial >= 1.0 else int(head_dim * partial))


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


def _rope_theta(c: dict) -> float:
    params = c.get("rope_parameters") or {}
    return float(c.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(c: dict) -> dict | None:
    s = c.get("rope_scaling") or c.get("rope_parameters")
    if not s:
        return None
    kind = s.get("rope_type") or s.get("type")
    return None if kind in (None, "default") else dict(s, rope_type=kind)
