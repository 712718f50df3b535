"""A GGUF with a real model's shapes and random weights, quantized by llama.cpp's own quantizer: for
measuring the speed and memory of specchat's engine against llama.cpp at real sizes without
downloading real weights. The weights are random (normal(0, 0.02) matrices, unit norms), so every
reply is noise; only speed and memory mean anything.

    python scripts/shaped_gguf.py --shape smollm2-1.7b --types Q4_0,Q4_K_M,Q6_K,Q8_0 --out /work/shaped

writes DIR/{shape}-{type}.gguf per type ({shape}-L{N}-{type}.gguf with `--layers N`) and
prints one line per file: its path, its size and how many tensors llama.cpp stored in each ggml
type. The tokenizer is the default model's (SmolLM2-135M-Instruct, fetched once into specchat's
cache like `specchat pull`), so prompts tokenize as they do for the default model. A random F16
GGUF is written first, tensor by tensor (a 7B needs ~1 GB of memory, not 15), quantized with
llama_cpp.llama_model_quantize once per type, and deleted at the end unless `--keep-f16`. A
re-run skips an output that already holds the same shape, layer count and seed (recorded in its
metadata under `specchat.shaped.source`).
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

PROG = "shaped_gguf"
SOURCE_KEY = "specchat.shaped.source"  # JSON of the shape, layer count and seed a file was made from
STAMP_VERSION = 1  # bump when the weights a given (shape, seed) produces change


@dataclass(frozen=True)
class Shape:
    arch: str  # llama.cpp's general.architecture
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int | None  # None: the tokenizer's own size
    tied: bool  # output projection shares token_embd (no output.weight tensor)
    rope_theta: float
    rms_eps: float
    context: int
    head_dim: int | None = None  # None: dim // heads
    qkv_bias: bool = False

    @property
    def hd(self) -> int:
        return self.head_dim or self.dim // self.heads


SHAPES: dict[str, Shape] = {
    # a few MB, for tests and quick checks of the pipeline
    "tiny": Shape("llama", dim=256, layers=2, heads=4, kv_heads=2, ffn=512, vocab=None, tied=True,
                  rope_theta=10000.0, rms_eps=1e-5, context=2048),
    # HuggingFaceTB/SmolLM2-1.7B-Instruct, config.json
    "smollm2-1.7b": Shape("llama", dim=2048, layers=24, heads=32, kv_heads=32, ffn=8192, vocab=49152, tied=True,
                          rope_theta=130000.0, rms_eps=1e-5, context=8192, head_dim=64),
    # meta-llama/Llama-3.2-3B-Instruct, config.json (its llama3 rope scaling, rope_freqs.weight, is left out:
    # it changes no cost)
    "llama-3.2-3b": Shape("llama", dim=3072, layers=28, heads=24, kv_heads=8, ffn=8192, vocab=128256, tied=True,
                          rope_theta=500000.0, rms_eps=1e-5, context=131072, head_dim=128),
    # Qwen/Qwen2.5-7B-Instruct, config.json
    "qwen2.5-7b": Shape("qwen2", dim=3584, layers=28, heads=28, kv_heads=4, ffn=18944, vocab=152064, tied=False,
                        rope_theta=1000000.0, rms_eps=1e-6, context=32768, head_dim=128, qkv_bias=True),
}

# llama.cpp's file types (the LLAMA_FTYPE_MOSTLY_* constants of llama_cpp) by the names people use
FTYPES: dict[str, str] = {
    "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
    "Q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1",
    "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
    "Q4_K_S": "LLAMA_FTYPE_MOSTLY_Q4_K_S",
    "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
    "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K",
    "IQ4_XS": "LLAMA_FTYPE_MOSTLY_IQ4_XS",
    "IQ4_NL": "LLAMA_FTYPE_MOSTLY_IQ4_NL",
    "F16": "LLAMA_FTYPE_MOSTLY_F16",
    "BF16": "LLAMA_FTYPE_MOSTLY_BF16",
}
# rough bits per weight of each output, for the disk-space check only (K mixes round up)
BITS = {"Q4_0": 4.5, "Q4_1": 5.0, "Q8_0": 8.5, "Q4_K_S": 4.7, "Q4_K_M": 5.0, "Q5_K_M": 5.8, "Q6_K": 6.6,
        "IQ4_XS": 4.4, "IQ4_NL": 4.6, "F16": 16.0, "BF16": 16.0}
F16_FILE_TYPE = 1  # LLAMA_FTYPE_MOSTLY_F16, general.file_type of the source
TOKENIZER_VOCAB = 49152  # the default model's tokenizer (SmolLM2); for the disk estimate before it is read
CHUNK = 1 << 24  # elements generated at a time (64 MB of float32)


class Refused(Exception):
    """Bad input or an unusable environment: one line on stderr, exit 2."""


# ---------------------------------------------------------------------------------------------- shapes


def shape_of(name: str, layers: int | None = None) -> Shape:
    if name not in SHAPES:
        raise Refused(f"unknown shape '{name}'; pick one of: {', '.join(SHAPES)}")
    shape = SHAPES[name]
    if layers is not None:
        if layers < 1:
            raise Refused(f"--layers {layers}: give a layer count of 1 or more")
        shape = replace(shape, layers=layers)
    return shape


def parse_types(text: str) -> list[str]:
    types = [t.strip().upper() for t in text.split(",") if t.strip()]
    if not types:
        raise Refused(f"--types '{text}': name at least one of {','.join(FTYPES)}")
    unknown = [t for t in types if t not in FTYPES]
    if unknown:
        raise Refused(f"unknown type {', '.join(unknown)}; pick from {','.join(FTYPES)}")
    return list(dict.fromkeys(types))


def stem(shape_name: str, layers: int | None) -> str:
    """The file name's start: the shape, and the layer count when `--layers` changed it."""
    if layers is None or layers == SHAPES[shape_name].layers:
        return shape_name
    return f"{shape_name}-L{layers}"


