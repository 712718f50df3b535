"""specchat's own CPU kernels (kernels/): the 4-bit matmul (`Int4Rows` packed once into tiles, then
`torch.ops.specchat.q4_linear(x, tiles, n)` for any number of rows), the argmax head's int8
logits and its choice (`q8_head`, `head_choose`, `head_dots`: float32 logits summed in one fixed
order) and verify-row attention (`attend_rows`, AVX512).

Why our own: torch's int4 kernel redoes its arithmetic for every row of a verify block (~14% of a
pass a row) and ties its results to how many rows come. These unpack each weight tile once for up
to 8 rows and multiply with int8 dot products (llama.cpp's q8_1 activations), and a row's result
has the same bits however many rows come, however many threads run, on every ISA
(tests/native/test_q4_kernel.py). Re-measure: scripts/q4_kernel_bench.py, scripts/decode_step.py.

The C++ is compiled once per torch version and source (10-20 s on 2 cores, into torch's extension
cache, ~/.cache/torch_extensions) when a model first loads; later starts only load the library.
Where it cannot be built, or with SPECCHAT_Q4_KERNEL=0, the engine runs torch's kernels as before,
said in one line.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from pathlib import Path

import torch
from torch import Tensor


log = logging.getLogger(__name__)

SOURCES = ("q4_op.cpp", "q4_ref.cpp", "q4_avx2.cpp", "q4_avx512vnni.cpp", "attention_avx512.cpp",
           "kquant_ref.cpp", "kquant_avx2.cpp", "kquant_avx512vnni.cpp", "f16_ref.cpp", "f16_avx2.cpp",
           "f16_avx512.cpp")
KERNEL_DIR = Path(__file__).parent / "kernels"
TILE_COLS = 16
INT4_GROUP = 32  # inputs a scale covers (int4.INT4_GROUP; not imported: int4.py imports this module)


def disabled() -> bool:
    return os.environ.get("SPECCHAT_Q4_KERNEL", "1").strip().lower() in ("0", "off", "false", "no")


@functools.cache
def available() -> bool:
    """Whether torch.ops.specchat.q4_linear can run here: loaded from the build cache, else built
    there first; False, with one line said, where it cannot be."""
    if disabled():
        return False
    if not hasattr(torch.ops.specchat, "q4_linear"):
        try:
            library = build_dir() / f"{NAME}.so"
            if not library.exists():  # once per source and torch version; later starts only load it
                _build(library.parent)
            torch.ops.load_library(str(library))
        except Exception as e:  # noqa: BLE001 - no compiler, no headers, a build error: fall back
            lines = str(e).strip().splitlines() or [type(e).__name__]
            why = next((line for line in lines if "error:" in line), lines[0])[:200]
            log.warning("specchat's 4-bit CPU kernel could not be built (%s); using torch's int4 kernel", why)
            return False
    _register_fake()
    return True


NAME = "specchat_q4"
FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]


def build_dir() -> Path:
    """Where the built library lies: torch's extension cache, in a folder named by a digest of the
    sources, the flags and torch's version (a changed source is a new folder, never a stale load)."""
    from torch.utils.cpp_extension import get_default_build_root

    h = hashlib.sha256(f"{torch.__version__}|{sys.version}|{FLAGS}".encode())
    for path in sorted(KERNEL_DIR.iterdir()):
        h.update(path.name.encode() + path.read_bytes())
    return Path(get_default_build_root()) / f"{NAME}-{h.hexdigest()[:16]}"


def _build(directory: Path) -> None:
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(name=NAME, sources=[str(KERNEL_DIR / s) for s in SOURCES], extra_cflags=FLAGS,
                       extra_ldflags=["-fopenmp"], build_directory=str(directory), is_python_module=False)


def isa() -> str:
    """The instruction set the kernel runs on here (avx512vnni, avx2 or ref)."""
    return torch.ops.specchat.q4_isa()


