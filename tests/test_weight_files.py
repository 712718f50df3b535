"""Broken weight files, as a download cut short, a full disk or a flipped byte leaves them: a tiny
real checkpoint (safetensors and GGUF, written by transformers' and gguf's own writers) and the
default GGUF, truncated, with absurd header lengths and counts, and with bytes of their headers
flipped, each run through `specchat run` and through loading the profile (the chat's path). A
file the readers refuse gives exit 2 and one line naming it, no traceback, no allocation past the
file's size, and the file untouched; one whose flip leaves a valid file may run (exit 0).

Flips are drawn inside the headers: a flipped byte of tensor data is a valid file with other
weights, which nothing can tell without checksums the formats do not carry."""
from __future__ import annotations

import hashlib
import random
import shutil
import tracemalloc
from pathlib import Path

import pytest

from specchat import cli, loading
from specchat.backends.base import BackendError
from specchat.profiles import get_profile
from tests.native.tiny import make_gguf, make_hf_checkpoint

SEED = 55
FLIPS = 12  # per format: enough to land in lengths, names, shapes, offsets and types, and cheap
# What the interpreter may allocate on a refused load besides the file's own bytes (the JSON
# header parsed into dicts, error text); the readers this replaced asked for 2**30 bytes and more.
SLACK = 4 << 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    hf = make_hf_checkpoint(d / "hf", "llama")
    return hf, make_gguf(d / "tiny.gguf", hf, "Q4_1")


@pytest.fixture
def cache(isolated_dirs, monkeypatch):
    """A cache of the test's own, so that GGUF indexes and llama.cpp's probe marker land there."""
    path = isolated_dirs / "cache"
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(path))
    return path


def safetensors_mutations(data: bytes, rng: random.Random) -> list[tuple[str, bytes, bool]]:
    """(what, bytes, must be refused)."""
    size, end = len(data), 8 + int.from_bytes(data[:8], "little")
    cuts = {0, 7, 8, end - 1, end, rng.randrange(9, end), rng.randrange(end + 1, size), size - 1}
    out = [(f"truncated to {k} bytes", data[:k], True) for k in sorted(cuts)]
    out += [(f"header length {n}", n.to_bytes(8, "little") + data[8:], True)
            for n in (2**64 - 1, 2**62, 2**30, size - 7, end - 8 + 1, end - 8 - 1)]
    return out + flips(data, end, rng)


def gguf_mutations(data: bytes, data_start: int, data_end: int, rng: random.Random) -> list[tuple[str, bytes, bool]]:
    cuts = {0, 3, 4, 23, 24, rng.randrange(25, data_start), data_start, rng.randrange(data_start + 1, data_end),
            data_end - 1}
    out = [(f"truncated to {k} bytes", data[:k], True) for k in sorted(cuts)]

    def put(at: int, value: int) -> bytes:
        return data[:at] + value.to_bytes(8, "little") + data[at + 8:]

    out += [("tensor count 2**63", put(8, 2**63), True), ("tensor count 2**32", put(8, 2**32), True),
            ("metadata count 2**63", put(16, 2**63), True), ("first key's length 2**62", put(24, 2**62), True)]
    return out + flips(data, data_start, rng)


def flips(data: bytes, header_end: int, rng: random.Random) -> list[tuple[str, bytes, bool]]:
    out = []
    for _ in range(FLIPS):
        at, mask = rng.randrange(header_end), rng.randrange(1, 256)
        out.append((f"byte {at} xor {mask:#04x}", data[:at] + bytes([data[at] ^ mask]) + data[at + 1:], False))
    return out


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def run(capsys, profile: str) -> tuple[int, str, str, int]:
    """`specchat run` in this process: exit code, stdout, stderr and the peak of what Python and
    numpy allocated during it."""
    capsys.readouterr()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        rc = cli.main(["run", "-p", profile, "hi", "--max-tokens", "2"])
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    out, err = capsys.readouterr()
    return rc, out, err, peak


def check(capsys, profiles: Path, name: str, yaml: str, folder: Path, what: str, must_refuse: bool,
          file_size: int) -> tuple[int, str]:
    """One mutated model through `specchat run` and through loading its profile."""
    (profiles / f"{name}.yaml").write_text(yaml)
    before = digest(folder)
    rc, out, err, peak = run(capsys, name)
    case = f"{name}, {what}: rc {rc}, stderr {err!r}"
    assert rc in (0, 2), case
    assert "Traceback" not in err, case
    if must_refuse:
        assert rc == 2, case
    if rc == 2:
        assert out == "" and err.count("\n") == 1 and err.startswith("specchat: error: "), case
        assert peak < file_size + SLACK, f"{case}: allocated {peak} bytes for a {file_size}-byte file"
        with pytest.raises(BackendError) as refused:  # the chat's path: the same one line
            loading.load_backend(get_profile(name), start_background=False).close()
        assert "\n" not in str(refused.value) and str(refused.value) in err, case
    assert digest(folder) == before, f"{case}: the files changed"
    return rc, err