def stamp(shape_name: str, shape: Shape, seed: int) -> str:
    """What a file was made from, stored in its metadata (llama.cpp's quantizer copies it over)."""
    return json.dumps({"version": STAMP_VERSION, "shape": shape_name, "seed": seed, "params": asdict(shape)},
                      sort_keys=True)


def tensor_plan(shape: Shape, vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape (rows, columns), kind) of every tensor in llama.cpp's order and naming;
    kind is "normal" (random), or "ones" (a norm)."""
    d, q, kv = shape.dim, shape.heads * shape.hd, shape.kv_heads * shape.hd
    plan = [("token_embd.weight", (vocab, d), "normal")]
    for i in range(shape.layers):
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", (d,), "ones"),
                 (b + "attn_q.weight", (q, d), "normal"),
                 (b + "attn_k.weight", (kv, d), "normal"),
                 (b + "attn_v.weight", (kv, d), "normal")]
        if shape.qkv_bias:
            plan += [(b + "attn_q.bias", (q,), "normal"),
                     (b + "attn_k.bias", (kv,), "normal"),
                     (b + "attn_v.bias", (kv,), "normal")]
        plan += [(b + "attn_output.weight", (d, q), "normal"),
                 (b + "ffn_norm.weight", (d,), "ones"),
                 (b + "ffn_gate.weight", (shape.ffn, d), "normal"),
                 (b + "ffn_up.weight", (shape.ffn, d), "normal"),
                 (b + "ffn_down.weight", (d, shape.ffn), "normal")]
    plan.append(("output_norm.weight", (d,), "ones"))
    if not shape.tied:
        plan.append(("output.weight", (vocab, d), "normal"))
    return plan


def n_params(shape: Shape, vocab: int) -> int:
    return sum(int(np.prod(s)) for _, s, _ in tensor_plan(shape, vocab))


# ------------------------------------------------------------------------------------------- tokenizer


def default_tokenizer_gguf() -> Path:
    """The default model's GGUF, through specchat's own cache (fetched once, like `specchat pull`)."""
    from specchat.models import DEFAULT_MODEL, pull

    return pull(DEFAULT_MODEL, progress=True)


def tokenizer_fields(gguf_path: Path, vocab: int | None) -> tuple[list[tuple], int]:
    """Every `tokenizer.*` key of a GGUF as (key, value, type, sub_type) for GGUFWriter.add_key_value,
    with the token lists padded to `vocab` entries, and the padded vocabulary size.

    A shape whose vocabulary is larger than the tokenizer's (Llama 3.2: 128256, Qwen2.5: 152064 against
    SmolLM2's 49152) keeps its own embedding size, the part of the cost that matters; llama.cpp wants
    as many tokens as embedding rows, so placeholder tokens `<pad_N>` of type UNUSED fill the list.
    Prompts never produce them; a random model may sample them (they print as nothing)."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    fields = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        main = field.types[0]
        sub = field.types[-1] if main == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        fields.append([key, value, main, sub])
    tokens = next((f[1] for f in fields if f[0] == gguf.Keys.Tokenizer.LIST), None)
    if tokens is None:
        raise Refused(f"{gguf_path}: no tokenizer.ggml.tokens; give a GGUF with a tokenizer")
    n_tok = len(tokens)
    vocab = vocab or n_tok
    if vocab < n_tok:
        raise Refused(f"vocab {vocab} is smaller than the tokenizer's {n_tok} tokens")
    pad = vocab - n_tok
    if pad:
        fill = {gguf.Keys.Tokenizer.LIST: [f"<pad_{i}>" for i in range(n_tok, vocab)],
                gguf.Keys.Tokenizer.TOKEN_TYPE: [int(gguf.TokenType.UNUSED)] * pad,
                gguf.Keys.Tokenizer.SCORES: [0.0] * pad}
        for f in fields:
            if f[0] in fill:
                f[1] = list(f[1]) + fill[f[0]]
    return [tuple(f) for f in fields], vocab


