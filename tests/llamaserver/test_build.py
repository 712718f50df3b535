"""Building llama-server: what is checked before minutes are spent, and what is reused after."""
from __future__ import annotations

import io
import json
import shutil
import signal
import subprocess
import tarfile

import pytest

from specchat.backends.base import BackendError
from specchat.backends.llamaserver import build


def test_missing_cmake_or_compiler_is_one_line_before_anything_is_fetched(tmp_path, monkeypatch):
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.raises(BackendError, match="needs CMake and a C\\+\\+ compiler: install them"):
        build.ensure_llama_server(tmp_path)
    assert not any(tmp_path.iterdir())  # nothing fetched, nothing half-built


def test_a_finished_build_for_this_version_and_cpu_is_reused(tmp_path, monkeypatch):
    root = build.build_dir(tmp_path)
    root.mkdir(parents=True)
    binary = root / build.BINARY
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert build.built_server(tmp_path) is None  # no stamp: an interrupted copy is not trusted
    (root / "build.json").write_text(json.dumps({"version": build.binding_version()}))
    monkeypatch.setattr(build, "fetch_source", lambda *a: pytest.fail("fetched again"))
    assert build.ensure_llama_server(tmp_path) == binary
    # another llama-cpp-python version (or another CPU) is another folder: built afresh
    assert build.build_dir(tmp_path, "0.0.1") != root and build.cpu_tag() in root.name


