"""From a profile to a running backend: the one place where a profile becomes engine arguments.

Engines take paths and settings; this module resolves the profile's model and drafter (named
models pulled, hub ids downloaded, paths relative to the profile's file), picks the backend, and
hands each engine only what it needs.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from specchat import paths
from specchat.backends.base import Backend, BackendError, Sampling
from specchat.backends.weight_files import BrokenWeightFile
from specchat.models import local_model, models_dir
from specchat.profiles import Profile


def sampling_of(profile: Profile) -> Sampling:
    s = profile.sampling
    return Sampling(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed, max_tokens=s.max_tokens)


def load_backend(profile: Profile, progress: Optional[Callable[[str], None]] = None,
                 background: bool = False, start_background: bool = True) -> Backend:
    """Load the model a profile names. Raises BackendError (one line) for anything the user can fix,
    and before loading anything when the weights alone would not fit the device's free memory.
    `progress`: where news of a long first-time step goes (building llama-server; default stderr).
    `background`: compiled graphs not stored yet are prepared by a background process while the
    engine answers on eager passes (a chat); else they are ready before this returns (a measurement).
    `start_background`: start that process now (a chat, whose user is typing) rather than at the
    caller's `prepare_in_background` (a one-shot reply, which it would slow)."""
    from specchat.weight_memory import check_fits

    try:
        check_fits(profile)
        if profile.backend == "openai":
            return load_server(profile)
        if profile.backend == "llamacpp":
            return load_llamacpp(profile)
        if profile.backend == "llamaserver":
            return load_llamaserver(profile, progress)
        backend = (load_speculative(profile, background) if profile.method != "none"
                   else load_target(profile, compile_in_background=background))
    except BrokenWeightFile as e:
        if e.path.resolve().parent == models_dir().resolve():  # a named model `specchat pull` fetched
            raise BrokenWeightFile(e.path, e.problem, "run `specchat pull --force` to fetch it again") from None
        raise
    if start_background:
        backend.prepare_in_background()
    return backend


# What decides a torch target's arithmetic: two profiles equal in these run the same engine.
ARITHMETIC_FIELDS = ("backend", "model", "dtype", "device", "threads", "context", "compile")


def same_arithmetic(spec: Profile, ref: Profile) -> bool:
    """Whether `ref` is `spec`'s own target in the same arithmetic (a reference of the same engine)."""
    return ref.method == "none" and all(getattr(ref, f) == getattr(spec, f) for f in ARITHMETIC_FIELDS)


def load_reference(spec: Profile, spec_backend: Backend, ref: Profile, load=None) -> Backend:
    """The target-only reference of a run: on the run's own loaded weights, with a KV cache of its
    own (backends/native/shared_weights.py), when it is the same model in the same arithmetic and
    the engine allows it; else loaded as an engine of its own with `load` (load_backend)."""
    from specchat.backends.native.engine import TorchBackend
    from specchat.backends.native.shared_weights import SharedWeights, unshareable_reason

    target = spec_backend if isinstance(spec_backend, TorchBackend) else getattr(spec_backend, "target", None)
    if same_arithmetic(spec, ref) and isinstance(target, TorchBackend) and unshareable_reason(target) is None:
        return SharedWeights(target)
    return (load or load_backend)(ref)


def target_path(profile: Profile) -> tuple[Path, str]:
    """The target's weights on this machine and their kind (gguf or hf_dir)."""
    return local_model(profile.model, profile.base_dir)


def load_target(profile: Profile, **changes):
    """The profile's target on the torch engine, target-only (`changes`: engine settings to replace,
    e.g. context=...)."""
    from specchat.backends.native.engine import TorchBackend

    path, kind = target_path(profile)
    settings = dict(precision=profile.dtype, device=profile.device, threads=profile.threads,
                    context=profile.context, compile=profile.compile, cache_dir=paths.cache_dir(),
                    rollback=profile.speculative.rollback)
    return TorchBackend(path, kind, **(settings | changes))


def speculative_settings(profile: Profile):
    """The profile's `speculative:` section for the engine, its drafter resolved to a local path
    (an MTP profile without a drafter uses the target's own checkpoint)."""
    from specchat.backends.speculative.backend import SpeculativeSettings

    spec = profile.speculative
    drafter, kind = (local_model(spec.drafter, profile.base_dir) if spec.drafter
                     else target_path(profile) if spec.method == "mtp" else (None, "auto"))
    from specchat.backends.speculative.suffix import SuffixSettings

    sx = spec.suffix
    suffix = SuffixSettings(min_prob=sx.min_prob, factor=sx.factor, max_match=sx.max_match, memory=sx.history,
                            memory_replies=sx.history_replies, memory_tokens=sx.history_tokens)
    return SpeculativeSettings(
        method=spec.method, drafter=drafter, drafter_kind=kind, depth=spec.depth, acceptance=spec.acceptance,
        ngram_min=spec.ngram_min, ngram_max=spec.ngram_max, lookup=spec.lookup, copy_depth=spec.copy_depth,
        strict=spec.strict, adaptive=spec.adaptive, mtp_hidden=spec.mtp_hidden, suffix_first=sx.first, suffix=suffix)