# --------------------------------------------------------------------------------------------- writing


def write_f16(path: Path, shape_name: str, shape: Shape, seed: int, tokenizer_gguf: Path,
              log=lambda msg: None, progress=None) -> None:
    """The source GGUF: F16 matrices, F32 norms and biases, written tensor by tensor through a
    `.part` file (only the tensor being generated is in memory)."""
    import gguf

    tok_fields, vocab = tokenizer_fields(tokenizer_gguf, shape.vocab)
    arch = shape.arch
    plan = tensor_plan(shape, vocab)
    part = path.with_name(path.name + ".part")
    w = gguf.GGUFWriter(part, arch)
    try:
        w.add_name(f"{shape_name} shapes, random weights")
        w.add_file_type(F16_FILE_TYPE)
        w.add_string(SOURCE_KEY, stamp(shape_name, shape, seed))
        w.add_uint32(f"{arch}.block_count", shape.layers)
        w.add_uint32(f"{arch}.context_length", shape.context)
        w.add_uint32(f"{arch}.embedding_length", shape.dim)
        w.add_uint32(f"{arch}.feed_forward_length", shape.ffn)
        w.add_uint32(f"{arch}.attention.head_count", shape.heads)
        w.add_uint32(f"{arch}.attention.head_count_kv", shape.kv_heads)
        w.add_uint32(f"{arch}.attention.key_length", shape.hd)
        w.add_uint32(f"{arch}.attention.value_length", shape.hd)
        w.add_uint32(f"{arch}.rope.dimension_count", shape.hd)
        w.add_float32(f"{arch}.rope.freq_base", shape.rope_theta)
        w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", shape.rms_eps)
        w.add_uint32(f"{arch}.vocab_size", vocab)
        for key, value, vtype, sub in tok_fields:
            w.add_key_value(key, value, vtype, sub)
        dtypes = {name: (np.float32 if len(s) == 1 else np.float16) for name, s, _ in plan}
        for name, s, _ in plan:
            dt = np.dtype(dtypes[name])
            w.add_tensor_info(name, s, dt, int(np.prod(s)) * dt.itemsize)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        total = sum(int(np.prod(s)) * np.dtype(dtypes[name]).itemsize for name, s, _ in plan)
        log(f"{PROG}: writing {path.name} ({total / 1e9:.2f} GB of random weights)…\n")
        done = 0
        for index, (name, s, kind) in enumerate(plan):
            tensor = _tensor(s, dtypes[name], kind, seed, index)
            w.write_tensor_data(tensor)
            done += tensor.nbytes
            del tensor
            if progress:
                progress(done, total)
        w.close()
        os.replace(part, path)
    finally:
        w.close()
        part.unlink(missing_ok=True)


