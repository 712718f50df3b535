"""The native PyTorch engine (Llama family: SmolLM2, Llama 3.x, Qwen2/2.5, Qwen3).

    config.py       ModelConfig: a checkpoint's shape, from its own config
    layers.py       the transformer, written once: RMSNorm, RoPE, Attention, GatedMLP, DecoderLayer
    linear.py       Linear: dense, int4 (with a dense copy for prefill) or float32 in row pairs
    matrix.py       a checkpoint's matrices (floats, Int4Rows, GGUF blocks) as one Linear on the right kernel
    int4.py         Int4Rows (GGUF Q4 blocks) and torch's CPU int4 kernel
    model.py        Transformer: forward over K tokens at absolute positions, with its KV cache
    exact_rows.py   row-exact passes on CPU: verify rows with the bits of single-token passes
    weights.py      Checkpoint, the Hugging Face loader and name map, build_model
    gguf_loader.py  GGUF -> Checkpoint (llama, qwen2, qwen3, qwen3moe, gemma3; blocks kept for the kernels)
    memory_plan.py  what a dtype: int4 load of a checkpoint directory holds (planned and counted)
    tokenizer.py    ChatTokenizer: the model's own tokenizer and chat template (the `tokenizers` library,
                    or transformers where only it reads the folder exactly)
    chat_template.py  chat templates rendered as transformers renders them, without importing it
    sampling.py     greedy and position-keyed Gumbel-max sampling; probs() for rejection sampling
    argmax_head.py  the float32 head's argmax choice at an int8 head's cost
    mtp.py          MTP / nextn heads: reading the public layouts, and the head itself
    eagle3.py       EAGLE-3 heads: reading the four public formats, and the head itself
    draft_vocab.py  VocabHead: a head's output over a draft vocabulary, mapped to target ids
    engine.py       TorchBackend: the streaming Backend plus what the speculative loop uses
    shared_weights.py  SharedWeights: a second run on an engine's weights, with a KV cache of its own

Position convention: logits row i of forward(tokens, start) predicts the token at absolute
position start + i + 1, and sample() keys its noise by that position.
"""
