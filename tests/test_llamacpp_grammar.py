"""The grammar applied after the choice (backends/llamacpp_grammar.py) on the real default model:
greedy replies token for token those of llama-cpp-python's own grammar-first sampler, sampled ones
inside the grammar, the grammar-rejected path taken, and nothing left patched after a reply."""
import json
import threading

import jsonschema
import llama_cpp
import pytest

from specchat.backends import llamacpp_grammar
from specchat.backends.base import Constraint, Request, Sampling, run_to_summary
from specchat.backends.gbnf import gbnf_of
from specchat.backends.llamacpp import LlamaCppBackend
from specchat.paths import cache_dir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # the grammar-first reference is slow on a busy machine

CONTACT = {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string"},
                                            "phone": {"type": "string"}}, "required": ["name", "email", "phone"]}
ORDER = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {
    "product": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1}}, "required": ["product", "quantity"]}},
    "total": {"type": "number"}}, "required": ["items", "total"]}
CASES = [
    (CONTACT, "Extract name, email and phone as JSON: Kenji Watanabe, kenji@tanaka.example, 03-5555-1234."),
    (CONTACT, "Who wrote this? -- Maria Lopez (maria@northwind.example, +1 415 555 0199)"),
    (ORDER, "Order as JSON: 2 notebooks; total 12."),
]


@pytest.fixture(scope="module")
def backend(default_gguf):
    b = LlamaCppBackend(default_gguf, context=1024, threads=2, cache_dir=cache_dir())
    yield b
    b.close()


def grammar_first(backend, messages, text, max_tokens):
    """llama-cpp-python's own way: the grammar first in its sampler chain, greedy."""
    out = []
    for token in backend.llm.generate(backend.tokenize_chat(messages), temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                      repeat_penalty=1.0, grammar=llama_cpp.LlamaGrammar.from_string(text)):
        if backend._is_eog(token) or len(out) >= max_tokens:
            break
        out.append(token)
    return out


@pytest.fixture
def rechosen(monkeypatch):
    """How many tokens the grammar rejected and the chain chose again, over the test."""
    count = [0]
    sample = llamacpp_grammar.GrammarAfterChoice.sample

    def counted(self, idx):
        before = self.rechosen
        token = sample(self, idx)
        count[0] += self.rechosen - before
        return token
    monkeypatch.setattr(llamacpp_grammar.GrammarAfterChoice, "sample", counted)
    return count


@pytest.mark.parametrize("schema, prompt", CASES)
def test_greedy_replies_are_the_grammar_first_samplers_token_for_token(backend, schema, prompt, rechosen):
    constraint = Constraint("json_schema", json.dumps(schema), "s.json")
    messages = [{"role": "user", "content": prompt}]
    out = run_to_summary(backend.stream(Request(messages=messages, constraint=constraint), Sampling(max_tokens=120)))
    assert out.stop_reason == "eos"
    jsonschema.validate(json.loads(out.text), schema)
    assert out.token_ids == grammar_first(backend, messages, gbnf_of(constraint), 120)
    assert rechosen[0] > 0  # the model's own first choice broke the grammar somewhere: both paths ran


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sampled_replies_keep_the_grammar(backend, seed):
    # bounded strings: a free draw at temperature 1 may otherwise write a string until max_tokens
    schema = {**CONTACT, "properties": {k: {"type": "string", "maxLength": 24} for k in CONTACT["properties"]}}
    constraint = Constraint("json_schema", json.dumps(schema), "contact.json")
    out = run_to_summary(backend.stream(Request(messages=[{"role": "user", "content": CASES[0][1]}],
                                                constraint=constraint),
                                        Sampling(temperature=1.0, top_p=0.95, seed=seed, max_tokens=160)))
    assert out.stop_reason == "eos"
    jsonschema.validate(json.loads(out.text), schema)


def test_nothing_stays_patched_after_a_reply_ends_or_is_cut_short(backend):
    constraint = Constraint("grammar", 'root ::= "a"+', "a.gbnf")
    ask = [{"role": "user", "content": "Say a."}]
    stream = backend.stream(Request(messages=ask, constraint=constraint), Sampling(max_tokens=50))
    next(stream)
    stream.close()  # a reply given up on after one token
    assert "sample" not in vars(backend.llm)
    cancel = threading.Event()
    cancel.set()
    run_to_summary(backend.stream(Request(messages=ask, constraint=constraint), Sampling(max_tokens=5), cancel))
    assert "sample" not in vars(backend.llm)
    free = run_to_summary(backend.stream(Request(messages=ask), Sampling(max_tokens=8)))
    assert set(free.text) != {"a"}  # no grammar left on the next, unconstrained reply
