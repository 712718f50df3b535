"""specchat: terminal chat for local LLMs with speculative decoding you can see and verify."""

__version__ = "0.1.0"
