"""specchat/constraints.py: constraints from flags, profiles and prompt files, read and checked
before a model loads (one line, exit 2, for anything wrong), and the check of finished replies."""
import json
from pathlib import Path

import pytest

from specchat import cli
from specchat.backends.base import STOP_EOS, STOP_MAX_TOKENS, Summary
from specchat.constraints import (ConstraintError, constraint_of, load_constraint, replies_valid, reply_problem,
                                  summary_problem)
from specchat.profiles import ProfileError, load_profile_file
from specchat.prompts import load_prompts

REPO = Path(__file__).resolve().parent.parent
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture
def schema_file(tmp_path):
    path = tmp_path / "person.json"
    path.write_text(json.dumps(PERSON))
    return path


def test_reply_problem_parses_and_validates_json(schema_file):
    c = load_constraint("json_schema", str(schema_file))
    assert c.kind == "json_schema" and c.origin == str(schema_file)
    assert reply_problem(c, '{"name": "Ada", "age": 36}') is None
    assert reply_problem(c, '{"name": "Ada",\n  "age": 36}') is None  # any layout JSON allows
    assert "not valid JSON" in reply_problem(c, '{"name": "Ada", "age": 36')
    assert "does not validate at age" in reply_problem(c, '{"name": "Ada", "age": -1}')
    assert "'age' is a required property" in reply_problem(c, '{"name": "Ada"}')


def test_reply_problem_for_regex_and_grammar(tmp_path):
    r = load_constraint("regex", r"[A-Z]{2}-\d{3}")
    assert reply_problem(r, "AB-123") is None and reply_problem(r, "AB-1234") is not None
    gbnf = tmp_path / "yes-no.gbnf"
    gbnf.write_text('root ::= ("yes" | "no") "."\n')
    g = load_constraint("grammar", str(gbnf))
    assert reply_problem(g, "yes.") is None
    assert "ends before" in reply_problem(g, "yes")
    assert "does not match" in reply_problem(g, "maybe.")
    lark = tmp_path / "list.lark"
    lark.write_text('start: item ("," item)*\nitem: /[a-z]+/\n')
    assert reply_problem(load_constraint("grammar", str(lark)), "a,bc,d") is None


def test_summary_problem_says_why_a_reply_ended_short(schema_file):
    c = load_constraint("json_schema", str(schema_file))
    cut = Summary(stop_reason=STOP_MAX_TOKENS, tokens=12, text='{"name": "A')
    assert "cut at max_tokens, 12 tokens" in summary_problem(c, cut)
    assert summary_problem(c, Summary(stop_reason=STOP_EOS, text='{"name": "A", "age": 1}')) is None


@pytest.mark.parametrize("content, problem", [
    (None, "no such JSON schema file"),
    (b"\xff\xfe{}", "not UTF-8 text"),
    (b'{"type": ', "not valid JSON (line 1"),
    (b'{"type": "objecx"}', "invalid JSON schema at type"),
    (b'[1, 2]', "a JSON schema is an object"),
    (b'{"type": "string", "minLength": 3, "maxLength": 1}', "invalid JSON schema: Unsatisfiable"),
    (b"", "empty"),
])
def test_a_bad_schema_file_is_one_line_naming_the_file(tmp_path, content, problem):
    path = tmp_path / "s.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ConstraintError) as e:
        load_constraint("json_schema", str(path))
    assert str(e.value).startswith(str(path)) and problem in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("flags, problem", [
    (["--json-schema", "{tmp}/missing.json"], "missing.json: no such JSON schema file"),
    (["--json-schema", "{tmp}/bad.json"], "bad.json: invalid JSON schema"),
    (["--regex", "a(b"], "--regex 'a(b': invalid regular expression"),
    (["--grammar", "{tmp}/bad.gbnf"], "bad.gbnf: invalid grammar"),
    (["--grammar", "{tmp}/missing.lark"], "missing.lark: no such grammar file"),
])
@pytest.mark.parametrize("command", [["run", "-p", "smollm2", "hi"], ["bench", "-p", "smollm2"],
                                     ["verify", "-p", "smollm2-ngram"]])
def test_bad_constraint_flags_exit_2_with_one_line_before_any_model_loads(tmp_path, capsys, command, flags,
                                                                          problem):
    (tmp_path / "bad.json").write_text('{"type": 7}')
    (tmp_path / "bad.gbnf").write_text("root ::= undefined_rule\n")
    code = cli.main(command + [f.format(tmp=tmp_path) for f in flags])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("specchat: error: ") and problem in err and "Traceback" not in err


