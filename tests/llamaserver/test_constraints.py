"""Constraints reaching a real llama-server on loopback, with its own speculation on and off: by
the llamaserver backend's native endpoint and by the openai backend's OpenAI-compatible one."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from specchat.backends.base import BackendError, Constraint, Request, Sampling, run_to_summary
from specchat.backends.llamaserver.flags import speculation_args
from specchat.backends.openai import OpenAIBackend
from specchat.backends.openai.constraints import LLAMA_SERVER
from tests.test_gbnf import ASK, PERSON, schema

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the first test may build llama-server

YES_NO = Constraint("grammar", 'root ::= ("yes" | "no") "."', "yes-no.gbnf")
# a reply this model writes with repeats in it, so that prompt lookup drafts under the constraint
LIST = {"type": "object", "properties": {"colours": {"type": "array", "items": {"type": "string"},
                                                      "minItems": 6, "maxItems": 6}},
        "required": ["colours"]}
COPY = [{"role": "user", "content": "List these colours as JSON: red, red, blue, blue, red, blue."}]


@pytest.fixture(scope="module", params=["target-only", "ngram"])
def server(start, request):
    return start(speculation_args("ngram", depth=3, lookup=2) if request.param == "ngram" else ())


@pytest.mark.parametrize("sampling", [Sampling(max_tokens=80), Sampling(temperature=0.9, seed=5, max_tokens=80)],
                         ids=["greedy", "sampled"])
def test_a_schema_constrained_reply_is_json_that_validates(server, sampling):
    out = run_to_summary(server.stream(Request(messages=ASK, constraint=schema()), sampling))
    assert out.stop_reason == "eos"
    jsonschema.validate(json.loads(out.text), PERSON)
    free = run_to_summary(server.stream(Request(messages=ASK), sampling))
    with pytest.raises(json.JSONDecodeError):
        json.loads(free.text)  # prose when free: the JSON is the constraint's doing


def test_the_constraint_holds_while_the_server_speculates(server):
    out = run_to_summary(server.stream(Request(messages=COPY, constraint=schema(LIST, "colours.json")),
                                       Sampling(max_tokens=80)))
    jsonschema.validate(json.loads(out.text), LIST)
    if server.settings.spec:
        assert out.drafts > 0 and out.accepted_tokens > 0  # drafts were verified under the grammar


def test_a_grammar_holds_the_reply_to_its_language(server):
    for seed in (1, 2):
        out = run_to_summary(server.stream(Request(messages=ASK, constraint=YES_NO),
                                           Sampling(temperature=1.0, seed=seed, max_tokens=10)))
        assert out.text in ("yes.", "no.")


def test_a_regex_reaches_it_as_the_grammar_of_its_language(server):
    phone = Constraint("regex", r"\+\d{2} \d{3} \d{4}", "--regex")
    for sampling in (Sampling(max_tokens=20), Sampling(temperature=1.0, seed=4, max_tokens=20)):
        out = run_to_summary(server.stream(Request(messages=ASK, constraint=phone), sampling))
        assert re.fullmatch(phone.text, out.text), out.text


@pytest.mark.parametrize("constraint, says", [
    (Constraint("grammar", "root ::= foo", "bad.gbnf"), "llama-server refused the constraint bad.gbnf: .*grammar"),
    (Constraint("json_schema", '{"type": "frob"}', "frob.json"),
     "llama-server refused the constraint frob.json: .*unrecognized type frob"),
    (Constraint("regex", r"(a)\1", "--regex"), "--regex: llama-server takes no regular expression with a backref"),
])
def test_what_llama_server_refuses_is_one_line_and_it_serves_on(server, constraint, says):
    with pytest.raises(BackendError, match=says) as e:
        run_to_summary(server.stream(Request(messages=ASK, constraint=constraint), Sampling(max_tokens=8)))
    assert "\n" not in str(e.value)
    assert run_to_summary(server.stream(Request(messages=ASK), Sampling(max_tokens=3))).tokens == 3


def test_the_openai_backend_knows_llama_server_and_sends_it_the_schema(server):
    backend = OpenAIBackend(server.process.base_url + "/v1", "smollm2")  # metrics auto: it asks which server
    try:
        assert backend.server_kind() == (LLAMA_SERVER, None)
        out = run_to_summary(backend.stream(Request(messages=ASK, constraint=schema()), Sampling(max_tokens=80)))
        jsonschema.validate(json.loads(out.text), PERSON)
        out = run_to_summary(backend.stream(Request(messages=ASK, constraint=YES_NO), Sampling(max_tokens=8)))
        assert out.text in ("yes.", "no.")
        with pytest.raises(BackendError, match="llama-server refused the constraint frob.json"):
            run_to_summary(backend.stream(Request(messages=ASK, constraint=Constraint(
                "json_schema", '{"type": "frob"}', "frob.json")), Sampling(max_tokens=8)))
    finally:
        backend.close()
