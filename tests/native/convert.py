"""llama.cpp's own Hugging Face -> GGUF converter (`convert_hf_to_gguf.py`), as people make the GGUFs
they download, for tests that prove an architecture against transformers on the same weights.

The converter is in the source of the installed llama-cpp-python (its sdist vendors llama.cpp, the
same version the `llamacpp` backend runs): fetched once with pip, as backends/llamaserver/build.py
fetches it, and only the converter's files (`convert_hf_to_gguf.py`, `conversion/`, `gguf-py/`)
kept in specchat's cache directory.

Two changes are made to it, in the process that runs it: llama.cpp identifies a BPE tokenizer's
pre-tokenizer by the hash of a test string's tokens, and the tiny test tokenizer (tiny.py) is none
of the released tokenizers it knows, so it is named "default", as tiny.make_gguf names it; and
GLM's vocabulary writer looks up GLM's own special tokens ([gMASK], <|user|>, ...), which the tiny
tokenizer lacks, so a tiny GLM's vocabulary is written as any other GPT-2 style BPE's.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from specchat import paths
from specchat.backends.llamaserver.build import PACKAGE, binding_version

PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")

RUN = """
import sys
sys.path[:0] = [{root!r}, {root!r} + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
base.TextModel._set_vocab_glm = base.TextModel._set_vocab_gpt2
import convert_hf_to_gguf
for argv in {jobs!r}:
    sys.argv = ["convert_hf_to_gguf.py", *argv]
    convert_hf_to_gguf.main()
"""


def converter_dir() -> Path:
    """The converter of the installed llama-cpp-python's llama.cpp, fetched on first use."""
    return vendored("llama-convert", PARTS)


def templates_dir() -> Path:
    """llama.cpp's collection of released models' chat templates (`models/templates/*.jinja`)."""
    return vendored("llama-templates", ("models/templates/",)) / "models" / "templates"


def vendored(name: str, parts: tuple[str, ...]) -> Path:
    """The files under `parts` of the installed llama-cpp-python's vendored llama.cpp, fetched once into
    specchat's cache directory (`name`/version)."""
    version = binding_version()
    dest = paths.cache_dir() / name / version
    if (dest / parts[0]).exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:",
                               "--disable-pip-version-check", "-q", "-d", tmp, f"{PACKAGE}=={version}"],
                              capture_output=True, text=True)
        archives = list(Path(tmp).glob("*.tar.gz"))
        if done.returncode != 0 or len(archives) != 1:
            raise RuntimeError(f"pip could not fetch the {PACKAGE}=={version} source:\n{done.stderr[-2000:]}")
        archive = archives[0]
        prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
        with tarfile.open(archive, "r:gz") as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)
                       and m.name[len(prefix):].startswith(parts) and m.isfile()]
            for m in members:
                m.name = m.name[len(prefix):]
            tar.extractall(Path(tmp) / "x", members=members, filter="data")
        os.replace(Path(tmp) / "x", dest)  # atomic: another session may be fetching it too
    return dest


def convert(jobs: list[tuple[Path, Path, str]]) -> list[Path]:
    """(checkpoint directory, output file, outtype: f32, f16, bf16 or q8_0) each converted by the
    converter, all in one process (its imports take most of a conversion's time)."""
    argv = [[str(src), "--outfile", str(out), "--outtype", outtype] for src, out, outtype in jobs]
    done = subprocess.run([sys.executable, "-c", RUN.format(root=str(converter_dir()), jobs=argv)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-3000:]}")
    return [out for _, out, _ in jobs]
