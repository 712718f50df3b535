"""llama-server, built once from the llama.cpp source that the installed llama-cpp-python carries.

llama-cpp-python's sdist holds llama.cpp's full source (`vendor/llama.cpp`, `tools/server` included),
the same version as the installed binding, so the server and the `llamacpp` backend run one
llama.cpp. The sdist is fetched with pip (the user's index and proxies apply), checked to be that
version and to hold the server's source, and built with CMake under the cache directory:

    <cache>/llama-server/<version>-<cpu>/
        src/, build/    the extracted llama.cpp source and CMake's build tree, while building
                        (an interrupted build resumes from them; both go once the binary is in place)
        llama-server    the finished, statically linked binary
        build.json      what it was built from

The binary is compiled for this CPU (GGML_NATIVE), so the CPU's feature flags are part of the key:
a cache copied to another machine builds afresh instead of crashing on an unknown instruction.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Callable, Optional

from ..base import BackendError
from ..cpu import cpu_flags, cpu_tag

PACKAGE = "llama-cpp-python"
BINARY = "llama-server"
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON")
# ggml's AMX matrix multiply fills its tile configuration in a local struct and passes it to
# _tile_loadconfig. GCC's intrinsic (amxtileintrin.h, GCC 12 at least) declares that `ldtilecfg` reads
# only the struct's first 8 bytes, so -O3 drops the stores of the tile shapes and the instruction
# loads stack garbage: a general-protection fault, seen as SIGSEGV in ggml_backend_amx_mul_mat while
# the server warms up (the compiled code holds no store of a row or column count). One empty asm
# statement that names the whole struct as read keeps every store; with clang's builtin it changes
# nothing. Where the source no longer holds that call, ggml's AMX kernel is left out instead
# (explicit -mno-amx-* win over -march=native, so every other native instruction stays).
AMX_KERNEL_SOURCE = Path("ggml/src/ggml-cpu/amx/mmq.cpp")
LOAD_TILE_CONFIG = "_tile_loadconfig(&tc);"
KEEP_TILE_CONFIG = '__asm__ volatile("" : : "m"(tc));  /* specchat: ldtilecfg reads all 64 bytes */ '
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
_PERCENT = re.compile(r"^\[\s*(\d+)%\]")
PROGRESS_STEP = 5  # percent between two progress lines

Progress = Callable[[str], None]  # one line of news at a time ("building llama-server: 42%")


def binding_version() -> str:
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise BackendError(f"{PACKAGE} is not installed, and llama-server is built from its source: "
                           f"pip install {PACKAGE}") from None


def cpu_lists_amx() -> bool:
    return "amx_tile" in cpu_flags()


def cmake_flags(amx_kernel_fixed: bool = False) -> tuple[str, ...]:
    """CMAKE_FLAGS, and on a CPU that lists AMX, unless ggml's tile configuration was fixed in the
    source (fix_amx_tile_config), the flags that leave ggml's AMX kernel out (NO_AMX)."""
    if not cpu_lists_amx() or amx_kernel_fixed:
        return CMAKE_FLAGS
    return (*CMAKE_FLAGS, f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}")


def fix_amx_tile_config(source: Path) -> bool:
    """Make ggml's AMX kernel load the tile configuration it wrote (see KEEP_TILE_CONFIG); whether
    the source now holds the fix (an interrupted build finds it already there)."""
    path = Path(source) / AMX_KERNEL_SOURCE
    if not path.is_file():
        return False
    text = path.read_text()
    if KEEP_TILE_CONFIG + LOAD_TILE_CONFIG in text:
        return True
    if text.count(LOAD_TILE_CONFIG) != 1:
        return False
    path.write_text(text.replace(LOAD_TILE_CONFIG, KEEP_TILE_CONFIG + LOAD_TILE_CONFIG))
    return True


def build_dir(cache_dir: Path, version: Optional[str] = None) -> Path:
    """The build for this binding and CPU. On a CPU that lists AMX the folder is its own
    ("-amxcfg"), so that a binary built before with ggml's broken tile configuration, or without
    the AMX kernel, is not reused."""
    suffix = "-amxcfg" if cpu_lists_amx() else ""
    return Path(cache_dir) / BINARY / f"{version or binding_version()}-{cpu_tag()}{suffix}"


def built_server(cache_dir: Path) -> Optional[Path]:
    """The finished binary for the installed binding and this CPU, or None."""
    root = build_dir(cache_dir)
    binary, stamp = root / BINARY, root / "build.json"
    if binary.is_file() and os.access(binary, os.X_OK) and stamp.is_file():
        return binary
    return None


def missing_tools() -> list[str]:
    missing = [] if shutil.which("cmake") else ["CMake"]
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        missing.append("a C++ compiler")
    return missing