def _tensor(s: tuple[int, ...], dtype, kind: str, seed: int, index: int) -> np.ndarray:
    """One tensor; its values depend only on (seed, index), not on the order of generation."""
    out = np.empty(s, dtype=dtype)
    if kind == "ones":
        out.fill(1.0)
        return out
    rng = np.random.default_rng([seed, index])
    flat = out.reshape(-1)
    buf = np.empty(min(CHUNK, flat.size), dtype=np.float32)
    for start in range(0, flat.size, CHUNK):
        n = min(CHUNK, flat.size - start)
        b = buf[:n]
        rng.standard_normal(out=b, dtype=np.float32)
        b *= 0.02
        flat[start:start + n] = b
    return out


# ------------------------------------------------------------------------------------------ quantizing


def import_llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:
        raise Refused(f"llama-cpp-python is missing ({e}); install it with `pip install llama-cpp-python` "
                      "(or `pip install -e .` in specchat's checkout)") from None
    return llama_cpp


class _LlamaLog:
    """llama.cpp's log, kept in memory while quantizing (its tail is shown when the quantizer fails),
    or passed to stderr with `verbose`."""

    def __init__(self, llama_cpp, verbose: bool):
        self.lines: list[str] = []
        self.verbose = verbose

        def callback(level, text, user_data):
            msg = text.decode("utf-8", "replace") if text else ""
            if self.verbose:
                sys.stderr.write(msg)
            else:
                self.lines.append(msg)
                del self.lines[:-200]

        self._cb = llama_cpp.llama_log_callback(callback)  # kept referenced while installed
        self._llama_cpp = llama_cpp

    def __enter__(self):
        self._llama_cpp.llama_log_set(self._cb, ctypes.c_void_p(0))
        return self

    def __exit__(self, *exc):
        from llama_cpp import _logger

        self._llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
        return False

    def tail(self, n: int = 5) -> str:
        return " | ".join(line.strip() for line in "".join(self.lines).splitlines()[-n:] if line.strip())


def quantize(src: Path, dst: Path, type_name: str, threads: int | None = None, verbose: bool = False) -> None:
    """llama.cpp's quantizer (llama_model_quantize), from `src` into `dst` through a `.part` file."""
    llama_cpp = import_llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[type_name])
    params.nthread = threads or os.cpu_count() or 1
    part = dst.with_name(dst.name + ".part")
    try:
        with _LlamaLog(llama_cpp, verbose) as log:
            rc = llama_cpp.llama_model_quantize(str(src).encode(), str(part).encode(), ctypes.byref(params))
        if rc != 0:
            raise RuntimeError(f"llama.cpp's quantizer failed on {type_name} (return code {rc}): {log.tail()}")
        os.replace(part, dst)
    finally:
        part.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------ reading back


_read_cache: dict[tuple, tuple[dict, collections.Counter]] = {}


def read_back(path: Path) -> tuple[dict, collections.Counter]:
    """(metadata scalars and strings, count of tensors per ggml type name) of a GGUF (remembered per
    file version: parsing the 49k-token tokenizer takes a second or two)."""
    import gguf

    st = path.stat()
    key = (str(Path(path).resolve()), st.st_mtime_ns, st.st_size)
    if key in _read_cache:
        return _read_cache[key]
    reader = gguf.GGUFReader(path)
    meta = {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] != gguf.GGUFValueType.ARRAY:
            meta[key] = field.contents()
    types = collections.Counter(t.tensor_type.name for t in reader.tensors)
    _read_cache[key] = meta, types
    return meta, types


def source_of(path: Path) -> str | None:
    """The `specchat.shaped.source` stamp of a GGUF, or None (no file, unreadable, no stamp)."""
    if not path.is_file():
        return None
    try:
        return read_back(path)[0].get(SOURCE_KEY)
    except Exception:
        return None


def describe(path: Path) -> str:
    """`path size GB  TYPE x N, ...` (tensor types by count, most first)."""
    _, types = read_back(path)
    counts = ", ".join(f"{name} x {n}" for name, n in types.most_common())
    return f"{path} {path.stat().st_size / 1e9:.2f} GB  {counts}"


