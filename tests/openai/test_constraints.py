"""Constraints in each server's own request fields (backends/openai/constraints.py), and the
openai backend sending them to real servers on loopback."""
import json

import jsonschema
import pytest

from specchat.backends.base import BackendError, Constraint, Request, Sampling, run_to_summary
from specchat.backends.openai import OpenAIBackend
from specchat.backends.openai.constraints import (LLAMA_CPP_PYTHON, LLAMA_SERVER, OPENAI, SGLANG, VLLM,
                                                  constraint_fields, schema_name)
from tests.openai.servers import MODEL
from tests.test_gbnf import ASK, PERSON, schema

REGEX = Constraint("regex", r"\d{3}-\d{4}", "--regex")
GRAMMAR = Constraint("grammar", 'root ::= ("yes" | "no") "."', "grammars/yes-no.gbnf")


def test_a_json_schema_is_response_format_on_every_server_but_llama_cpp_python():
    want = {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                       "strict": True}}}
    for server in (LLAMA_SERVER, VLLM, SGLANG, OPENAI):
        assert constraint_fields(schema(), server) == want
    # its response_format knows only json_object, and falls back to any JSON where a schema fails to convert
    fields = constraint_fields(schema(), LLAMA_CPP_PYTHON)
    assert list(fields) == ["grammar"] and "root ::=" in fields["grammar"]


def test_regexes_and_grammars_go_in_each_servers_own_fields():
    assert constraint_fields(REGEX, VLLM) == {"structured_outputs": {"regex": REGEX.text}}
    assert constraint_fields(GRAMMAR, VLLM, version="0.11.0") == {"structured_outputs": {"grammar": GRAMMAR.text}}
    assert constraint_fields(REGEX, VLLM, version="0.9.2") == {"guided_regex": REGEX.text}
    assert constraint_fields(GRAMMAR, VLLM, version="0.10.1.1") == {"guided_grammar": GRAMMAR.text}
    assert constraint_fields(REGEX, SGLANG) == {"regex": REGEX.text}
    assert constraint_fields(GRAMMAR, SGLANG) == {"ebnf": GRAMMAR.text}
    assert constraint_fields(GRAMMAR, LLAMA_SERVER) == {"grammar": GRAMMAR.text}
    assert constraint_fields(GRAMMAR, LLAMA_CPP_PYTHON) == {"grammar": GRAMMAR.text}
    # llama.cpp's servers have no regex field: the regex goes as the grammar of its language
    want = {"grammar": 'root ::= ([0-9]){3} "-" ([0-9]){4}\n'}
    assert constraint_fields(REGEX, LLAMA_SERVER) == want == constraint_fields(REGEX, LLAMA_CPP_PYTHON)


@pytest.mark.parametrize("constraint, server, says", [
    (Constraint("regex", r"(?=a)b", "--regex"), LLAMA_SERVER,
     r"--regex: llama-server takes no regular expression with a lookahead or lookbehind"),
    (Constraint("regex", r"(a)\1", "--regex"), LLAMA_CPP_PYTHON,
     r"--regex: llama-cpp-python's server takes no regular expression with a backreference"),
    (REGEX, OPENAI, "--regex: profile 'p' is not known to take a regular expression constraint .*server.metrics"),
    (GRAMMAR, OPENAI, "grammars/yes-no.gbnf: profile 'p' is not known to take a grammar constraint"),
    (Constraint("grammar", 'start: "a"', "g.lark"), LLAMA_SERVER, "g.lark: llama-server reads GBNF grammars"),
    # llama-cpp-python's server crashes on a grammar llama.cpp cannot parse: it is parsed here first
    (Constraint("grammar", "root ::= foo", "g.gbnf"), LLAMA_CPP_PYTHON,
     "g.gbnf: llama-cpp-python's server could not parse the grammar: Undefined rule identifier 'foo'"),
])
def test_what_a_server_does_not_take_is_refused_before_it_is_sent(constraint, server, says):
    with pytest.raises(BackendError, match=says):
        constraint_fields(constraint, server, where="profile 'p'")


def test_the_schema_name_comes_from_its_file():
    assert schema_name(Constraint("json_schema", "{}", "/home/me/My Schemas/invoice v2.json")) == "invoice_v2"
    assert schema_name(Constraint("json_schema", "{}", "")) == "reply"


def test_the_fields_go_in_the_request_a_named_server_gets(replay):
    for kind, server, field in (("vllm", "vllm", "structured_outputs"), ("sglang", "sglang", "regex")):
        backend = OpenAIBackend(replay.base_url(kind), "Qwen/Qwen3-8B", metrics=server)
        run_to_summary(backend.stream(Request(messages=ASK, constraint=REGEX), Sampling(max_tokens=8)))
        sent = replay.requests[-1][2]
        assert sent[field] == ({"regex": REGEX.text} if server == "vllm" else REGEX.text)
        run_to_summary(backend.stream(Request(messages=ASK, constraint=schema()), Sampling(max_tokens=8)))
        assert replay.requests[-1][2]["response_format"]["json_schema"]["schema"] == PERSON
        run_to_summary(backend.stream(Request(messages=ASK), Sampling(max_tokens=8)))
        assert not {"response_format", field} & set(replay.requests[-1][2])  # no constraint: nothing sent


