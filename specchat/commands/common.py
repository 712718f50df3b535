"""What every subcommand shares: exit codes, the usage error, flags and the prompt set."""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from specchat.live import stats_line

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    pass


def err(msg: str) -> None:
    print(f"specchat: error: {msg}", file=sys.stderr)


def chosen_profile(args, name: Optional[str] = None):
    """The profile a command runs: profile `name` (the default for None), or, with -m FILE, the one
    -m builds (alone) or `name` with its model replaced by FILE (specchat/model_flag.py)."""
    from specchat.profiles import get_profile

    if getattr(args, "model", None) is None:
        return get_profile(name)
    from specchat.model_flag import profile_for_model

    return profile_for_model(args.model, name)


def chosen_name(args) -> Optional[str]:
    """For the commands that take a profile by name (chat, ab, repl): -p's, or that of the profile
    -m built for this process; None for neither."""
    return chosen_profile(args, args.profile).name if getattr(args, "model", None) is not None else args.profile


def needs_profile_or_model(args, command: str, what: str = "PROFILE") -> None:
    if not args.profile and getattr(args, "model", None) is None:
        raise UsageError(f"{command} needs -p {what} or -m FILE (a GGUF file or a checkpoint directory)")


def overridden(profile, args):
    """The profile with this command's flags applied (sampling flags and --set KEY=VALUE)."""
    import yaml

    from specchat.constraints import constraint_of, flag_settings

    settings = {f"sampling.{k}": getattr(args, k, None) for k in ("temperature", "top_p", "top_k", "seed", "max_tokens")}
    settings.update(flag_settings(args))
    for item in getattr(args, "set", None) or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--set {item!r}: expected KEY=VALUE, e.g. --set speculative.depth=3")
        if key.strip() == "model" and getattr(args, "model", None) is not None:
            raise UsageError(f"--set {item}: the model is -m's ({args.model}); give it once")
        settings[key.strip()] = yaml.safe_load(value)
    profile = profile.with_overrides(settings)
    if getattr(args, "no_constraint", False):
        profile = profile.model_copy(update={"constraint": None})
    constraint_of(profile)  # a constraint file gone bad: one line now, before any model loads
    return profile


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, help="override the profile's sampling.max_tokens")
    p.add_argument("--temperature", type=float, help="override sampling.temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, help="override sampling.top_p")
    p.add_argument("--top-k", type=int, help="override sampling.top_k")
    p.add_argument("--seed", type=int, help="override sampling.seed")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override any profile field for this run, e.g. dtype=bfloat16 or speculative.depth=3")


def count(flag: str, least: int = 1):
    """An argparse `type=` for a count of `least` or more; anything else is a UsageError (one line, exit 2)."""
    def parse(text: str) -> int:
        if not text.strip().isdigit() or int(text) < least:
            raise UsageError(f"{flag} {text}: expected a whole number of {least} or more (e.g. {flag} 3)")
        return int(text)
    return parse


def add_prompt_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", help="prompt file (Spec-Bench question.jsonl, jsonl or text)")
    p.add_argument("--limit", type=count("--limit"), help="at most N prompts, spread over the subtasks")
    p.add_argument("--category", action="append", help="only these categories / subtasks")


def prompt_set(args):
    """The prompts `--prompts/--limit/--category` name, or two short chat prompts."""
    from specchat.prompts import PromptItem, load_prompts

    if args.prompts:
        items = load_prompts(args.prompts, args.limit, args.category)
        if getattr(args, "no_constraint", False) or any(getattr(args, kind, None) is not None
                                                        for kind in ("json_schema", "regex", "grammar")):
            for item in items:  # the command line's constraint (or none) replaces the prompts' own
                item.constraint = None
        return items
    return [PromptItem("1", ["Explain speculative decoding in three sentences."]),
            PromptItem("2", ["Write a haiku about a fast computer."])]


def run_line(label: str, r) -> str:
    """One prompt's figures in a bench or ladder run: which, and its stats line."""
    return f"  {label} · {r.prompt.id} [{r.prompt.task}] {stats_line(r.summary)}"
