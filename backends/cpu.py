"""What the engines ask of the CPU: how many threads to run, and whether it multiplies bfloat16 natively."""
from __future__ import annotations

import os

import torch


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
    """The torch threads to run: `threads`, or every physical core for 0."""
    return threads or physical_cores()


def native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX); elsewhere torch
    emulates it and a bfloat16 GEMM is several times slower than float32."""
    flags = getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None)
    return any(f is not None and f() for f in flags)