# ------------------------------------------------------------------------------------------- the whole


def check_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise Refused(f"--out {out} is a file, not a directory; give a directory (it is made if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as e:
        raise Refused(f"cannot write to {out} ({e.strerror or e}); give a writable directory with --out") from None


def check_disk(out: Path, needed: int) -> None:
    free = shutil.disk_usage(out).free
    if needed > free:
        raise Refused(f"{out} has {free / 1e9:.1f} GB free but these files need about {needed / 1e9:.1f} GB; "
                      "free space, pick another --out, fewer --types or fewer --layers")


def make(shape_name: str, types: list[str], out: Path, layers: int | None = None, seed: int = 0,
         keep_f16: bool = False, tokenizer_gguf: Path | None = None, threads: int | None = None,
         verbose: bool = False, log=lambda msg: None, progress=None) -> list[tuple[Path, bool]]:
    """Write DIR/{stem}-{type}.gguf for each type; returns (path, written now) per type, in order.
    An output already made from the same shape, layer count and seed is kept as it is."""
    shape = shape_of(shape_name, layers)
    if seed < 0:
        raise Refused(f"--seed {seed}: give a seed of 0 or more")
    out = Path(out)
    check_out_dir(out)
    base = stem(shape_name, layers)
    want = stamp(shape_name, shape, seed)
    outputs = [(t, out / f"{base}-{t}.gguf") for t in types]
    todo = [(t, p) for t, p in outputs if source_of(p) != want]
    if todo:
        import_llama_cpp()
        src = out / f"{base}.f16-source.gguf"
        have_src = source_of(src) == want
        params = n_params(shape, shape.vocab or TOKENIZER_VOCAB)
        needed = (0 if have_src else params * 2) + sum(int(params * BITS[t] / 8) for t, _ in todo)
        check_disk(out, int(needed * 1.05) + (64 << 20))
        try:
            if not have_src:
                tok = tokenizer_gguf or default_tokenizer_gguf()
                write_f16(src, shape_name, shape, seed, Path(tok), log, progress)
            for t, p in todo:
                log(f"{PROG}: quantizing {p.name} with llama.cpp ({threads or os.cpu_count()} threads)…\n")
                quantize(src, p, t, threads, verbose)
        finally:
            if not keep_f16:
                src.unlink(missing_ok=True)
    return [(p, (t, p) in todo) for t, p in outputs]


def _log(msg: str) -> None:
    print(msg, end="", file=sys.stderr, flush=True)


def _progress(done: int, total: int) -> None:
    _log(f"\r{done / total:7.1%}" + ("\n" if done == total else ""))


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + error
        raise Refused(f"{message}; see --help")


def main(argv: list[str] | None = None) -> int:
    ap = _Parser(prog="shaped_gguf.py", description=__doc__.splitlines()[0],
                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog="shapes: " + ", ".join(SHAPES))
    ap.add_argument("--shape", required=True, help=f"one of: {', '.join(SHAPES)}")
    ap.add_argument("--types", default="Q4_0,Q4_K_M,Q6_K,Q8_0",
                    help=f"comma-separated, from {','.join(FTYPES)} (default: %(default)s)")
    ap.add_argument("--out", required=True, type=Path, help="directory for the GGUF files")
    ap.add_argument("--layers", type=int, help="layer count instead of the shape's (quick runs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, help="quantizer threads (default: every CPU)")
    ap.add_argument("--keep-f16", action="store_true", help="keep the random F16 source GGUF")
    ap.add_argument("--verbose", action="store_true", help="show llama.cpp's quantizer log")
    try:
        args = ap.parse_args(argv)
        types = parse_types(args.types)
        shape_of(args.shape, args.layers)
        results = make(args.shape, types, args.out, layers=args.layers, seed=args.seed, keep_f16=args.keep_f16,
                       threads=args.threads, verbose=args.verbose, log=_log,
                       progress=_progress if sys.stderr.isatty() else None)
    except Refused as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted; partial files removed", file=sys.stderr)
        return 130
    except Exception as e:  # the quantizer failing, the tokenizer fetch failing, a full disk
        print(f"{PROG}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    for path, written in results:
        print(describe(path) + ("" if written else "  (already there)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
