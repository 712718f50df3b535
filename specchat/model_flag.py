"""`-m FILE` / `--model FILE` on every command: a GGUF file or a checkpoint directory, run without a
profile written for it, as llama-cli, ollama and `llm` take a model.

- Alone, `-m` builds a profile in memory from the default profile's settings (context, sampling,
  compiled decode graphs: profiles.DEFAULT_PROFILE) with the speculation any model allows, and
  registers it for this process by the file's name (profiles.add_session_profile), so that the
  chat, its picker and the REPL find it as they find a file's.
- With `-p PROFILE`, that profile runs with its model replaced by FILE (what `--set model=FILE`
  does): `-m` wins over the profile's own `model:`.
- The engine: specchat's own (native) where it runs the file as it is stored
  (backends/native/gguf_support.py), else llama.cpp in-process, target-only; never a float32
  copy of blocks the native engine has no kernel for. `engine_line` says which and why.

Bad input (no such path, a directory without config.json, a file that is not GGUF, a truncated
one) is one BackendError line, exit 2, before anything loads.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from specchat.backends.base import BackendError
from specchat.profiles import DEFAULT_PROFILE, Profile, add_session_profile, get_profile, load_profiles

FIX = "give -m a .gguf file or a checkpoint directory (config.json + *.safetensors)"
BROKEN_FIX = "download it again, or give -m another file"

# What `-m` alone drafts with. There is no method that runs prompt lookup and suffix decoding side by
# side (`lookup` and `suffix.first` sit only in front of a model drafter, and not both), and suffix
# decoding covers prompt lookup's ground: it matches the text's tail in the conversation as prompt
# lookup does, and in the memory of earlier replies too. So: suffix decoding, as the shipped
# `smollm2-suffix` sets it (depth 7; the `suffix:` defaults are that profile's values).
SUFFIX = {"method": "suffix", "depth": 7}
# A checkpoint directory whose own MTP layers the native engine runs (profiles/*-mtp.yaml,
# backends/native/mtp.py): the MTP layers, one token a pass (as MiMo's and Qwen3.5-0.8B's shipped
# profiles), with suffix decoding as above in front of them (`suffix.first`: it drafts where it is
# confident, the MTP layers where it has nothing). A GGUF whose converter kept the model's MTP (nextn)
# layers (qwen35, qwen35moe, glm4moe: backends/native/gguf_mtp.py) takes the same.
MTP = {"method": "mtp", "depth": 1, "suffix": {"first": SUFFIX["depth"]}}

# names of the profiles -m built or changed in this process -> why their engine is what it is,
# where the profile alone does not say it (the native engine's refusal of a file)
_FLAGGED: dict[str, Optional[str]] = {}


def add_model_flag(p, note: str = "") -> None:
    p.add_argument("-m", "--model", metavar="FILE",
                   help="a GGUF file or a checkpoint directory (config.json + safetensors): alone, run it with "
                        "the default speculation (no profile written); with -p, in place of that profile's model"
                        + note)


def forget() -> None:
    """Start a command afresh: no -m profiles from an earlier one (tests run many in one process)."""
    from specchat.profiles import clear_session_profiles

    _FLAGGED.clear()
    clear_session_profiles()


# ------------------------------------------------------------------ the file
def model_path(text: str) -> tuple[Path, str]:
    """FILE as an absolute path (symlinks kept: a hub cache's names are links) and its kind, gguf
    or hf_dir; BackendError (one line) for anything the user must fix."""
    from specchat.backends.weight_files import GGUF_MAGIC, check_gguf

    path = Path(os.path.abspath(Path(text).expanduser()))
    if not path.exists():
        raise BackendError(f"-m {text}: no such file or directory; {FIX}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            hint = (f"it holds {ggufs[0].name}: give -m that file" if len(ggufs) == 1 else
                    f"it holds {len(ggufs)} .gguf files: give -m one of them" if ggufs else FIX)
            raise BackendError(f"{path}: no config.json, so not a checkpoint directory (Hugging Face layout: "
                               f"config.json + *.safetensors); {hint}")
        if not any(path.glob("*.safetensors")):
            raise BackendError(f"{path}: config.json but no *.safetensors files; the native engine reads "
                               f"safetensors checkpoints (convert the weights, or {FIX})")
        return path, "hf_dir"
    try:
        with path.open("rb") as f:
            head = f.read(4)
    except OSError as e:
        raise BackendError(f"{path}: cannot read it ({e.strerror or e}); {FIX}") from None
    if head != GGUF_MAGIC:
        starts = f"it starts with {head!r}, a GGUF with {GGUF_MAGIC!r}" if head else "it is empty"
        raise BackendError(f"{path}: not a GGUF file ({starts}); {FIX}")
    check_gguf(path, BROKEN_FIX)  # truncated, or a header that does not fit the file: BrokenWeightFile
    if path.suffix.lower() != ".gguf":
        raise BackendError(f"{path}: a GGUF file, but specchat takes GGUF files by their .gguf ending; "
                           f"rename it to {path.name}.gguf")
    return path, "gguf"


def builtin_mtp(path: Path) -> bool:
    """Whether the checkpoint directory carries MTP layers in a layout the native engine runs, on a
    main model it runs (read from config.json and the safetensors headers; nothing loaded). The
    head itself is read and checked as it loads (speculative/backend.py check_builtin_mtp)."""
    from specchat.backends.native.mtp import detect_layout, unsupported_main_model
    from specchat.backends.weight_files import safetensors_header, safetensors_index
    from specchat.weight_memory import read_config

    config = read_config(path)
    n_layers = config.get("text_config", config).get("num_hidden_layers")
    if not isinstance(n_layers, int) or unsupported_main_model(config):
        return False
    if (path / "model.safetensors.index.json").exists():
        names = set(safetensors_index(path))
    else:
        names = {n for f in sorted(path.glob("*.safetensors")) for n in safetensors_header(f).tensors}
    prefix = "model.language_model." if any(n.startswith("model.language_model.") for n in names) else "model."
    return detect_layout(names, n_layers, prefix) is not None


def gguf_mtp(path: Path) -> bool:
    """Whether the GGUF (one the native engine runs) carries MTP (nextn) layers: from its index."""
    from specchat import paths
    from specchat.backends.native.gguf_mtp import no_mtp_reason

    return no_mtp_reason(path, paths.cache_dir()) is None


def _native_refusal(path: Path, kind: str) -> Optional[str]:
    from specchat import paths
    from specchat.backends.native.gguf_support import native_refusal

    return native_refusal(path, paths.cache_dir()) if kind == "gguf" else None


def _llamacpp_refusal(path: Path, native: Optional[str]) -> None:
    """A GGUF that goes to llama.cpp and that llama.cpp cannot read either: one line, now."""
    from specchat.backends.llamacpp import load_refusal

    why = load_refusal(path)
    if why and native:
        raise BackendError(f"{path}: {native}, and llama.cpp does not load it either ({why})")
    if why:
        raise BackendError(f"{path}: llama.cpp does not load it ({why}); {FIX}")


# ------------------------------------------------------------------ the profile
def profile_for_model(text: str, name: Optional[str] = None) -> Profile:
    """The profile `-m FILE` runs: built from the default's settings (`name` None) or profile
    `name` with its model replaced; registered for this process under its own name."""
    from specchat.weight_memory import check_weight_files

    path, kind = model_path(text)
    profile = _built(path, kind) if name is None else _replaced(get_profile(name), path, kind)
    check_weight_files(profile)  # a drafter's files too, and every shard's header
    add_session_profile(profile)
    return profile


def _built(path: Path, kind: str) -> Profile:
    known = load_profiles()
    base = known.get(DEFAULT_PROFILE)
    name = path.stem if kind == "gguf" else path.name
    name = name if name not in known.profiles else f"{name}@file"  # never in place of a profile file's
    common = dict(name=name, description=f"{path} (-m), on the default profile's settings", model=str(path),
                  dtype=base.dtype, device=base.device, threads=base.threads, context=base.context,
                  context_policy=base.context_policy, system=base.system, sampling=base.sampling)
    refusal = _native_refusal(path, kind)
    if refusal:
        _llamacpp_refusal(path, refusal)
        _FLAGGED[name] = refusal
        return Profile(**common, backend="llamacpp")
    _FLAGGED[name] = None
    # compiled decode graphs as the default profile has them, for a GGUF whose model has them; a
    # checkpoint directory decodes eagerly, as every shipped checkpoint profile does (mixture-of-experts
    # and sliding-window models have no compiled graphs yet, and a hybrid's only in bfloat16 or int4:
    # compile: true would refuse them)
    from specchat import paths
    from specchat.backends.native.gguf_support import native_compiles

    compiles = kind == "gguf" and native_compiles(path, paths.cache_dir())
    own_mtp = builtin_mtp(path) if kind == "hf_dir" else gguf_mtp(path)
    return Profile(**common, backend="torch", compile=base.compile and compiles,
                   speculative=MTP if own_mtp else SUFFIX)


def _replaced(profile: Profile, path: Path, kind: str) -> Profile:
    where = f"-m with -p {profile.name}"
    if profile.remote:
        raise BackendError(f"{where}: the profile runs on a server (backend openai), whose model is the name the "
                           "server serves; leave out -m (or --set model=NAME)")
    if profile.backend in ("llamacpp", "llamaserver"):
        if kind != "gguf":
            raise BackendError(f"{where}: the profile runs llama.cpp, which reads GGUF files, and {path} is a "
                               "checkpoint directory; leave out -p to run it on the native engine")
        if profile.backend == "llamacpp":
            _llamacpp_refusal(path, None)
    elif (refusal := _native_refusal(path, kind)) is not None:
        raise BackendError(f"{path}: {refusal}; profile '{profile.name}' runs the native engine: leave out -p to "
                           "run the file on llama.cpp target-only, or pick a llamacpp profile (-p smollm2-llamacpp)")
    changed = profile.with_overrides({"model": str(path)})
    name = f"{profile.name}@{path.stem if kind == 'gguf' else path.name}"
    _FLAGGED[name] = None
    return changed.model_copy(update={"name": name})


# ------------------------------------------------------------------ the engine, in words
_DRAFTERS = {"draft": "the draft model", "eagle3": "the EAGLE-3 head", "dflash": "the DFlash drafter",
             "dspark": "the DSpark drafter",
             "replayssm": "the recurrent drafter", "mtp": "the MTP head"}


def speculation_words(profile: Profile) -> str:
    """How a profile drafts, in words ("suffix decoding: lookup in the conversation and earlier
    replies, up to 7 a pass")."""
    s = profile.speculative
    if s.method == "none":
        return "target-only"
    where = "the conversation and earlier replies" if s.suffix.history else "the conversation"
    if s.method == "suffix":
        return f"suffix decoding: lookup in {where}, up to {s.depth} a pass"
    if s.method == "ngram":
        return f"prompt lookup, up to {s.depth} a pass"
    own = "the file's own MTP (nextn) layers" if profile.model.lower().endswith(".gguf") else \
        "the checkpoint's own MTP layers"
    drafter = own if s.method == "mtp" and not s.drafter else f"{_DRAFTERS[s.method]} {Path(s.drafter).name}"
    words = f"{drafter} ({s.depth} a pass)"
    if s.lookup:
        return f"prompt lookup first (up to {s.lookup}), else {words}"
    if s.suffix.first:
        return f"suffix decoding from {where} first (up to {s.suffix.first}), else {words}"
    return words


def engine_of(profile: Profile) -> tuple[str, str]:
    """(engine, why): which engine runs the profile, and what it runs it with or why that one."""
    if profile.backend == "torch":
        return "specchat (native)", speculation_words(profile)
    if profile.backend == "llamacpp":
        return "llama.cpp target-only", _FLAGGED.get(profile.name) or f"profile '{profile.name}' sets backend: llamacpp"
    if profile.backend == "llamaserver":
        return "llama-server (llama.cpp)", profile.method_label
    return f"a server at {profile.server.base_url}", profile.method_label


def engine_line(profile: Profile) -> str:
    engine, why = engine_of(profile)
    return f"engine: {engine} · {why}"


def flagged_engine_line(profile: Profile) -> Optional[str]:
    """The engine line of a profile -m built or changed (None for any other: its name says it)."""
    return engine_line(profile) if profile.name in _FLAGGED else None