@pytest.mark.slow
def test_llama_cpp_python_s_server_is_recognised_and_holds_the_reply_to_the_schema(llama_server):
    backend = OpenAIBackend(llama_server.base_url, MODEL, logprobs=False)
    backend.check_server()
    assert backend.server_kind() == (LLAMA_CPP_PYTHON, None)
    out = run_to_summary(backend.stream(Request(messages=ASK, constraint=schema()), Sampling(max_tokens=80)))
    jsonschema.validate(json.loads(out.text), PERSON)
    free = run_to_summary(backend.stream(Request(messages=ASK), Sampling(max_tokens=40)))
    with pytest.raises(json.JSONDecodeError):
        json.loads(free.text)  # this prompt gets prose when free
    out = run_to_summary(backend.stream(Request(messages=ASK, constraint=GRAMMAR), Sampling(max_tokens=8)))
    assert out.text in ("yes.", "no.")


class LikeServer:
    """A loopback server that answers the identification probes as one server kind does (`routes`:
    GET path -> JSON), and chat completions with one streamed word, or with `refuse` as an HTTP 400
    in the OpenAI error format (vLLM's and SGLang's)."""

    def __init__(self, routes: dict, refuse: str | None = None):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.bodies: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, payload, kind="application/json"):
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path in routes:
                    self._send(200, routes[self.path])
                elif self.path == "/v1/models":
                    self._send(200, {"data": [{"id": MODEL}]})
                else:
                    self._send(404, {"detail": "Not Found"})

            def do_POST(self):
                outer.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                if refuse:
                    self._send(400, {"object": "error", "message": refuse, "type": "BadRequestError", "code": 400})
                    return
                chunk = {"choices": [{"index": 0, "delta": {"content": "555-0199"}, "finish_reason": "stop"}]}
                self._send(200, f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode(), "text/event-stream")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("routes, kind, field", [
    ({"/version": {"version": "0.9.2"}}, (VLLM, "0.9.2"), {"guided_regex": REGEX.text}),
    ({"/version": {"version": "0.11.1"}}, (VLLM, "0.11.1"), {"structured_outputs": {"regex": REGEX.text}}),
    ({"/get_server_info": {"version": "0.4.6"}, "/version": {"version": "0.4.6"}}, (SGLANG, None),
     {"regex": REGEX.text}),
])
def test_an_unnamed_server_is_asked_what_it_is_and_gets_its_own_fields(routes, kind, field):
    server = LikeServer(routes)
    try:
        backend = OpenAIBackend(server.base_url, MODEL, logprobs=False)  # server.metrics: auto
        out = run_to_summary(backend.stream(Request(messages=ASK, constraint=REGEX), Sampling(max_tokens=8)))
        assert out.text == "555-0199" and backend.server_kind() == kind
        assert {k: server.bodies[-1][k] for k in field} == field
    finally:
        server.stop()


def test_a_server_that_knows_nothing_of_regexes_is_refused_a_regex_before_it_is_sent():
    server = LikeServer({})
    try:
        backend = OpenAIBackend(server.base_url, MODEL, logprobs=False)
        with pytest.raises(BackendError, match="--regex: server .* is not known to take a regular expression"):
            backend.stream(Request(messages=ASK, constraint=REGEX), Sampling(max_tokens=8))
        assert backend.server_kind() == (OPENAI, None) and not server.bodies
        run_to_summary(backend.stream(Request(messages=ASK, constraint=schema()), Sampling(max_tokens=8)))
        assert server.bodies[-1]["response_format"]["type"] == "json_schema"  # a schema is the OpenAI API's own
    finally:
        server.stop()


def test_a_server_that_refuses_the_constraint_is_one_line_naming_it_and_what_it_said():
    said = "grammar error: unexpected token at line 1"
    server = LikeServer({"/version": {"version": "0.11.1"}}, refuse=said)
    try:
        backend = OpenAIBackend(server.base_url, MODEL, logprobs=False, where="profile 'vllm-x'")
        with pytest.raises(BackendError) as e:
            run_to_summary(backend.stream(Request(messages=ASK, constraint=GRAMMAR), Sampling(max_tokens=8)))
        assert str(e.value) == f"profile 'vllm-x': vLLM refused the constraint grammars/yes-no.gbnf: {said}"
        with pytest.raises(BackendError, match="the server answered HTTP 400"):  # unconstrained: as before
            run_to_summary(backend.stream(Request(messages=ASK), Sampling(max_tokens=8)))
    finally:
        server.stop()