def _sdist(path, version, members):
    with tarfile.open(path, "w:gz") as tar:
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(f"llama_cpp_python-{version}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_only_the_vendored_llama_cpp_of_the_right_version_is_extracted(tmp_path):
    good = _sdist(tmp_path / "good.tar.gz", "9.9.9", {"vendor/llama.cpp/CMakeLists.txt": "x",
                                                       "vendor/llama.cpp/tools/server/server.cpp": "y",
                                                       "llama_cpp/__init__.py": "z"})
    build.extract_llama_cpp(good, "9.9.9", tmp_path / "src")
    assert (tmp_path / "src" / "tools" / "server" / "server.cpp").read_text() == "y"
    assert not (tmp_path / "src" / "llama_cpp").exists()
    with pytest.raises(BackendError, match="not the llama-cpp-python 1.0.0 source"):
        build.extract_llama_cpp(good, "1.0.0", tmp_path / "other")
    no_server = _sdist(tmp_path / "bad.tar.gz", "9.9.9", {"vendor/llama.cpp/CMakeLists.txt": "x"})
    with pytest.raises(BackendError, match="no .*tools/server"):
        build.extract_llama_cpp(no_server, "9.9.9", tmp_path / "bad")


def test_on_a_cpu_listing_amx_the_tile_configuration_is_fixed_or_the_kernel_left_out(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "cpu_lists_amx", lambda: False)
    plain_dir = build.build_dir(tmp_path, "1.0")
    assert build.cmake_flags() == build.CMAKE_FLAGS
    monkeypatch.setattr(build, "cpu_lists_amx", lambda: True)
    source = tmp_path / "src"
    kernel = source / build.AMX_KERNEL_SOURCE
    kernel.parent.mkdir(parents=True)
    kernel.write_text(GGML_TILE_CONFIG_INIT)
    assert build.fix_amx_tile_config(source)
    assert build.fix_amx_tile_config(source)  # an interrupted build finds it fixed, and fixes nothing twice
    text = kernel.read_text()
    assert text.count(build.LOAD_TILE_CONFIG) == 1 and text.index('"m"(tc)') < text.index(build.LOAD_TILE_CONFIG)
    assert build.cmake_flags(amx_kernel_fixed=True) == build.CMAKE_FLAGS
    # a kernel whose source changed shape is not patched blind: the AMX kernel is left out
    kernel.write_text(GGML_TILE_CONFIG_INIT.replace("&tc", "&config"))
    assert not build.fix_amx_tile_config(source)
    assert not build.fix_amx_tile_config(tmp_path / "no-source")
    flags = build.cmake_flags()
    assert "-DGGML_NATIVE=ON" in flags  # every other native instruction stays
    assert f"-DCMAKE_C_FLAGS={build.NO_AMX}" in flags and f"-DCMAKE_CXX_FLAGS={build.NO_AMX}" in flags
    # a binary built earlier with the broken configuration, or without the kernel, is never reused
    assert build.build_dir(tmp_path, "1.0") != plain_dir


# ggml's tile configuration (ggml-cpu/amx/mmq.cpp, ggml_tile_config_init), as llama.cpp ships it
GGML_TILE_CONFIG_INIT = """
#include <immintrin.h>
#include <cstdint>
struct tile_config_t {
    uint8_t palette_id = 0;
    uint8_t start_row = 0;
    uint8_t reserved_0[14] = {0};
    uint16_t colsb[16] = {0};
    uint8_t rows[16] = {0};
};
__attribute__((noinline)) void ggml_tile_config_init(void) {
    alignas(64) tile_config_t tc = {};
    tc.palette_id = 1;
    tc.start_row = 0;
    tc.rows[0] = 8;   tc.colsb[0] = 64;
    tc.rows[1] = 8;   tc.colsb[1] = 64;
    tc.rows[2] = 16;  tc.colsb[2] = 32;
    tc.rows[3] = 16;  tc.colsb[3] = 32;
    tc.rows[4] = 16;  tc.colsb[4] = 64;
    tc.rows[5] = 16;  tc.colsb[5] = 64;
    tc.rows[6] = 16;  tc.colsb[6] = 64;
    tc.rows[7] = 16;  tc.colsb[7] = 64;

    _tile_loadconfig(&tc);
}
"""

# Fills the stack with junk, then loads ggml's configuration and uses a tile, as the server's first
# batched multiply does; exit 0 only if the configuration loaded was the one written.
AMX_PROGRAM = """
#include <unistd.h>
#include <sys/syscall.h>
__attribute__((noinline)) void dirty_stack() { volatile char junk[1024]; for (int i = 0; i < 1024; i++) junk[i] = 0x5a; }
int main() {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) return 3;
    dirty_stack();
    ggml_tile_config_init();
    alignas(64) int32_t c[16 * 16];
    _tile_zero(4);
    _tile_stored(4, c, 64);
    _tile_release();
    return c[0] == 0 ? 0 : 4;
}
"""


@pytest.mark.skipif(not build.cpu_lists_amx() or not shutil.which("g++"), reason="needs a CPU with AMX and g++")
def test_the_fixed_tile_configuration_loads_where_ggml_as_shipped_faults(tmp_path):
    def run(kernel_source):
        (tmp_path / "amx.cpp").write_text(kernel_source + AMX_PROGRAM)
        subprocess.run(["g++", "-O3", "-march=native", "-mamx-tile", "-mamx-int8", str(tmp_path / "amx.cpp"),
                        "-o", str(tmp_path / "amx")], check=True, capture_output=True)
        return subprocess.run([str(tmp_path / "amx")]).returncode

    kernel = tmp_path / "src" / build.AMX_KERNEL_SOURCE
    kernel.parent.mkdir(parents=True)
    kernel.write_text(GGML_TILE_CONFIG_INIT)
    assert build.fix_amx_tile_config(tmp_path / "src")
    assert run(kernel.read_text()) == 0
    shipped = run(GGML_TILE_CONFIG_INIT)  # faults (SIGSEGV) with GCC 12's intrinsic; a fixed compiler loads it
    assert shipped in (0, -signal.SIGSEGV)


def test_the_server_built_here_keeps_llama_cpps_extra_buffers_whatever_the_binding_s_build_survives(tmp_path,
                                                                                                    monkeypatch):
    """Its AMX kernel is fixed or left out (above), so the binding's probe, which fails on a CPU with
    AMX (the binding's own build has the broken configuration), does not take AMX and repacked
    weights from it; a binary of the user's own is still judged by the probe."""
    from specchat import loading
    from specchat.backends import llamacpp

    monkeypatch.setattr(llamacpp, "extra_buffers_work", lambda *a, **k: False)
    assert loading.server_extra_buffers_work(None, tmp_path / "m.gguf")
    assert not loading.server_extra_buffers_work("my/llama-server", tmp_path / "m.gguf")
