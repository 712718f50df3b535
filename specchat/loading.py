"""From a profile to a running backend."""
from __future__ import annotations

from backends.base import Backend, Sampling
from specchat.profiles import Profile


def sampling_of(profile: Profile) -> Sampling:
    s = profile.sampling
    return Sampling(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed, max_tokens=s.max_tokens)


def load_backend(profile: Profile) -> Backend:
    """Load the model a profile names. Raises BackendError (one line) for anything the user can fix."""
    if profile.backend == "openai":
        from backends.openai import OpenAIBackend

        return OpenAIBackend.from_profile(profile)
    if profile.backend == "llamacpp":
        from backends.llamacpp import LlamaCppBackend

        return LlamaCppBackend.from_profile(profile)
    if profile.method != "none":
        from backends.speculative.backend import SpeculativeBackend

        return SpeculativeBackend.from_profile(profile)
    from backends.native.engine import TorchBackend

    return TorchBackend.from_profile(profile)


def messages_for(profile: Profile, history: list[dict], system: str | None = None) -> list[dict]:
    """The conversation as the model sees it: the system prompt (if any) first."""
    system = system if system is not None else profile.system
    return ([{"role": "system", "content": system}] if system else []) + list(history)
