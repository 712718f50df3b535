"""Checking weight files before anything allocates or indexes by what they say.

A safetensors file is an 8-byte header length, a JSON header and a data buffer; a GGUF file is a
header and tensor data at offsets it gives. A truncated download, a disk that filled up or a
flipped byte turns those numbers into nonsense, and a reader that trusts them reads 2**62 bytes,
reshapes past the end or fails deep inside a library. Every reader of these files goes through
here first: the sizes and offsets are checked against the file's real size, and a broken file is
one `BrokenWeightFile` line naming it and saying what to do.

Nothing here writes to the files it checks.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from .base import BackendError

FIX = "download it again, or point the profile elsewhere"

# safetensors' own limit on the JSON header (its Rust reader refuses larger ones)
MAX_SAFETENSORS_HEADER = 100_000_000
# bits per element of each safetensors dtype (sub-byte ones too, as the format's spec lists them)
SAFETENSORS_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F4": 4,
                    "F6_E2M3": 6, "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32,
                    "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}


class BrokenWeightFile(BackendError):
    """A weight file whose bytes do not hold what its header says (one line: which file, what, what to do)."""

    def __init__(self, path: Path | str, problem: str, fix: str = FIX):
        self.path, self.problem = Path(path), problem
        super().__init__(f"{path}: broken weight file ({problem}); {fix}")


@dataclass(frozen=True)
class SafetensorsEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets into the data buffer
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    tensors: dict[str, SafetensorsEntry]
    metadata: dict[str, str]
    data_start: int  # where the data buffer starts in the file

    @property
    def parameters(self) -> int:
        return sum(math.prod(t.shape) for t in self.tensors.values())


_checked: dict[tuple, SafetensorsHeader] = {}


def safetensors_header(path: Path | str, fix: str = FIX) -> SafetensorsHeader:
    """The header of a safetensors file, checked against the file's size the way the format
    requires (every tensor's bytes match its shape and dtype, the tensors tile the data buffer
    exactly); raises BrokenWeightFile otherwise. Reads at most the header's bytes."""
    path = Path(path)
    try:
        st = path.stat()
        key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
        if key in _checked:
            return _checked[key]
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise BrokenWeightFile(path, f"{st.st_size} bytes, too short for the safetensors header length", fix)
            n = int.from_bytes(head, "little")
            if n > st.st_size - 8 or n > MAX_SAFETENSORS_HEADER:
                raise BrokenWeightFile(path, f"its header claims {n} bytes, the file has {st.st_size}; "
                                             "truncated or not a safetensors file", fix)
            raw = f.read(n)
    except OSError as e:
        raise BrokenWeightFile(path, f"unreadable: {e.strerror or e}", fix) from None
    header = _parse_safetensors(path, raw, 8 + n, st.st_size, fix)
    _checked[key] = header
    return header


