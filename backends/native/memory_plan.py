"""What the torch engine holds for a safetensors checkpoint loaded with `dtype: int4`, and for a
GGUF on specchat's kernels (`gguf_bytes`, at the end): the plan from tensor names and shapes alone
(specchat/weight_memory.py's estimate, before anything is loaded; torch is not imported here), and
the count of what a built model holds, to check the plan by.

The rule (weights.load_hf_dir, build_model): every decoder-layer matrix the 4-bit kernels take
(`Int4Rows.fits`: input a multiple of 32, output of 8) is quantized: attention, dense and shared-
expert MLPs, routed experts, linear-attention projections. Both kernels hold 4 bits a weight and
a 16-bit scale and offset a group of 32: 0.625 bytes a weight. The attention layers' attention
and dense MLP matrices also keep a bfloat16 copy for prefill when all of those copies together
take at most DENSE_COPY_MAX_BYTES. Routers, norms and biases stay float32. The LM head stays
float32 (exact logits, rows multiplied in pairs) with the int8 copy argmax_head.py chooses by;
an untied embedding is held in bfloat16 (its rows are widened when looked up, and the published
checkpoints store it so); a tied one is the head, float32.
"""
from __future__ import annotations

import math
import re

# Most memory a bfloat16 copy of an int4 model's layer matrices may take (4x their int4 size) to
# speed up prefill; larger models prefill on the int4 kernel.
DENSE_COPY_MAX_BYTES = 1 << 30

# A head whose float32 copy would take more than this runs on specchat's kernels in the file's own
# type, its embedding read from the same tiles (weights.py): for a big vocabulary the float32 head
# (4 bytes a weight, and its int8 copy) would outweigh the layers' blocks. Smaller heads keep float32
# logits, whose argmax argmax_head.py finds exactly (the default model's: 113 MB).
HEAD_FLOAT_MAX_BYTES = 128 << 20

# Bytes a weight of the kernels' tiles (kernels/q4.h, kquant.h: a 16-column tile of 32 inputs, or a
# K-quant super-block's share; f16.h: the file's 16-bit values) by GGUF type.
TILE_BYTES = {"Q4_0": 320 / 512, "Q4_1": 320 / 512, "Q8_0": 544 / 512, "Q4_K": 2368 / 4096, "Q5_K": 2880 / 4096,
              "Q6_K": 3360 / 4096, "Q5_0": 352 / 512, "Q5_1": 384 / 512, "IQ4_NL": 288 / 512, "IQ4_XS": 2208 / 4096,
              "F16": 2.0, "BF16": 2.0}
# inputs a tile row must come in whole multiples of (a block of the type; 32 for the 16-bit types' tiles)
BLOCK_INPUTS = {"Q4_0": 32, "Q4_1": 32, "Q8_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "Q5_0": 32, "Q5_1": 32,
                "IQ4_NL": 32, "IQ4_XS": 256, "F16": 32, "BF16": 32}
Q4_TYPES = ("Q4_0", "Q4_1")  # Int4Rows on the 4-bit kernel: the bfloat16 copy, never the head's tiles
# a layer's matrices, routed experts' stacks ([experts, rows, inputs]) included
GGUF_MATRICES = re.compile(r"blk\.\d+\.(?:attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)(?:_exps)?\.weight")

INT4_BYTES = 0.625  # a weight: 4 bits, plus a 16-bit scale and offset per 32 (q4_kernel.pack, torch's pack)
HEAD_ROW_BYTES = 14  # the argmax head's per-token scale (bfloat16 and float32) and two float32 norms

LAYER = re.compile(r"model\.(?:language_model\.)?layers\.(\d+)\.(.+)")
EXPERT = re.compile(r"mlp\.experts\.(?:\d+\.(?:gate|up|down)_proj\.weight|gate_up_proj|down_proj)")
QUANTIZED = re.compile(r"self_attn\.[qkvo]_proj\.weight|mlp\.(?:shared_experts?\.)?(?:gate|up|down)_proj\.weight"
                       r"|linear_attn\.(?:in_proj_\w+|out_proj)\.weight")
COPIED = re.compile(r"self_attn\.[qkvo]_proj\.weight|mlp\.(?:gate|up|down)_proj\.weight")
NOT_LOADED = ("mtp.", "model.mtp_layers.", "model.visual.", "visual.")  # read by an MTP profile, or not at all


