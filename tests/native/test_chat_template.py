"""Chat templates rendered without transformers (backends/native/chat_template.py): the text equals
transformers' `apply_chat_template` for every released model's template that llama.cpp collects
(`models/templates/*.jinja` of its vendored source), over several conversations, errors included."""
from __future__ import annotations

import jinja2
import pytest
from transformers import AutoTokenizer

from specchat import paths
from specchat.backends.native import chat_template
from specchat.backends.native.tokenizer import gguf_tokenizer_dir

from .convert import templates_dir

CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo 👋\n\tWhat is 2+2?"}],
    [{"role": "user", "content": "Write `print(1)`"}, {"role": "assistant", "content": "print(1)"},
     {"role": "user", "content": "  Now in C, with <b>tags</b> & \"quotes\"  "}],
    [{"role": "system", "content": "You answer in JSON."}, {"role": "user", "content": "a"},
     {"role": "assistant", "content": "{\"a\": 1}"}, {"role": "user", "content": "b"},
     {"role": "assistant", "content": ""}, {"role": "user", "content": "c"}],
]


@pytest.fixture(scope="module")
def reference(default_gguf):
    """transformers' tokenizer of the default model, whose named special tokens both sides are given."""
    return AutoTokenizer.from_pretrained(str(gguf_tokenizer_dir(default_gguf, paths.cache_dir())))


def _transformers(tok, template, chat):
    try:
        return tok.apply_chat_template(chat, chat_template=template, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # a template that refuses a chat must refuse it the same way
        return type(e)


def _ours(tok, template, chat):
    try:
        return chat_template.render(template, chat, tok.special_tokens_map)
    except Exception as e:  # a template that refuses a chat must refuse it the same way
        return type(e)


def test_every_collected_template_renders_as_transformers_renders_it(reference):
    templates = sorted(templates_dir().glob("*.jinja"))
    assert len(templates) >= 40
    rendered = 0
    for path in templates:
        template = path.read_text(encoding="utf-8")
        if not all(chat_template.renders_alone(template, chat) for chat in CHATS):
            continue
        for chat in CHATS:
            want = _transformers(reference, template, chat)
            assert _ours(reference, template, chat) == want, (path.name, chat)
            rendered += isinstance(want, str)
    assert rendered >= 100  # most of them render most chats; the rest raise the same error both ways


def test_what_it_does_not_cover_is_left_to_transformers():
    assert not chat_template.renders_alone("{% generation %}{{ m }}{% endgeneration %}", CHATS[0])
    assert not chat_template.renders_alone("{{ messages }}", [{"role": "user", "content": "a", "reasoning": "b"}])
    assert not chat_template.renders_alone("{{ messages }}", [{"role": "user", "content": [{"type": "text"}]}])
    assert chat_template.renders_alone("{{ messages }}", CHATS[3])


def test_the_sandbox_holds():
    with pytest.raises(jinja2.exceptions.SecurityError):
        chat_template.render("{{ ''.__class__.__mro__ }}", CHATS[0], {})
    with pytest.raises(jinja2.exceptions.SecurityError):
        chat_template.render("{% set ns = namespace(_x=1) %}", CHATS[0], {})
    with pytest.raises(jinja2.TemplateError, match="only user"):
        chat_template.render("{{ raise_exception('only user') }}", CHATS[0], {})