def _parse_safetensors(path: Path, raw: bytes, data_start: int, size: int, fix: str) -> SafetensorsHeader:
    def broken(problem: str) -> BrokenWeightFile:
        return BrokenWeightFile(path, problem, fix)

    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise broken("its header is not JSON; truncated or not a safetensors file") from None
    if not isinstance(doc, dict):
        raise broken("its header is not a JSON object")
    metadata = doc.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise broken("its __metadata__ is not a map of strings")
    tensors = {}
    for name, t in doc.items():
        if not isinstance(t, dict):
            raise broken(f"tensor {name!r}: not an entry")
        dtype, shape, offsets = t.get("dtype"), t.get("shape"), t.get("data_offsets")
        if dtype not in SAFETENSORS_BITS:
            raise broken(f"tensor {name!r}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise broken(f"tensor {name!r}: shape {shape!r} is not a list of sizes")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise broken(f"tensor {name!r}: data_offsets {offsets!r} are not a byte range")
        bits = math.prod(shape) * SAFETENSORS_BITS[dtype]  # Python ints: no overflow on absurd shapes
        if bits != 8 * (offsets[1] - offsets[0]):
            raise broken(f"tensor {name!r}: shape {shape} of {dtype} needs {bits / 8:.0f} bytes, "
                         f"its offsets span {offsets[1] - offsets[0]}")
        tensors[name] = SafetensorsEntry(dtype, tuple(shape), offsets[0], offsets[1])
    end = 0
    for name, t in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if t.begin != end:
            raise broken(f"tensor {name!r} starts at byte {t.begin} of the data, the one before ends at {end}")
        end = t.end
    if data_start + end != size:
        raise broken(f"its tensors end at byte {data_start + end}, the file has {size}; "
                     + ("truncated" if size < data_start + end else "bytes past the last tensor"))
    return SafetensorsHeader(tensors, metadata, data_start)


def open_safetensors(path: Path | str, fix: str = FIX):
    """`safetensors.safe_open` (torch tensors) on a file checked first; its own errors become
    BrokenWeightFile too. Use as a context manager."""
    from safetensors import SafetensorError, safe_open

    safetensors_header(path, fix)
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise BrokenWeightFile(path, str(e), fix) from None


def load_safetensors(path: Path | str, fix: str = FIX) -> dict:
    """Every tensor of a checked safetensors file (`safetensors.torch.load_file`)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    safetensors_header(path, fix)
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise BrokenWeightFile(path, str(e), fix) from None


def safetensors_index(path: Path, fix: str = FIX) -> dict[str, Path]:
    """A sharded checkpoint's `model.safetensors.index.json`: tensor name -> shard, each shard present."""
    index = path / "model.safetensors.index.json"
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        out = {str(name): path / str(f) for name, f in weight_map.items()}
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        raise BrokenWeightFile(index, "not a JSON index with a weight_map", fix) from None
    for f in sorted(set(out.values())):
        if not f.is_file():
            raise BrokenWeightFile(index, f"it lists shard {f.name}, which is not there", fix)
    return out


# ---- GGUF ----

GGUF_MAGIC = b"GGUF"
# bytes of each GGUF metadata value type (gguf.GGUFValueType); 8 is a string, 9 an array
_GGUF_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_MAX_DIMS = 4  # GGML_MAX_DIMS


class _GgufHeader:
    """A walk over a GGUF header that checks every length, count and offset against the file's
    size before it moves past it; nothing is allocated by what the file claims."""

    def __init__(self, path: Path, view, order: str, fix: str):
        self.path, self.view, self.size, self.fix = path, view, len(view), fix
        self.order, self.pos = order, 24

    def broken(self, problem: str) -> BrokenWeightFile:
        return BrokenWeightFile(self.path, problem, self.fix)

    def take(self, n: int, what: str) -> int:
        if n > self.size - self.pos:
            raise self.broken(f"{what} at byte {self.pos} needs {n} bytes, the file ends at {self.size}; "
                              "truncated or corrupted")
        start, self.pos = self.pos, self.pos + n
        return start

    def uint(self, n: int, what: str) -> int:
        start = self.take(n, what)
        return int.from_bytes(self.view[start:start + n], self.order)

    def string(self, what: str) -> str:
        n = self.uint(8, what)
        start = self.take(n, what)
        try:
            return str(self.view[start:start + n], "utf-8")
        except UnicodeDecodeError:
            raise self.broken(f"{what} at byte {start} is not UTF-8") from None

    def value(self, vtype: int, what: str, depth: int = 0):
        if vtype in _GGUF_SCALAR:
            return self.uint(_GGUF_SCALAR[vtype], what)
        if vtype == 8:
            return self.string(what)
        if vtype != 9 or depth > 1:
            raise self.broken(f"{what} has value type {vtype}, which GGUF does not define")
        itype, count = self.uint(4, what), self.uint(8, what)
        if itype in _GGUF_SCALAR:
            self.take(count * _GGUF_SCALAR[itype], what)
        elif count * 8 > self.size - self.pos:  # every element takes 8 bytes or more
            raise self.broken(f"{what} claims {count} elements, more than the file holds; truncated or corrupted")
        else:
            for _ in range(count):
                self.value(itype, what, depth + 1)
        return None

    def tensors(self, n_tensors: int, n_fields: int) -> None:
        import gguf

        alignment = 32
        for i in range(n_fields):
            key = self.string(f"metadata key {i}")
            value = self.value(self.uint(4, key), f"metadata {key}")
            if key == "general.alignment":
                alignment = value
        if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
            raise self.broken(f"general.alignment {alignment} is not a power of two")
        infos = []
        for i in range(n_tensors):
            name = self.string(f"tensor {i}'s name")
            n_dims = self.uint(4, name)
            if not 1 <= n_dims <= _GGUF_MAX_DIMS:
                raise self.broken(f"tensor {name} has {n_dims} dimensions")
            dims = [self.uint(8, name) for _ in range(n_dims)]
            ttype, offset = self.uint(4, name), self.uint(8, name)
            try:
                block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)]
            except (ValueError, KeyError):
                raise self.broken(f"tensor {name} has type {ttype}, which GGUF does not define") from None
            if dims[0] % block:
                raise self.broken(f"tensor {name}: a row of {dims[0]} is not whole blocks of {block}")
            infos.append((name, offset, math.prod(dims) // block * block_bytes))
        start = -(-self.pos // alignment) * alignment
        for name, offset, n_bytes in infos:
            if offset % alignment:
                raise self.broken(f"tensor {name}'s offset {offset} is not a multiple of the alignment {alignment}")
            if start + offset + n_bytes > self.size:
                raise self.broken(f"tensor {name} lies at bytes {start + offset}..{start + offset + n_bytes}, the "
                                  f"file has {self.size}; truncated")


def check_gguf(path: Path | str, fix: str = FIX) -> None:
    """A GGUF file's header walked and its tensors' extents checked against its size: magic,
    version, every count, length and offset; raises BrokenWeightFile naming what does not fit."""
    import mmap

    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(24)
            if len(head) < 24:
                raise BrokenWeightFile(path, f"{size} bytes, too short for a GGUF header", fix)
            if head[:4] != GGUF_MAGIC:
                raise BrokenWeightFile(path, f"it starts with {head[:4]!r}, not GGUF's magic {GGUF_MAGIC!r}", fix)
            order = "little" if int.from_bytes(head[4:8], "little") < 1 << 16 else "big"  # as gguf's reader tells
            version = int.from_bytes(head[4:8], order)
            if version not in (2, 3):
                raise BrokenWeightFile(path, f"GGUF version {version}; llama.cpp writes versions 2 and 3", fix)
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
                header = _GgufHeader(path, memoryview(view), order, fix)
                try:
                    header.tensors(int.from_bytes(head[8:16], order), int.from_bytes(head[16:24], order))
                finally:
                    header.view.release()
    except OSError as e:
        raise BrokenWeightFile(path, f"unreadable: {e.strerror or e}", fix) from None


def gguf_reader(path: Path | str, fix: str = FIX):
    """`gguf.GGUFReader` on a file `check_gguf` passed; whatever the reader still trips on
    becomes BrokenWeightFile too."""
    import gguf

    path = Path(path)
    check_gguf(path, fix)
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - the reader raises whatever numpy does on bad offsets
        raise BrokenWeightFile(path, f"gguf's reader refuses it: {type(e).__name__}: {e}", fix) from None
