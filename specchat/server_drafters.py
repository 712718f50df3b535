"""The drafter file a `backend: llamaserver` profile hands llama-server (`--spec-draft-model`).

A GGUF drafter goes as it is. A specchat drafter directory (a draft model, an EAGLE-3 head, a
DFlash or DSpark drafter) is exported once into the cache, in the layout llama.cpp loads for the method
(backends/llamaserver/to_gguf.py, drafter_export.py), and reused: the file is named by the
directory's weights (path, size, time), the target and the exporter's version, so a retrained
drafter or another target gets a fresh one. So `-p smollm2-eagle3` and `-p
smollm2-llamaserver-eagle3` run one head's weights, each on its own engine.
"""
from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Optional

from specchat import paths
from specchat.backends.base import BackendError
from specchat.backends.speculative.dspark import is_dspark_config
from specchat.models import local_model
from specchat.profiles import Profile

# method -> (what the directory holds, the cache folder); bump LAYOUT when an export changes
EXPORTS = {"draft": ("a specchat draft model directory", "drafter-gguf"),
           "eagle3": ("an EAGLE-3 head directory", "eagle3-gguf"),
           "dflash": ("a DFlash drafter directory", "dflash-gguf"),
           "dspark": ("a DSpark drafter directory", "dspark-gguf")}
LAYOUT = "1"


def server_drafter(profile: Profile) -> Optional[Path]:
    """The GGUF llama-server drafts with for the profile's method (None: the method needs none)."""
    spec = profile.speculative
    if spec.method == "mtp" and not spec.drafter:
        check_mtp_layers(local_model(profile.model, profile.base_dir)[0])
        return None  # draft-mtp without a file: the target's own MTP layers
    if spec.method in ("none", "ngram"):
        return None
    path, kind = local_model(spec.drafter, profile.base_dir)
    if kind == "gguf":
        return path
    if spec.method not in EXPORTS:
        raise BackendError(f"speculative.drafter {spec.drafter!r} is a {kind}; llama-server's {spec.method} takes a "
                           "GGUF file")
    what, folder = EXPORTS[spec.method]
    if kind != "hf_dir":
        raise BackendError(f"speculative.drafter {spec.drafter!r} is a {kind}; llama-server takes a GGUF file or "
                           f"{what} (exported once)")
    target, _ = local_model(profile.model, profile.base_dir)
    return exported(spec.method, path, target, folder)


def check_mtp_layers(target: Path) -> None:
    """llama-server's draft-mtp runs the target's own MTP (`nextn`) layers; a GGUF without them
    stops the server with "model doesn't contain MTP layers" in its log. Said here in one line."""
    from specchat.backends.weight_files import gguf_reader

    reader = gguf_reader(target)
    if not any(".nextn." in t.name for t in reader.tensors):
        arch = reader.fields["general.architecture"].contents() if "general.architecture" in reader.fields else "?"
        raise BackendError(f"method mtp on llama-server runs the target's own MTP (nextn) layers, and {target.name} "
                           f"({arch}) has none; name an MTP sidecar GGUF in speculative.drafter, or use a target "
                           "that carries them (e.g. Qwen3.5, GLM-4.5 GGUFs)")


def exported(method: str, drafter_dir: Path, target: Path, folder: str) -> Path:
    from specchat.backends.derived_files import derived_path

    weights = next(iter(sorted(drafter_dir.glob("*.safetensors"))), drafter_dir / "config.json")
    if not weights.exists():
        raise BackendError(f"{drafter_dir}: no config.json or *.safetensors; not a drafter directory")
    versions = [importlib.metadata.version("gguf"), str(target)] + ([LAYOUT] if method != "draft" else [])
    dest = derived_path(paths.cache_dir(), folder, weights, *versions, suffix=".gguf")
    if dest.exists():
        return dest
    if method == "draft":
        from specchat.backends.llamaserver.to_gguf import draft_model_to_gguf

        return draft_model_to_gguf(drafter_dir, target, dest)
    from specchat.backends.llamaserver.drafter_export import export

    return export(method, drafter_dir, target, dest)


def detect_method(drafter_dir: Path) -> str:
    """Which of EXPORTS a drafter directory is, from its config.json (one line when none)."""
    import json

    try:
        config = json.loads((Path(drafter_dir) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise BackendError(f"{drafter_dir}: no readable config.json ({e}); a drafter is a directory with "
                           "config.json and its weights") from None
    arch = config.get("architectures") or []
    if is_dspark_config(config):
        return "dspark"
    if "DFlashDraftModel" in arch or "dflash_config" in config:
        return "dflash"
    if (config.get("draft_vocab_size") or config.get("speculators_model_type") == "eagle3"
            or any("Eagle3" in a for a in arch)):
        return "eagle3"
    if "specchat_mtp" in config:
        raise BackendError(f"{drafter_dir}: an MTP head, which llama.cpp has no file layout for: its draft-mtp runs "
                           "the MTP (nextn) layers inside a target whose architecture has them (qwen35, glm4moe, "
                           "...), and a llama-architecture target has none")
    if config.get("model_type") == "llama" and not any(k.startswith("specchat_") for k in config):
        return "draft"
    raise BackendError(f"{drafter_dir}: not a draft model, EAGLE-3 head, DFlash or DSpark drafter (architectures "
                       f"{arch or 'unset'}); llama.cpp layouts exist here for those four")


def export_drafter(drafter_dir: Path, target: Profile, dest: Path, method: Optional[str] = None) -> tuple[str, Path]:
    """(method, file): the drafter directory written to `dest` in llama.cpp's layout for its
    method, for the target of profile `target` (a GGUF: its tokenizer goes into the file)."""
    drafter_dir = Path(drafter_dir)
    method = method or detect_method(drafter_dir)
    if method not in EXPORTS:
        raise BackendError(f"--method {method}: llama.cpp layouts exist here for {', '.join(EXPORTS)}")
    path, kind = local_model(target.model, target.base_dir)
    if kind != "gguf":
        raise BackendError(f"profile '{target.name}': its model {target.model!r} is a {kind}; the export copies the "
                           "tokenizer of the target's GGUF (llama-server runs GGUF targets): name a GGUF profile")
    if method == "draft":
        from specchat.backends.llamaserver.to_gguf import draft_model_to_gguf

        return method, draft_model_to_gguf(drafter_dir, path, dest)
    from specchat.backends.llamaserver.drafter_export import export

    return method, export(method, drafter_dir, path, dest)

