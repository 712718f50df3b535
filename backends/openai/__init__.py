"""OpenAI-compatible servers (vLLM, SGLang, llama-server, llama-cpp-python) as a backend."""

from .backend import OpenAIBackend

__all__ = ["OpenAIBackend"]
