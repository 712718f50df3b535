"""`specchat --help` says what specchat is; every command's --help ends with examples that parse and
name shipped profiles."""
from __future__ import annotations

import re
import shlex

import pytest

from specchat import cli, help_text
from specchat.profiles import load_profiles

COMMANDS = [[], ["chat"], ["ab"], ["repl"], ["run"], ["profiles"], ["pull"], ["bench"], ["ladder"], ["verify"],
            ["train"], *[["train", t] for t in ("prompts", "data", "draft", "mtp", "dflash", "cost")]]


def help_of(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as done:
        cli.main([*argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a) or "specchat")
def test_every_help_ends_with_examples(argv, capsys):
    text = help_of(argv, capsys)
    assert re.search(r"^examples\b", text, re.M), text
    assert re.search(rf"^\s+(.*\| )?specchat {' '.join(argv)}", text, re.M), text


def test_the_top_level_says_what_specchat_is(capsys):
    text = help_of([], capsys)
    assert "The `specchat` command" not in text
    prose = " ".join(text.split())
    assert "terminal chat for local LLMs" in prose and "speculative decoding makes a model faster" in prose
    for command in ("specchat\n", "specchat verify -p smollm2-ngram", "specchat bench -p smollm2 -p smollm2-ngram"):
        assert command in text
    assert "exit codes" in text


def example_commands() -> list[str]:
    """Every example command line in the help texts, continuation lines joined, pipes dropped."""
    out = []
    for text in [help_text.EPILOG, *help_text.EPILOGS.values()]:
        for line in re.sub(r"\s*\\\n\s*", " ", text).splitlines():
            line = line.strip().rpartition("| ")[2]
            if line.startswith("specchat") and "COMMAND" not in line:
                out.append(re.split(r"\s{2,}", line)[0])  # the command, not the words beside it
    return out


def test_the_examples_parse_and_name_shipped_profiles():
    parser = cli.build_parser()
    shipped = set(load_profiles().profiles)
    commands = example_commands()
    assert len(commands) > 25
    for command in commands:
        argv = shlex.split(command)[1:]
        parser.parse_args(argv)  # exits on an unknown flag or a missing argument
        for flag, value in zip(argv, argv[1:]):
            if flag in ("-p", "--profile", "-r", "--reference", "--target"):
                assert value in shipped, command
    for text in [help_text.DESCRIPTION, help_text.EPILOG, *help_text.EPILOGS.values()]:
        assert max(len(line) for line in text.splitlines()) < 80