def fits(rows: int, inputs: int) -> bool:
    """int4.Int4Rows.fits, on a shape."""
    return inputs % 32 == 0 and rows % 8 == 0


def int4_dir_bytes(shapes: dict[str, tuple[int, ...]], config: dict) -> int | None:
    """Bytes of the weights a decoder checkpoint (tensor name -> shape; its config.json) is held in
    after a `dtype: int4` load on CPU; the KV cache and activations come on top. None for other
    layouts (a drafter head's own: eagle3.py, mtp.py)."""
    if not any(n.endswith("embed_tokens.weight") and n.startswith("model.") for n in shapes):
        return None
    text = config.get("text_config", config)  # as config.ModelConfig.from_hf reads it
    text = text if isinstance(text, dict) else {}
    try:  # layers past it are an MTP head's (weights.is_mtp_tensor); without it, all are counted
        n_layers = int(text["num_hidden_layers"])
    except (KeyError, TypeError, ValueError):
        n_layers = 1 << 30
    tied = bool(text.get("tie_word_embeddings", False)) or "lm_head.weight" not in shapes
    layer = {n: m for n in shapes if (m := LAYER.fullmatch(n))}
    linear = {m.group(1) for m in layer.values() if m.group(2).startswith("linear_attn.")}
    # a linear-attention layer's input projections run as one matmul: 4-bit only if each part fits
    dense_in = {m.group(1) for n, m in layer.items() if m.group(2).startswith("linear_attn.in_proj_")
                and not fits(*shapes[n][-2:])}
    total = copies = 0.0
    for name, shape in shapes.items():
        m = layer.get(name)
        if name.startswith(NOT_LOADED) or (m and int(m.group(1)) >= n_layers):
            continue
        n = math.prod(shape)
        if m and (EXPERT.fullmatch(m.group(2)) or QUANTIZED.fullmatch(m.group(2))) and len(shape) >= 2:
            if not fits(*shape[-2:]) or (m.group(1) in dense_in and m.group(2).startswith("linear_attn.in_proj_")):
                total += 2 * n  # bfloat16
                continue
            total += INT4_BYTES * n
            if COPIED.fullmatch(m.group(2)) and m.group(1) not in linear:
                copies += 2 * n
        elif m and name.endswith("_proj.bias"):
            total += 2 * n  # in the compute dtype
        elif name == "lm_head.weight":
            total += 0 if tied else head_bytes(shape)
        elif name.endswith("embed_tokens.weight"):
            total += head_bytes(shape) if tied else 2 * n
        else:
            total += 4 * n  # norms, routers, biases: float32
    return int(total + (copies if copies <= DENSE_COPY_MAX_BYTES else 0))


def tiles_fit(qtype: str, rows: int, inputs: int) -> bool:
    """Whether a matrix [rows, inputs] of this GGUF type runs on the kernels' tiles."""
    return qtype in TILE_BYTES and rows % 16 == 0 and inputs % BLOCK_INPUTS[qtype] == 0


def gguf_bytes(tensors: dict[str, tuple[str, tuple[int, ...]]]) -> int:
    """Bytes of the weights a GGUF (tensor name -> (type name, shape in GGUF order)) is held in by a
    CPU load on the kernels (gguf_loader.py, weights.build_model): layer matrices of a type the
    tiles take as tiles, Q4 ones also with a bfloat16 copy while all copies stay under
    DENSE_COPY_MAX_BYTES, other matrices as bfloat16; the head (and a tied embedding) as tiles
    past HEAD_FLOAT_MAX_BYTES, else float32 with the int8 copy; norms float32."""
    total = copies = 0.0
    for name, (qtype, shape) in tensors.items():
        # GGUF lists the innermost dimension first; a stack of experts' matrices the experts last
        n, rows, inputs = math.prod(shape), shape[1] if len(shape) > 1 else 1, shape[0]
        if GGUF_MATRICES.fullmatch(name):
            if tiles_fit(qtype, rows, inputs):
                total += TILE_BYTES[qtype] * n
                copies += 2 * n if qtype in Q4_TYPES else 0
            else:
                total += 2 * n
        elif name not in ("token_embd.weight", "output.weight"):
            total += 4 * n
    embed, head = tensors.get("token_embd.weight"), tensors.get("output.weight")
    source = head or embed
    if source is not None:
        qtype, shape = source
        rows, inputs = shape[-1], shape[0]
        big = 4 * rows * inputs > HEAD_FLOAT_MAX_BYTES or qtype in ("F16", "BF16")  # kquant.head_on_tiles
        if big and qtype not in Q4_TYPES and tiles_fit(qtype, rows, inputs):
            total += TILE_BYTES[qtype] * rows * inputs
            if head is not None and embed is not None:  # an untied embedding: its own tiles, else float32
                e_type, e_shape = embed
                fit = e_type not in Q4_TYPES and tiles_fit(e_type, e_shape[-1], e_shape[0])
                total += (TILE_BYTES[e_type] if fit else 4) * math.prod(e_shape)
        else:
            total += head_bytes((rows, inputs)) + (4 * math.prod(embed[1]) if head is not None and embed else 0)
    return int(total + (copies if copies <= DENSE_COPY_MAX_BYTES else 0))


