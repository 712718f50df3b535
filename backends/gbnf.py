"""A constraint as llama.cpp takes it: a GBNF grammar.

llama.cpp (the `llamacpp` backend, llama-server, llama-cpp-python's server) constrains replies by
GBNF; a JSON schema becomes GBNF by llama-cpp-python's own converter (the Python port of llama.cpp's
json-schema-to-grammar), a regular expression by regex_gbnf.py (that port's regex translation
mangles escapes: `\\d{3}` comes out as the literal text `\\d\\d\\d`).
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import sys
import tempfile

from .base import BackendError, Constraint

# Where a regular expression constraint does run, for the line that refuses one.
REGEX_ENGINES = "the torch engine, vLLM or SGLang"


def constraint_name(constraint: Constraint) -> str:
    """How one-line messages name a constraint: where it came from, else what it is."""
    return constraint.origin or {"json_schema": "the JSON schema", "regex": "the regular expression",
                                 "grammar": "the grammar"}[constraint.kind]


def schema_object(constraint: Constraint) -> dict:
    """The JSON schema of a json_schema constraint, parsed (refused in one line if it is not a JSON object)."""
    try:
        schema = json.loads(constraint.text)
    except json.JSONDecodeError as e:
        raise BackendError(f"{constraint_name(constraint)}: the JSON schema is not valid JSON "
                           f"(line {e.lineno} column {e.colno}: {e.msg})") from None
    if not isinstance(schema, dict):
        raise BackendError(f"{constraint_name(constraint)}: a JSON schema is a JSON object, "
                           f"not a {type(schema).__name__}")
    return schema


def refuse_regex(constraint: Constraint, engine: str, what: str = "") -> BackendError:
    return BackendError(f"{constraint_name(constraint)}: {engine} takes no regular expression{what} (a grammar "
                        f"cannot say it); such a regex runs on {REGEX_ENGINES}")


def regex_gbnf(constraint: Constraint, engine: str) -> str:
    import re

    from .regex_gbnf import Unsupported, regex_to_gbnf

    try:
        return regex_to_gbnf(constraint.text)
    except re.error as e:
        raise BackendError(f"{constraint_name(constraint)}: {engine} takes a regular expression as a grammar "
                           f"converted from Python's regex syntax, which does not read this one ({e})") from None
    except (Unsupported, RecursionError) as e:
        raise refuse_regex(constraint, engine, f" with {e}" if str(e) else "") from None


@functools.lru_cache(maxsize=32)
def gbnf_of(constraint: Constraint, engine: str = "llama.cpp") -> str:
    """The constraint as GBNF text for llama.cpp. Refused in one line: a regular expression a
    grammar cannot say, a schema llama.cpp's converter cannot translate, a grammar that is not GBNF."""
    if constraint.kind == "regex":
        return regex_gbnf(constraint, engine)
    if constraint.kind == "json_schema":
        from llama_cpp.llama_grammar import json_schema_to_gbnf

        schema_object(constraint)  # not JSON at all: said as such
        try:
            return json_schema_to_gbnf(constraint.text)
        except Exception as e:  # the converter asserts, or trips over a malformed schema
            reason = " ".join(str(e).split()) or type(e).__name__
            raise BackendError(f"{constraint_name(constraint)}: {engine} cannot turn this JSON schema into a "
                               f"grammar: {reason[:200]}") from None
    if "::=" not in constraint.text:
        raise BackendError(f"{constraint_name(constraint)}: {engine} reads GBNF grammars (`root ::= ...`), and "
                           "this is not one (a Lark grammar runs on the torch engine)")
    return constraint.text


@contextlib.contextmanager
def _stderr_into(sink):
    """llama.cpp writes its grammar parser's complaints straight to fd 2, and its log lines through
    llama-cpp-python's callback to sys.stderr: catch both in `sink` (a text file)."""
    sys.stderr.flush()
    fd, stream = os.dup(2), sys.stderr
    try:
        os.dup2(sink.fileno(), 2)
        sys.stderr = sink
        yield
    finally:
        sys.stderr = stream
        sink.flush()
        os.dup2(fd, 2)
        os.close(fd)


def check_gbnf(text: str, constraint: Constraint, vocab=None, engine: str = "llama.cpp") -> None:
    """Parse `text` with llama.cpp's own grammar parser (against a model's vocabulary, where there is
    one) and refuse it in one line if it does not parse: llama.cpp would otherwise take a null sampler
    (llama-cpp-python's server crashes on one)."""
    import llama_cpp

    with tempfile.TemporaryFile(mode="w+") as sink:
        with _stderr_into(sink):
            sampler = llama_cpp.llama_sampler_init_grammar(vocab, text.encode("utf-8"), b"root")
        sink.seek(0)
        said = [line.strip() for line in sink.read().splitlines()
                if line.strip() and line.strip() != "failed to parse grammar" and "::=" not in line]
    if not sampler:
        if said:
            why = said[0].partition("error parsing grammar:")[2].strip() or said[0]
        elif not re.search(r"^\s*root\s*::=", text, re.M):
            why = "it has no `root` rule (llama.cpp starts from `root ::= ...`)"
        else:
            why = "it does not parse"
        raise BackendError(f"{constraint_name(constraint)}: {engine} could not parse the grammar: {why}")
    llama_cpp.llama_sampler_free(sampler)


@functools.lru_cache(maxsize=32)
def checked_gbnf(constraint: Constraint, engine: str) -> str:
    """gbnf_of, parsed by llama.cpp here first (for a server that takes GBNF and falls over on a bad one)."""
    text = gbnf_of(constraint, engine)
    check_gbnf(text, constraint, engine=engine)
    return text
