"""The real llama-server, built once per machine (minutes on 2 cores, then cached), on the real
default model."""
from __future__ import annotations

import pytest

from specchat import paths


@pytest.fixture(scope="session")
def server_binary():
    from specchat.backends.llamaserver.build import ensure_llama_server

    return ensure_llama_server(paths.cache_dir())


@pytest.fixture(scope="session")
def start(server_binary, default_gguf, tmp_path_factory):
    """Start a LlamaServerBackend on the default model; every one started is closed at the end."""
    from specchat.backends.llamaserver.backend import LlamaServerBackend, LlamaServerSettings

    logs = tmp_path_factory.mktemp("llama-server-logs")
    started = []

    def start_one(spec=(), binary=None, **settings):
        settings = LlamaServerSettings(default_gguf, "smollm2", **{"context": 2048, "threads": 2, **settings},
                                       spec=tuple(spec))
        backend = LlamaServerBackend(binary or server_binary, settings, log=logs / f"server-{len(started)}.log")
        started.append(backend)
        return backend

    yield start_one
    for backend in started:
        backend.close()
