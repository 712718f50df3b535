"""Regular expressions as GBNF (backends/regex_gbnf.py): the grammars written, what is refused,
and llama.cpp's replies under them matching the expression as a whole."""
import re

import pytest

from specchat.backends.base import Constraint, Request, Sampling, run_to_summary
from specchat.backends.gbnf import check_gbnf
from specchat.backends.llamacpp import LlamaCppBackend
from specchat.backends.regex_gbnf import Unsupported, regex_to_gbnf
from specchat.paths import cache_dir


@pytest.mark.parametrize("regex, gbnf", [
    (r"\d{3}-\d{4}", 'root ::= ([0-9]){3} "-" ([0-9]){4}'),
    (r"(yes|no)\.", 'root ::= (("y" "e" "s" | "n" "o")) "."'),
    (r"^[A-Z][a-z]+ \w*$", 'root ::= [A-Z] ([a-z])+ " " ([a-zA-Z0-9_])*'),  # edge anchors: a whole match anyway
    (r"a{2,}b?c{1,3}", 'root ::= ("a"){2,} ("b")? ("c"){1,3}'),
    (r'[^"\\]*', r'root ::= ([^"\\])*'),
    (r"\D+", "root ::= ([^0-9])+"),
    (r"[a-c\]\-]x", r'root ::= [a-c\]\-] "x"'),
    (r"(?:ab)*?c", 'root ::= ("a" "b")* "c"'),
    (r".+@.+\.com", r'root ::= ([^\n])+ "@" ([^\n])+ "." "c" "o" "m"'),
    ("é\t\U0001F600\"", 'root ::= "é" "\\t" "\\U0001F600" "\\""'),
    ("", 'root ::= ""'),
])
def test_the_grammar_written_for_a_regex(regex, gbnf):
    text = regex_to_gbnf(regex)
    assert text == gbnf + "\n"
    check_gbnf(text, Constraint("regex", regex, "r"))  # llama.cpp's own parser reads it


@pytest.mark.parametrize("regex, says", [
    (r"\bword", "an anchor or word boundary inside the expression"),
    (r"a$b", "an anchor or word boundary inside the expression"),
    (r"(?=a)b", "a lookahead or lookbehind"),
    (r"(?!a)b", "a negative lookahead or lookbehind"),
    (r"(a)\1", "a backreference"),
    (r"(?i)abc", r"a global flag such as \(\?i\)"),
    (r"(?i:x)y", r"an inline flag such as \(\?i:...\)"),
    (r"[\Da]", r"a negated class \(\\D, \\W, \\S\) inside \[...\]"),
])
def test_what_a_grammar_cannot_say_is_refused(regex, says):
    with pytest.raises(Unsupported, match=says):
        regex_to_gbnf(regex)


def test_what_python_cannot_read_is_its_error():
    with pytest.raises(re.error):
        regex_to_gbnf("(")


@pytest.mark.slow
@pytest.mark.parametrize("regex", [r"\d{3}-\d{4}", r"(yes|no|maybe)\.", r"[A-Z][a-z]{2,8}( [A-Z][a-z]{2,8})?",
                                   r"\{\"ok\": (true|false)\}", r"[^\n.]{5,20}\."])
def test_llamacpp_replies_under_a_regex_match_it_as_a_whole(default_gguf, regex):
    backend = LlamaCppBackend(default_gguf, context=512, threads=2, cache_dir=cache_dir())
    constraint = Constraint("regex", regex, "--regex")
    ask = [{"role": "user", "content": "Tell me something about the sea."}]
    try:
        for sampling in (Sampling(max_tokens=30), Sampling(temperature=1.0, seed=11, max_tokens=30)):
            out = run_to_summary(backend.stream(Request(messages=ask, constraint=constraint), sampling))
            assert out.stop_reason == "eos" and re.fullmatch(regex, out.text), out.text
    finally:
        backend.close()