def ensure_llama_server(cache_dir: Path, progress: Optional[Progress] = None, jobs: int = 0) -> Path:
    """The llama-server binary, building it first when this machine has none (minutes, once)."""
    found = built_server(cache_dir)
    if found is not None:
        return found
    say = progress or (lambda line: None)
    missing = missing_tools()
    if missing:
        raise BackendError(f"llama-server is built here from llama.cpp's source and that needs {' and '.join(missing)}: "
                           "install them (Debian/Ubuntu: apt install cmake g++; or pip install cmake) and run again")
    version = binding_version()
    root = build_dir(cache_dir, version)
    root.mkdir(parents=True, exist_ok=True)
    source = root / "src"
    if not (source / "tools" / "server").is_dir():
        say(f"fetching the {PACKAGE}=={version} source with pip (it carries llama.cpp)…")
        fetch_source(version, source)
    amx = cpu_lists_amx()
    fixed = amx and fix_amx_tile_config(source)
    amx_kernel = ("built, tile configuration fixed" if fixed else "left out") if amx else "no AMX on this CPU"
    flags = cmake_flags(amx_kernel_fixed=fixed)
    configure_and_build(source, root / "build", flags, say, jobs or os.cpu_count() or 1)
    built = root / "build" / "bin" / BINARY
    if not built.is_file():
        raise BackendError(f"the llama.cpp build finished without {built}; its log is in {root / 'build'}")
    part = root / (BINARY + ".part")
    shutil.copy2(built, part)
    os.replace(part, root / BINARY)
    (root / "build.json").write_text(json.dumps({"package": PACKAGE, "version": version, "cpu": cpu_tag(),
                                                 "cmake_flags": list(flags),
                                                 "amx_kernel": amx_kernel}, indent=1))
    for scratch in (source, root / "build"):  # ~400 MB that only this build needed
        shutil.rmtree(scratch, ignore_errors=True)
    say(f"llama-server built: {root / BINARY}")
    return root / BINARY


def fetch_source(version: str, dest: Path) -> None:
    """Download the sdist with pip and extract its `vendor/llama.cpp` to `dest` (atomically)."""
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", tmp, f"{PACKAGE}=={version}"]
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        archives = list(Path(tmp).glob("*.tar.gz"))
        if done.returncode != 0 or not archives:
            last = (done.stderr or "").strip().splitlines()[-1:] or ["no source archive downloaded"]
            raise BackendError(f"could not fetch the {PACKAGE}=={version} source from the package index ({last[0]}); "
                               "check the network and run again")
        extract_llama_cpp(archives[0], version, Path(tmp) / "x")
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(Path(tmp) / "x", dest)


def extract_llama_cpp(archive: Path, version: str, dest: Path) -> None:
    """`vendor/llama.cpp/` of the sdist into `dest`, refusing an archive that is not the expected
    version, lacks the server's source, or holds paths outside its own folder."""
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    with tarfile.open(archive, "r:gz") as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        if not any(m.name.startswith(prefix + "tools/server/") for m in members):
            raise BackendError(f"{archive.name} is not the {PACKAGE} {version} source with llama.cpp's server "
                               f"(no {prefix}tools/server): delete it from pip's cache and run again")
        for m in members:
            m.name = m.name[len(prefix):]
        members = [m for m in members if m.name and (m.isfile() or m.isdir() or m.issym())]
        tar.extractall(dest, members=members, filter="data")


def configure_and_build(source: Path, build: Path, flags: tuple[str, ...], say: Progress, jobs: int) -> None:
    log = build.parent / "build.log"
    with open(log, "a") as out:
        steps = [("configuring llama.cpp", ["cmake", "-S", str(source), "-B", str(build), *flags]),
                 ("building llama-server", ["cmake", "--build", str(build), "--target", BINARY, "-j", str(jobs)])]
        for label, cmd in steps:
            say(f"{label}…")
            run_logged(cmd, out, label, say, log)


def run_logged(cmd: list[str], out, label: str, say: Progress, log: Path) -> None:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    shown = -PROGRESS_STEP
    tail: list[str] = []
    for line in proc.stdout:
        out.write(line)
        tail = (tail + [line.rstrip()])[-20:]
        m = _PERCENT.match(line)
        if m and int(m.group(1)) >= shown + PROGRESS_STEP:
            shown = int(m.group(1))
            say(f"{label}: {shown}%")
    if proc.wait() != 0:
        errors = [t for t in tail if "error" in t.lower()] or tail[-1:] or ["no output"]
        raise BackendError(f"{label} failed ({errors[-1].strip()[:200]}); the full log is {log}")