def load_speculative(profile: Profile, background: bool = False):
    from specchat.backends.speculative.backend import SpeculativeBackend, check_builtin_mtp

    settings = speculative_settings(profile)
    try:
        if settings.method == "mtp" and not profile.speculative.drafter:
            # before loading a big target for a head it cannot use
            check_builtin_mtp(settings.drafter, paths.cache_dir())
        return SpeculativeBackend.load(load_target(profile, compile_in_background=background), settings)
    except BrokenWeightFile:
        raise  # names the file already
    except BackendError as e:
        raise BackendError(f"profile '{profile.name}': {e}") from None


def load_llamacpp(profile: Profile):
    from specchat.backends.llamacpp import LlamaCppBackend

    path, kind = target_path(profile)
    if kind != "gguf":
        raise BackendError(f"profile '{profile.name}': backend llamacpp needs a GGUF file, "
                           f"but model '{profile.model}' is a {kind}; use backend: torch")
    return LlamaCppBackend(path, context=profile.context, threads=profile.threads, seed=profile.sampling.seed,
                           cache_dir=paths.cache_dir())


def load_server(profile: Profile):
    from specchat.backends.openai import OpenAIBackend
    from specchat.backends.openai.backend import api_key_from_env

    server = profile.server
    where = f"profile '{profile.name}'"
    backend = OpenAIBackend(server.base_url, profile.model, api_key=api_key_from_env(server.api_key_env, where),
                            api_key_env=server.api_key_env, timeout_s=server.timeout_s, metrics=server.metrics,
                            logprobs=server.logprobs, stream=server.stream, context=profile.context, where=where)
    try:
        backend.check_server()
    except BaseException:
        backend.close()
        raise
    return backend


def load_transformers(profile: Profile):
    """transformers' own model of the profile's target (a reference row in `specchat bench`)."""
    from specchat.backends.hf_reference import TransformersBackend

    path, _ = target_path(profile)
    dtype = "float32" if profile.dtype == "auto" else profile.dtype
    return TransformersBackend(path, dtype=dtype, threads=profile.threads, context=profile.context,
                               cache_dir=paths.cache_dir())


def messages_for(profile: Profile, history: list[dict], system: str | None = None) -> list[dict]:
    """The conversation as the model sees it: the system prompt (if any) first."""
    system = system if system is not None else profile.system
    return ([{"role": "system", "content": system}] if system else []) + list(history)


def load_llamaserver(profile: Profile, progress=None):
    """The llama-server specchat starts for a profile (building the binary first if this machine has
    none): the profile's GGUF with llama.cpp's speculation for its method."""
    from specchat.backends.llamaserver.backend import LlamaServerBackend, LlamaServerSettings
    from specchat.backends.llamaserver.build import ensure_llama_server
    from specchat.backends.llamaserver.flags import speculation_args
    from specchat.server_drafters import server_drafter

    where = f"profile '{profile.name}'"
    path, kind = target_path(profile)
    if kind != "gguf":
        raise BackendError(f"{where}: backend llamaserver needs a GGUF file, but model '{profile.model}' is a {kind}")
    config, spec = profile.server_config, profile.speculative
    try:
        if config.binary:
            binary = profile.resolve_path(config.binary)
        else:
            binary = ensure_llama_server(paths.cache_dir(), progress or _say)
        args = speculation_args(spec.method, ngram_type=config.ngram_type, drafter=server_drafter(profile),
                                depth=spec.depth, lookup=spec.ngram_max, p_min=config.p_min)
    except BackendError as e:
        raise BackendError(f"{where}: {e}") from None
    if spec.method != "none":
        args += config.spec_args
    settings = LlamaServerSettings(
        path, profile.model, context=profile.context, threads=profile.threads, spec=tuple(args),
        extra=tuple(config.args), port=config.port, startup_timeout_s=config.startup_timeout_s,
        timeout_s=config.timeout_s, repack=server_extra_buffers_work(config.binary, path), slots=config.slots)
    log = paths.cache_dir() / "llama-server" / "logs" / f"{profile.name.replace(':', '-')}.log"
    return LlamaServerBackend(binary, settings, log=log, where=where)


def server_extra_buffers_work(user_binary, gguf: Path) -> bool:
    """Whether llama-server may use llama.cpp's extra buffers (AMX, repacked weights). The server
    specchat builds has ggml's AMX kernel fixed or left out (llamaserver/build.py), so they work; a
    binary of the user's own is trusted as far as the installed binding's build survives them."""
    from specchat.backends.llamacpp import extra_buffers_work

    return True if not user_binary else extra_buffers_work(gguf, paths.cache_dir())


def _say(line: str) -> None:
    import sys

    print(f"specchat: {line}", file=sys.stderr, flush=True)