def float_activations(tensors: dict[str, tuple[str, tuple[int, ...]]]) -> bool:
    """Whether a GGUF's layer matrices on the kernels are all F16 / BF16, so that the engine computes
    in float32, its KV cache too (kquant.activation_dtype's rule, on the file's tensor index)."""
    kinds = {qtype for name, (qtype, shape) in tensors.items()
             if GGUF_MATRICES.fullmatch(name) and tiles_fit(qtype, shape[1] if len(shape) > 1 else 1, shape[0])}
    return bool(kinds) and kinds <= {"F16", "BF16"}


def kv_cache_bytes(layers: int, kv_heads: int, head_dim: int, context: int, element: int) -> int:
    """Keys and values of every attention layer at `context` positions (model.KVCache: one more)."""
    return 2 * layers * kv_heads * head_dim * (context + 1) * element


def head_bytes(shape: tuple[int, ...]) -> int:
    """A float32 LM head [vocab, dim] with its int8 copy for argmax choices."""
    return 5 * math.prod(shape) + HEAD_ROW_BYTES * shape[0]


def return_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing):
    a load's temporaries (float32 matrices, their 4-bit forms before packing) are freed, but glibc
    keeps such pages mapped, about 0.1 GB a Qwen3-30B-A3B layer (docs/results.md)."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)  # the process's own symbols, the C library's among them
    except (OSError, AttributeError):  # not glibc
        pass


MADV_PAGEOUT = 21  # Linux 5.4+: reclaim these pages now; a file's clean pages are read again if touched


def page_out(buffers) -> None:
    """Ask the kernel to reclaim the pages under these buffers (objects with data_ptr() and nbytes, a
    GGUF's blocks mapped from the file, once packed into tiles), so that a load's resident memory
    stays near what it keeps rather than that plus the file. Never destructive (not DONTNEED): a
    buffer still in use is read back; where the call is not known, nothing happens."""
    import ctypes
    import mmap

    try:
        madvise = ctypes.CDLL(None).madvise
    except (OSError, AttributeError):
        return
    for b in buffers:
        start = b.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
        end = b.data_ptr() + b.nbytes
        if end > start:
            madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_PAGEOUT)


def held_bytes(model) -> dict[str, int]:
    """Bytes of the distinct tensors a built `Transformer` holds, by part: `layers` (their weights,
    int4 packs and dense copies), `embed`, `head` (with the argmax head's int8 copy), `other`
    (final norm, RoPE tables), and `cache` (the KV cache, allocated for the whole context)."""
    seen: set[int] = set()

    def count(objects) -> int:
        total = 0
        for obj in objects:
            for t in _tensors(obj):
                key = t.untyped_storage().data_ptr()
                if key not in seen and t.numel():
                    seen.add(key)
                    total += t.untyped_storage().nbytes()
        return total

    parts = {"cache": count([model.cache])}
    parts["embed"] = count([model.embed])
    parts["head"] = count([model.head, getattr(model, "argmax_head", None)])
    parts["layers"] = count(model.layers.modules())
    parts["other"] = count([model] + [m for m in model.modules() if m is not model])
    return parts


def _tensors(obj):
    """The tensors an object holds as attributes (a module's parameters and buffers among them),
    and those in its tuples and lists (a Linear's int4 pack, a cache's layers)."""
    import torch

    if obj is None:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    values = list(vars(obj).values())
    values += list(getattr(obj, "_parameters", {}).values()) + list(getattr(obj, "_buffers", {}).values())
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (tuple, list)):
            yield from (t for t in v if isinstance(t, torch.Tensor))
