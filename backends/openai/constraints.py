"""A constraint in the request fields each server takes.

Every OpenAI-compatible server named here takes a JSON schema as `response_format` (type
`json_schema`), except llama-cpp-python's server, whose `response_format` knows only `json_object`
and quietly falls back to any JSON when it cannot convert a schema: it gets the schema as llama.cpp
GBNF in its `grammar` field instead, converted here where a failure is said. Regular expressions
and grammars go in each server's own fields: vLLM's `structured_outputs` (`guided_regex` /
`guided_grammar` before 0.10.2), SGLang's `regex` / `ebnf`, llama-server's `grammar` (GBNF, a
regex converted to it here). A
server whose kind is unknown gets only what the OpenAI API defines; anything else is refused in
one line rather than sent where it would be ignored.
"""
from __future__ import annotations

import re
from typing import Optional

from ..base import BackendError, Constraint
from ..gbnf import checked_gbnf, constraint_name, gbnf_of, schema_object

LLAMA_SERVER, LLAMA_CPP_PYTHON, VLLM, SGLANG, OPENAI = "llama-server", "llama-cpp-python", "vllm", "sglang", "openai"
# the first vLLM whose requests take `structured_outputs` (guided_* went in 0.12)
VLLM_STRUCTURED_OUTPUTS = (0, 10, 2)


def schema_name(constraint: Constraint) -> str:
    """`response_format.json_schema.name`: letters, digits, _ and - only, at most 64 (OpenAI's rule)."""
    stem = re.sub(r"\.json$", "", constraint.origin.replace("\\", "/").rsplit("/", 1)[-1])
    name = re.sub(r"[^A-Za-z0-9_-]+", "_", stem).strip("_")[:64]
    return name or "reply"


def response_format(constraint: Constraint) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {
        "name": schema_name(constraint), "schema": schema_object(constraint), "strict": True}}}


def version_tuple(text: Optional[str]) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", text or "")[:3])


def constraint_fields(constraint: Constraint, server: str, *, version: Optional[str] = None,
                      where: str = "the server") -> dict:
    """The request fields that carry `constraint` to a server of kind `server` (of `version`, for vLLM)."""
    kind = constraint.kind
    if server == LLAMA_CPP_PYTHON:
        return {"grammar": checked_gbnf(constraint, "llama-cpp-python's server")}
    if kind == "json_schema":
        return response_format(constraint)
    if server == LLAMA_SERVER:  # a regex as GBNF: llama-server has no regex field
        return {"grammar": gbnf_of(constraint, "llama-server")}
    if server == VLLM:
        field = "regex" if kind == "regex" else "grammar"
        if version and version_tuple(version) < VLLM_STRUCTURED_OUTPUTS:
            return {f"guided_{field}": constraint.text}
        return {"structured_outputs": {field: constraint.text}}
    if server == SGLANG:
        return {"regex" if kind == "regex" else "ebnf": constraint.text}
    what = "regular expression" if kind == "regex" else "grammar"
    raise BackendError(f"{constraint_name(constraint)}: {where} is not known to take a {what} constraint (the OpenAI "
                       "API has JSON schemas only); if it is vLLM, SGLang or llama-server, say so in "
                       "server.metrics")


def refusal(constraint: Constraint, where: str, server: str, said: str) -> BackendError:
    """A server's 4xx answer to a constrained request: one line naming the server, the constraint and its words."""
    label = {LLAMA_SERVER: "llama-server", LLAMA_CPP_PYTHON: "llama-cpp-python's server", VLLM: "vLLM",
             SGLANG: "SGLang"}.get(server, "the server")
    who = label if where == label else f"{where}: {label}"
    return BackendError(f"{who} refused the constraint {constraint_name(constraint)}: {said}")
