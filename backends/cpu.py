"""What the engines ask of the CPU: how many threads to run, and whether it multiplies bfloat16 natively."""
from __future__ import annotations

import hashlib
import logging
import math
import os
import platform
from pathlib import Path

import torch

log = logging.getLogger(__name__)
_noted: set[tuple[int, int]] = set()  # (requested, cores) already said in this process


def physical_cores() -> int:
    """The cores this process may use: distinct (package, core) pairs in /proc/cpuinfo among the
    CPUs its affinity allows (hyperthreads only slow matmuls down), and no more than a cgroup CPU
    quota grants (a container given 2 CPUs of 64: 2); all allowed CPUs where cpuinfo cannot be read."""
    allowed = _allowed_cpus()
    try:
        pairs, package, processor = set(), "0", -1
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "processor":
                    processor = int(value)
                elif key == "physical id":
                    package = value.strip()
                elif key == "core id" and (allowed is None or processor in allowed):
                    pairs.add((package, value.strip()))
        cores = len(pairs) or (len(allowed) if allowed else os.cpu_count() or 1)
    except (OSError, ValueError):
        cores = len(allowed) if allowed else os.cpu_count() or 1
    quota = cgroup_cpu_limit()
    return max(1, min(cores, math.ceil(quota))) if quota is not None else cores


def _allowed_cpus() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return None


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")
                     ) -> float | None:
    """The CPUs a cgroup quota grants this process (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us` over
    `cpu.cfs_period_us`), the tightest along its cgroup and their parents; None when unlimited or unknown."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        lines = []
    limits = []
    for line in lines or ["0::/"]:
        _, controllers, where = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy
            base, read = root, _v2_limit
        elif "cpu" in controllers.split(","):
            base = next((root / d for d in (controllers, "cpu,cpuacct", "cpu") if (root / d).is_dir()), None)
            read = _v1_limit
            if base is None:
                continue
        else:
            continue
        folder = base / where.lstrip("/")
        while True:  # a container often sees its own cgroup as the root: the walk ends there
            limit = read(folder)
            if limit is not None:
                limits.append(limit)
            if folder == base or base not in folder.parents:
                break
            folder = folder.parent
    return min(limits) if limits else None


def _v2_limit(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_limit(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


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