def _register_fake() -> None:
    if getattr(_register_fake, "done", False):
        return

    @torch.library.register_fake("specchat::q4_linear")
    def _(x: Tensor, tiles: Tensor, n: int) -> Tensor:
        return x.new_empty(*x.shape[:-1], n)

    @torch.library.register_fake("specchat::kq_linear")
    def _(x: Tensor, tiles: Tensor, type: int, n: int) -> Tensor:
        return x.new_empty(*x.shape[:-1], n)

    @torch.library.register_fake("specchat::kq_rows")
    def _(tiles: Tensor, type: int, K: int, ids: Tensor) -> Tensor:
        return tiles.new_empty(ids.numel(), K, dtype=torch.float32)

    @torch.library.register_fake("specchat::attend_rows")
    def _(q: Tensor, k: Tensor, v: Tensor, start: int, window: int = 0) -> Tensor:
        return q.new_empty(1, *q.shape)

    @torch.library.register_fake("specchat::q8_head")
    def _(x: Tensor, tiles: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
        rows = x.numel() // x.shape[-1]
        return x.new_empty(rows, scale.shape[0], dtype=torch.float32), x.new_empty(rows, 2, dtype=torch.float32)

    _register_fake.done = True


def fits(w) -> bool:
    """w: an `Int4Rows` (int4.py)."""
    return w.q.shape[0] % TILE_COLS == 0 and w.q.shape[1] % INT4_GROUP == 0


def pack(w) -> Tensor:
    """Int4Rows [N, K] -> tiles, uint8 [N / 16, K / 32, 320] (kernels/q4.h's q4_tile): w = d q + m
    with d = scale, m = zero - 8 scale, both float16."""
    N, K = w.q.shape
    nb, kb = N // TILE_COLS, K // INT4_GROUP
    # q[n, k] as [nb, c, kb, h, g, t]: n = 16 nb + c, k = 32 kb + 16 h + 4 g + t
    q = w.q.view(nb, TILE_COLS, kb, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)  # [nb, kb, h, g, c, t]
    nibbles = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(nb, kb, 256)

    def per_tile(t: Tensor) -> Tensor:  # [N, kb] float -> [nb, kb, 32] bytes of float16
        return t.to(torch.float16).view(nb, TILE_COLS, kb).transpose(1, 2).contiguous().view(torch.uint8)

    scale = w.scale.float()
    offset = w.zero.float() - 8 * scale
    return torch.cat([nibbles, per_tile(scale), per_tile(offset)], dim=-1).contiguous()



def pack_head(q: Tensor) -> Tensor:
    """An int8 head [V, K] (-127..127) -> tiles, uint8 [V / 16, K / 32, 512] (kernels/q4.h's
    q8_tile): 4 consecutive k of 16 rows in each 64 bytes, as unsigned (W + 128)."""
    V, K = q.shape
    out = torch.empty(V // 16, K // INT4_GROUP, 512, dtype=torch.uint8, device=q.device)
    for lo in range(0, V, 4096):  # a slice at a time: no full-size temporaries beside a big head
        w = (q[lo:lo + 4096].to(torch.int16) + 128).to(torch.uint8).view(-1, 16, K // INT4_GROUP, 8, 4)
        out[lo // 16:lo // 16 + w.shape[0]] = w.permute(0, 2, 3, 1, 4).reshape(-1, K // INT4_GROUP, 512)
    return out


def head_fits(q: Tensor) -> bool:
    return q.shape[0] % 16 == 0 and q.shape[1] % INT4_GROUP == 0


def attention_kernel_fits(heads: int, kv_heads: int, head_dim: int, cache_dtype: torch.dtype) -> bool:
    """Whether specchat's attention kernel (kernels/attention_avx512.cpp) runs this model's
    attention here: AVX512, at most 16 query heads a kv head, head_dim a multiple of 16 up to 256,
    a float32 or bfloat16 cache. Elsewhere the engine probes torch's attention (exact_rows.py)."""
    return (cache_dtype in (torch.float32, torch.bfloat16) and heads % kv_heads == 0 and heads // kv_heads <= 16
            and head_dim % 16 == 0 and head_dim <= 256 and available() and isa() == "avx512vnni")
