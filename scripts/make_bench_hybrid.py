"""Write a small-but-not-trivial random hybrid checkpoint (Qwen3.5 layout: Gated DeltaNet layers with
a full-attention layer every 4th, transformers' own class) for measuring compiled against eager
decode passes (docs/results.md, "compiled decode graphs on a hybrid target"): 12 layers of width
256 (MLP 768; 8 query / 2 key-value heads of 32; 4 key / 8 value linear heads of 32, 4 conv taps),
the tests' small tokenizer, weights scaled as the tests' tiny checkpoints so that replies are not
one repeated token. ~10M parameters.

    python scripts/make_bench_hybrid.py runs/bench-hybrid
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' tokenizer writer

SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=12, num_attention_heads=8,
             num_key_value_heads=2, head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8,
             linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4, full_attention_interval=4,
             max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def main() -> None:
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    from tests.native.tiny import make_tokenizer

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/bench-hybrid")
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(out)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3_5TextConfig(vocab_size=len(tok), **SHAPE), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "linear_attn.norm" in name:  # the gated norm is applied as w
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "norm" in name:  # zero-centred: applied as 1 + w
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.3 if "embed" in name else 0.1))
    model.save_pretrained(str(out))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [2]}))
    print(out, sum(p.numel() for p in model.parameters()), "parameters")


if __name__ == "__main__":
    main()
