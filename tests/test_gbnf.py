"""Constraints as llama.cpp takes them (backends/gbnf.py), and the `llamacpp` backend applying
them to the real default model's replies."""
import json

import jsonschema
import pytest

from specchat.backends.base import BackendError, Constraint, Request, Sampling, run_to_summary
from specchat.backends.gbnf import gbnf_of, schema_object
from specchat.backends.llamacpp import LlamaCppBackend
from specchat.paths import cache_dir

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                                           "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
# a prompt this model answers in prose when free: JSON comes from the constraint alone
ASK = [{"role": "user", "content": "Ann is 31 and lives in Oslo. Tell me about her in one sentence."}]


def schema(obj=PERSON, origin="person.json") -> Constraint:
    return Constraint("json_schema", json.dumps(obj), origin)


def test_a_json_schema_becomes_gbnf_with_its_properties():
    text = gbnf_of(schema())
    assert text.startswith("age-kv ::=") or "root ::=" in text
    assert '"\\"name\\""' in text and '"\\"Oslo\\""' in text


def test_a_gbnf_grammar_passes_as_it_is():
    grammar = 'root ::= "yes" | "no"'
    assert gbnf_of(Constraint("grammar", grammar, "yn.gbnf")) == grammar


@pytest.mark.parametrize("constraint, says", [
    (Constraint("regex", r"(a)\1", "--regex"), r"--regex: llama.cpp takes no regular expression with a "
                                              r"backreference \(a grammar cannot say it\); such a regex runs on "
                                              r"the torch engine, vLLM or SGLang"),
    (Constraint("regex", r"\p{L}+", "--regex"), r"--regex: llama.cpp takes a regular expression as a grammar "
                                               r"converted from Python's regex syntax, which does not read this one"),
    (Constraint("grammar", 'start: "a"', "g.lark"), "g.lark: llama.cpp reads GBNF grammars"),
    (Constraint("json_schema", '{"type": "frob"}', "f.json"), "f.json: llama.cpp cannot turn this JSON schema into a "
                                                            "grammar: Unrecognized schema"),
    (Constraint("json_schema", '{"type": ', "x.json"), r"x.json: the JSON schema is not valid JSON \(line 1 column 10"),
    (Constraint("json_schema", '[1, 2]', "l.json"), "l.json: a JSON schema is a JSON object, not a list"),
])
def test_what_llamacpp_cannot_take_is_one_line_naming_it(constraint, says):
    with pytest.raises(BackendError, match=says) as e:
        gbnf_of(constraint)
    assert "\n" not in str(e.value)


def test_schema_object_parses_the_schema():
    assert schema_object(schema()) == PERSON


@pytest.fixture(scope="module")
def llamacpp(default_gguf):
    backend = LlamaCppBackend(default_gguf, context=1024, threads=2, cache_dir=cache_dir())
    yield backend
    backend.close()


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [Sampling(max_tokens=80), Sampling(temperature=0.9, seed=7, max_tokens=80)],
                         ids=["greedy", "sampled"])
def test_a_schema_constrained_reply_is_json_that_validates(llamacpp, sampling):
    out = run_to_summary(llamacpp.stream(Request(messages=ASK, constraint=schema()), sampling))
    assert out.stop_reason == "eos"  # the grammar completes, then only the end of sequence is allowed
    jsonschema.validate(json.loads(out.text), PERSON)
    free = run_to_summary(llamacpp.stream(Request(messages=ASK), sampling))
    with pytest.raises(json.JSONDecodeError):
        json.loads(free.text)


@pytest.mark.slow
def test_a_grammar_holds_the_reply_to_its_language(llamacpp):
    grammar = Constraint("grammar", 'root ::= ("yes" | "no") "."', "yn.gbnf")
    for seed in (1, 2, 3):
        out = run_to_summary(llamacpp.stream(Request(messages=ASK, constraint=grammar),
                                             Sampling(temperature=1.0, seed=seed, max_tokens=10)))
        assert out.text in ("yes.", "no.") and out.stop_reason == "eos"


@pytest.mark.slow
@pytest.mark.parametrize("grammar, says", [('root ::= foo', "Undefined rule identifier 'foo'"),
                                           ('start ::= "a"', "it has no `root` rule")])
def test_a_grammar_llamacpp_cannot_parse_is_one_line_and_the_backend_goes_on(llamacpp, grammar, says):
    with pytest.raises(BackendError, match=f"bad.gbnf: llama.cpp could not parse the grammar: .*{says}"):
        llamacpp.stream(Request(messages=ASK, constraint=Constraint("grammar", grammar, "bad.gbnf")), Sampling())
    assert run_to_summary(llamacpp.stream(Request(messages=ASK), Sampling(max_tokens=3))).tokens == 3
