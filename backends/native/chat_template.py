"""A model's chat template rendered exactly as transformers' `apply_chat_template` renders it, without
importing transformers (0.6-0.7 s of every start; scripts/bench_start.py re-measures the start).

The environment is transformers' own, rebuilt from its public description: Jinja's immutable sandbox
(templates are code from the Hub), `trim_blocks` and `lstrip_blocks`, the loop-control extension, a
`tojson` filter that does not escape HTML, and the globals `raise_exception`, `strftime_now`, `dict`
and `namespace` (one that refuses underscore names). The variables are the conversation, the
tokenizer's named special tokens and `add_generation_prompt`, with `tools` and `documents` unset.

What this does not cover is left to transformers by `renders_alone`: templates with `{% generation %}`
blocks (an extension for assistant masks) and messages other than plain role/content strings (which
transformers first rewrites: reasoning fields aliased, rich objects made plain).
tests/native/test_chat_template.py holds the rendering equal to transformers' on every template the
tests know.
"""
from __future__ import annotations

import json
import re
from datetime import datetime
from functools import lru_cache
from typing import Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


def renders_alone(template: str, messages: Sequence[dict]) -> bool:
    """Whether `render` gives transformers' text for these messages without transformers' help."""
    if _GENERATION_BLOCK.search(template):
        return False
    return all(isinstance(m, dict) and set(m) <= {"role", "content"}
               and all(type(v) is str for v in m.values()) for m in messages)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _PlainDict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, and nothing else of the type."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's `namespace`, refusing underscore-prefixed attributes (a way out of the sandbox)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")


@lru_cache(maxsize=8)
def compile_template(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_PlainDict(),
                       namespace=_Namespace)
    return env.from_string(template)


def render(template: str, messages: Sequence[dict], special_tokens: dict[str, str],
           add_generation_prompt: bool = True) -> str:
    """The prompt text for `messages` (each a plain role/content dict: see `renders_alone`)."""
    chat = [dict(m) for m in messages]  # the template gets copies, as transformers gives it
    return compile_template(template).render(messages=chat, tools=None, documents=None,
                                             add_generation_prompt=add_generation_prompt, **special_tokens)
