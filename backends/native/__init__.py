"""specchat's native PyTorch engine (Llama family: SmolLM2, Llama 3.x, Qwen2/2.5, Qwen3).

    model.py        ModelConfig, Transformer (forward over K tokens at absolute positions), KVCache
    weights.py      Checkpoint, Hugging Face safetensors loader, build_model (fused qkv / gate-up)
    gguf_loader.py  GGUF -> Checkpoint (dequantized, or Q4 blocks kept for torch's int4 kernel)
    tokenizer.py    ChatTokenizer: the model's own tokenizer and chat template via transformers
    sampling.py     greedy and position-keyed Gumbel-max sampling; probs() for rejection sampling
    engine.py       TorchBackend: the streaming Backend plus the API a speculative loop uses

The speculative loop drives a `TorchBackend` through: forward(tokens, start_pos, hidden_layers,
all_logits, exact_rows), cache_len, cached, truncate(n), sample(logits, positions, sampling),
probs(logits, sampling), prefill(ids), prefill_with_hidden(ids, hidden_layers), eos_ids,
context_length, rows_bitwise, model (embed, head, cfg), tokenizer.

Position convention: logits row i of forward(tokens, start) predicts the token at absolute
position start + i + 1, and sample() keys its noise by that position.
"""