def test_two_constraint_flags_are_a_usage_error(tmp_path, capsys, schema_file):
    with pytest.raises(SystemExit) as e:
        cli.main(["run", "-p", "smollm2", "--regex", "x", "--json-schema", str(schema_file), "hi"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def write_profile(folder: Path, section: str) -> Path:
    path = folder / "constrained.yaml"
    path.write_text(f"extends: smollm2\n{section}")
    return path


def test_a_profile_constraint_section_reads_files_beside_the_profile(tmp_path, schema_file):
    (tmp_path / "schemas").mkdir()
    (tmp_path / "schemas" / "p.json").write_text(json.dumps(PERSON))
    profile = load_profile_file(write_profile(tmp_path, "constraint:\n  json_schema: schemas/p.json\n"))
    c = constraint_of(profile)
    assert c.kind == "json_schema" and json.loads(c.text) == PERSON and c.origin == str(tmp_path / "schemas/p.json")
    assert constraint_of(profile.target_only()) == c  # the reference keeps it
    regex = load_profile_file(write_profile(tmp_path, "constraint:\n  regex: '[0-9]+'\n"))
    assert constraint_of(regex).text == "[0-9]+" and "constraint.regex" in constraint_of(regex).origin


@pytest.mark.parametrize("section, problem", [
    ("constraint:\n  json_schema: a.json\n  regex: x\n", "give exactly one of"),
    ("constraint:\n  schema: a.json\n", "constraint.schema: unknown key"),
])
def test_a_bad_profile_constraint_section_is_one_line(tmp_path, section, problem):
    with pytest.raises(ProfileError) as e:
        load_profile_file(write_profile(tmp_path, section))
    assert problem in str(e.value) and "\n" not in str(e.value)


def test_a_profile_naming_a_missing_schema_fails_before_loading(tmp_path, capsys):
    path = write_profile(tmp_path, "constraint:\n  json_schema: nowhere.json\n")
    assert cli.main(["run", "-p", str(path), "hi"]) == 2
    assert f"{tmp_path / 'nowhere.json'}: no such JSON schema file" in capsys.readouterr().err


def test_the_command_line_constraint_replaces_the_profile_s(tmp_path, schema_file):
    from argparse import Namespace

    from specchat.commands.common import overridden

    profile = load_profile_file(write_profile(tmp_path, "constraint:\n  regex: '[0-9]+'\n"))
    args = Namespace(json_schema=str(schema_file), regex=None, grammar=None)
    assert constraint_of(overridden(profile, args)).kind == "json_schema"


def test_prompt_records_carry_their_own_schema(tmp_path, schema_file):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in [
        {"id": "a", "prompt": "x", "schema": "person.json"},
        {"id": "b", "prompt": "y", "schema": {"type": "array", "maxItems": 2}},
        {"id": "c", "prompt": "z"}]))
    a, b, c = load_prompts(prompts)
    assert a.constraint.origin == str(schema_file) and json.loads(b.constraint.text)["maxItems"] == 2
    assert c.constraint is None
    prompts.write_text(json.dumps({"prompt": "x", "schema": "gone.json"}))
    with pytest.raises(ConstraintError, match=r"p.jsonl:1: schema: .*gone.json: no such JSON schema file"):
        load_prompts(prompts)


def test_the_extraction_prompts_and_their_schemas_load():
    items = load_prompts(REPO / "scripts" / "extraction-prompts.jsonl")
    assert len(items) == 24 and all(i.constraint is not None and i.constraint.kind == "json_schema" for i in items)
    assert {i.category for i in items} == {"contact", "event", "product", "order"}


def test_replies_valid_counts_both_sides(schema_file):
    from types import SimpleNamespace

    from specchat.backends.base import Request

    c = load_constraint("json_schema", str(schema_file))
    good, bad = (Summary(stop_reason=STOP_EOS, text=t) for t in ('{"name": "A", "age": 1}', '{"name": "A"}'))
    check = SimpleNamespace(label="7", request=Request(messages=[], constraint=c), speculative=good, reference=bad)
    free = SimpleNamespace(label="8", request=Request(messages=[]), speculative=good, reference=good)
    out = replies_valid([check, free])
    assert out["replies"] == 2 and out["valid"] == 1
    assert out["invalid"] == [{"id": "7", "reply": "reference", "problem": summary_problem(c, bad)}]
    assert replies_valid([free]) is None


@pytest.mark.slow
@pytest.mark.timeout(900)  # two real-model verify runs; on a busy 2-core machine past the default
@pytest.mark.parametrize("profile", ["smollm2-ngram", "smollm2-mtp-lookup"])
def test_verify_under_a_schema_on_the_default_model(default_gguf, profile, capsys):
    """`specchat verify -p P --json-schema S --prompts P`: no mismatch, every reply valid."""
    prompts = REPO / "scripts" / "extraction-prompts.jsonl"
    code = cli.main(["verify", "-p", profile, "--json-schema", str(REPO / "scripts" / "schemas" / "contact.json"),
                     "--prompts", str(prompts), "--category", "contact", "--limit", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["mismatches"] == 0 and out["prompts"] == 2
    assert out["constraint"] == {"replies": 4, "valid": 4, "invalid": []}
