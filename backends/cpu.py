"""What the engines ask of the CPU: how many threads to run, and whether it multiplies bfloat16 natively."""
from __future__ import annotations

import hashlib
import logging
import os
import platform

import torch

log = logging.getLogger(__name__)
_noted: set[tuple[int, int]] = set()  # (requested, cores) already said in this process


def physical_cores() -> int:
    """Distinct (package, core) pairs in /proc/cpuinfo (hyperthreads only slow matmuls down);
    all CPUs where that cannot be read."""
    try:
        pairs, package = set(), "0"
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "physical id":
                    package = value.strip()
                elif key.strip() == "core id":
                    pairs.add((package, value.strip()))
        return len(pairs) or os.cpu_count() or 1
    except OSError:
        return os.cpu_count() or 1


def thread_count(threads: int = 0) -> int:
    """The threads to run (torch's or llama.cpp's): `threads`, every physical core for 0, and never
    more than the physical cores: more only contend for them (a 64-thread run on 2 cores decodes
    ~15x slower). A capped request is said once per process, one line as a logging warning
    (printed bare on stderr where the app configures no logging)."""
    cores = physical_cores()
    if threads > cores:
        if (threads, cores) not in _noted:
            _noted.add((threads, cores))
            log.warning("threads: %d requested, this machine has %d physical core%s: using %d",
                        threads, cores, "s" * (cores != 1), cores)
        return cores
    return threads or cores


def native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX); elsewhere torch
    emulates it and a bfloat16 GEMM is several times slower than float32."""
    flags = getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None)
    return any(f is not None and f() for f in flags)


def cpu_flags() -> list[str]:
    """This CPU's feature flags as /proc/cpuinfo lists them (what -march=native sees); none where
    that cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].split()
    except OSError:
        pass
    return []


def cpu_tag() -> str:
    """A short digest of this CPU's architecture and feature flags (what native code is built for:
    llama-server's GGML_NATIVE build, the compiled decode graphs' kernels)."""
    flags = " ".join(sorted(cpu_flags()))
    return hashlib.sha256(f"{platform.machine()}|{flags}".encode()).hexdigest()[:10]