def test_a_broken_safetensors_checkpoint_is_one_line(tiny, cache, isolated_dirs, capsys):
    hf, _ = tiny
    data = (hf / "model.safetensors").read_bytes()
    profiles = isolated_dirs / "user-profiles"
    profiles.mkdir(parents=True, exist_ok=True)
    folder = isolated_dirs / "model"
    shutil.copytree(hf, folder)
    refused = 0
    for what, broken, must_refuse in safetensors_mutations(data, random.Random(SEED)):
        (folder / "model.safetensors").write_bytes(broken)
        rc, _ = check(capsys, profiles, "st", "backend: torch\nmodel: ../model\ncontext: 128\nthreads: 2\n", folder,
                   what, must_refuse, len(broken))
        refused += rc == 2
    assert refused >= 14  # every truncation and header length, and flips besides


def test_a_broken_drafter_is_one_line(tiny, cache, isolated_dirs, capsys):
    """A draft model's corrupt weights: one line naming the drafter's file, before the target loads."""
    hf, gguf_path = tiny
    profiles = isolated_dirs / "user-profiles"
    profiles.mkdir(parents=True, exist_ok=True)
    shutil.copy(gguf_path, isolated_dirs / "tiny.gguf")
    folder = isolated_dirs / "drafter"
    shutil.copytree(hf, folder)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(b"\xff" * 8 + data[8:])
    yaml = ("backend: torch\nmodel: ../tiny.gguf\ncontext: 128\nthreads: 2\n"
            "speculative: {method: draft, depth: 1, drafter: ../drafter}\n")
    rc, err = check(capsys, profiles, "draft", yaml, folder, "header length 2**64 - 1", True, len(data))
    assert "drafter/model.safetensors: broken weight file" in err


@pytest.mark.parametrize("backend", ["torch", "llamacpp"])
def test_a_broken_gguf_is_one_line(tiny, cache, isolated_dirs, capsys, backend):
    import gguf

    _, gguf_path = tiny
    reader = gguf.GGUFReader(str(gguf_path))
    data_end = max(int(t.data_offset) + t.data.nbytes for t in reader.tensors)
    data = gguf_path.read_bytes()
    profiles = isolated_dirs / "user-profiles"
    profiles.mkdir(parents=True, exist_ok=True)
    folder = isolated_dirs / "model"
    folder.mkdir()
    refused = 0
    for what, broken, must_refuse in gguf_mutations(data, reader.data_offset, data_end, random.Random(SEED)):
        (folder / "tiny.gguf").write_bytes(broken)
        rc, _ = check(capsys, profiles, "g", f"backend: {backend}\nmodel: ../model/tiny.gguf\ncontext: 128\nthreads: 2\n",
                   folder, what, must_refuse, len(broken))
        refused += rc == 2
    assert refused >= 13
    # llama.cpp's probe of its CPU buffers never took a broken file for a CPU that faults (on a CPU
    # with AMX the binding's build does fault, with the intact file too: then "broken" is the truth)
    from specchat.backends.llamacpp import extra_buffers_work

    assert not list(cache.glob("llamacpp-*.broken")) or not extra_buffers_work(gguf_path)


def test_the_default_gguf_cut_short_or_with_absurd_counts(default_gguf, cache, isolated_dirs, capsys):
    """The real default model as a download cut short in its tensors or in its header, and with a
    tensor count no file holds, through both engines (a cut in the tensors parses the 1.8 MB header)."""
    profiles = isolated_dirs / "user-profiles"
    profiles.mkdir(parents=True, exist_ok=True)
    folder = isolated_dirs / "model"
    folder.mkdir()
    target, size = folder / "default.gguf", default_gguf.stat().st_size

    def copy(keep: int = size, patch: tuple[int, bytes] | None = None) -> int:
        with default_gguf.open("rb") as f, target.open("wb") as out:
            shutil.copyfileobj(f, out) if keep == size else out.write(f.read(keep))
        if patch is not None:
            with target.open("r+b") as out:
                out.seek(patch[0])
                out.write(patch[1])
        return target.stat().st_size

    cases = {"truncated in its tensors": dict(keep=size // 2), "truncated in its header": dict(keep=100_000),
             "tensor count 2**63": dict(patch=(8, (2**63).to_bytes(8, "little")))}
    for what, how in cases.items():
        n = copy(**how)
        for backend in ("torch", "llamacpp"):
            check(capsys, profiles, f"d-{backend}", f"backend: {backend}\nmodel: ../model/default.gguf\ncontext: 128\n",
                  folder, what, True, n)
    assert not list(cache.glob("llamacpp-*.broken"))
