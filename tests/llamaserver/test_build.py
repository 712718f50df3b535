"""Building llama-server: what is checked before minutes are spent, and what is reused after."""
from __future__ import annotations

import io
import json
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


def test_on_a_cpu_listing_amx_ggml_amx_kernel_is_left_out_and_the_build_is_its_own(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "cpu_lists_amx", lambda: False)
    plain_dir, plain_flags = build.build_dir(tmp_path, "1.0"), build.cmake_flags()
    assert plain_flags == build.CMAKE_FLAGS
    monkeypatch.setattr(build, "cpu_lists_amx", lambda: True)
    flags = build.cmake_flags()
    assert "-DGGML_NATIVE=ON" in flags  # every other native instruction stays
    assert f"-DCMAKE_C_FLAGS={build.NO_AMX}" in flags and f"-DCMAKE_CXX_FLAGS={build.NO_AMX}" in flags
    # a binary built with the AMX kernel earlier is never reused
    assert build.build_dir(tmp_path, "1.0") != plain_dir
