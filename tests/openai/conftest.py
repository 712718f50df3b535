import pytest

from tests.openai.servers import LlamaCppServer, ReplayServer


@pytest.fixture(scope="session")
def llama_server(default_gguf, tmp_path_factory):
    """llama-cpp-python's OpenAI-compatible server on the default GGUF, for the whole session."""
    server = LlamaCppServer(default_gguf, tmp_path_factory.mktemp("server"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def replay():
    server = ReplayServer()
    yield server
    server.stop()
