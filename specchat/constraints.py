"""Constraints a user asks for (`--json-schema FILE`, `--regex R`, `--grammar FILE`, a profile's
`constraint:` section, a prompt's own `schema`), read and checked before any model loads, and the
check of a finished reply against its constraint.

Every problem is one line naming the file (or flag) and what is wrong: a ConstraintError, which
the commands print and exit 2 on, as for a broken profile.
"""
from __future__ import annotations

import json
from pathlib import Path

from specchat.backends.base import BackendError, Constraint
from specchat.profiles import ProfileError

FLAGS = {"json_schema": "--json-schema", "regex": "--regex", "grammar": "--grammar"}


class ConstraintError(ProfileError):
    """One line: which file or flag, and what is wrong with it."""


def _read(path: Path, kind: str) -> str:
    what = "JSON schema" if kind == "json_schema" else "grammar"
    if not path.exists():
        raise ConstraintError(f"{path}: no such {what} file")
    if path.is_dir():
        raise ConstraintError(f"{path}: is a folder; expected a {what} file")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConstraintError(f"{path}: not UTF-8 text (byte {e.start}); save the {what} as UTF-8") from None
    except OSError as e:
        raise ConstraintError(f"{path}: cannot read: {e.strerror}") from None


def _check_schema(text: str, origin: str) -> None:
    """Valid JSON holding a valid JSON schema (by its own `$schema` draft, else the latest)."""
    import jsonschema

    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConstraintError(f"{origin}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError(f"{origin}: a JSON schema is an object (or true / false), not {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        at = "/".join(str(p) for p in e.absolute_path)
        raise ConstraintError(f"{origin}: invalid JSON schema{f' at {at}' if at else ''}: {e.message}") from None


def load_constraint(kind: str, value: str, base: Path | None = None, origin: str | None = None) -> Constraint:
    """The constraint of this kind: for json_schema and grammar `value` is a file (relative paths
    from `base`, else the working folder), for regex the expression itself. Checked now (see
    `checked_constraint`), so a bad one stops the command before a model loads. `origin`: how
    messages name it (default: the file, or `--regex`)."""
    if kind not in FLAGS:
        raise ConstraintError(f"unknown constraint kind {kind!r}; expected json_schema, regex or grammar")
    if kind == "regex":
        return checked_constraint(kind, value, origin or f"--regex {value!r}")
    path = Path(value).expanduser()
    if base is not None and not path.is_absolute():
        path = base / path
    return checked_constraint(kind, _read(path, kind), origin or str(path))


def checked_constraint(kind: str, text: str, origin: str) -> Constraint:
    """A constraint from its text, checked: a JSON schema must be valid JSON and a valid schema (by
    jsonschema), and every kind must compile with the grammar library (an unsupported schema
    keyword, a regex or grammar that does not parse); ConstraintError (one line naming `origin`)."""
    from specchat.backends.constraint import compile_grammar

    if not text.strip():
        raise ConstraintError(f"{origin}: empty; expected a {'regular expression' if kind == 'regex' else kind.replace('_', ' ')}")
    if kind == "json_schema":
        _check_schema(text, origin)
    constraint = Constraint(kind, text, origin)
    try:
        compile_grammar(constraint)
    except BackendError as e:
        raise ConstraintError(str(e)) from None
    return constraint


def from_profile(profile) -> Constraint | None:
    """A profile's `constraint:` section (files relative to the profile's own folder)."""
    section = getattr(profile, "constraint", None)
    if section is None:
        return None
    kind, value = section.chosen
    origin = f"profile '{profile.name}': constraint.regex {value!r}" if kind == "regex" else None
    return load_constraint(kind, value, profile.base_dir, origin)


def constraint_of(profile) -> Constraint | None:
    """The constraint every reply of this profile keeps (its `constraint:` section, which the
    command-line flags set), or None."""
    return from_profile(profile)


def constraint_for(profile, item=None) -> Constraint | None:
    """The constraint of one prompt's replies: the prompt's own (a `schema` in its record), else the
    profile's. (A command-line constraint replaces the prompts' own: see `flag_settings`.)"""
    own = getattr(item, "constraint", None)
    return own if own is not None else constraint_of(profile)


def flag_settings(args) -> dict:
    """The profile override for a command's --json-schema / --regex / --grammar (checked now: a bad
    one is one line naming it, before any model loads), or {} where none was given."""
    given = [(kind, getattr(args, kind, None)) for kind in FLAGS if getattr(args, kind, None) is not None]
    if not given:
        return {}
    if len(given) > 1:
        raise ConstraintError(f"{' and '.join(FLAGS[k] for k, _ in given)}: give one constraint, not several")
    kind, value = given[0]
    load_constraint(kind, value)
    if kind != "regex":  # the profile's own paths are relative to its folder; a flag's to the working one
        value = str(Path(value).expanduser().absolute())
    return {"constraint": {kind: value}}


def flag_constraint(args) -> Constraint | None:
    """The constraint a command's --json-schema / --regex / --grammar name (checked), or None."""
    given = [(kind, getattr(args, kind, None)) for kind in FLAGS if getattr(args, kind, None) is not None]
    return load_constraint(*given[0]) if given else None


def add_constraint_flags(p, clearable: bool = True) -> None:
    """--json-schema / --regex / --grammar, one at most (argparse says so in one line), and where
    `clearable`, --no-constraint."""
    group = p.add_mutually_exclusive_group()
    group.add_argument("--json-schema", dest="json_schema", metavar="FILE",
                       help="every reply is JSON valid against this schema (overrides the profile's constraint)")
    group.add_argument("--regex", metavar="R", help="every reply matches this regular expression as a whole")
    group.add_argument("--grammar", metavar="FILE",
                       help="every reply follows this grammar (Lark, or llama.cpp's GBNF)")
    if clearable:
        group.add_argument("--no-constraint", dest="no_constraint", action="store_true",
                           help="replies free: leave out the profile's constraint and the prompts' own schemas")


def reply_problem(constraint: Constraint, text: str) -> str | None:
    """What is wrong with a finished reply under its constraint (None: it keeps it): for a JSON
    schema, the reply parses as JSON and validates (checked by jsonschema, independently of the
    library that constrained decoding); for a regex, it matches as a whole; for a grammar, the
    grammar library's matcher accepts it to the end."""
    if constraint.kind == "json_schema":
        import jsonschema

        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            return f"not valid JSON ({e.msg} at character {e.pos} of {len(text)})"
        schema = json.loads(constraint.text)
        error = jsonschema.exceptions.best_match(jsonschema.validators.validator_for(schema)(schema).iter_errors(value))
        if error is None:
            return None
        at = "/".join(str(p) for p in error.absolute_path)
        return f"does not validate{f' at {at}' if at else ''}: {error.message}"
    if constraint.kind == "regex":
        import re

        try:
            return None if re.fullmatch(constraint.text, text) else _grammar_problem(constraint, text)
        except re.error:  # a syntax Python's re lacks (the engines use Rust's regex): the library judges
            pass
    return _grammar_problem(constraint, text)


def _grammar_problem(constraint: Constraint, text: str) -> str | None:
    from specchat.backends.constraint import text_problem

    return text_problem(constraint, text)


def summary_problem(constraint: Constraint, summary) -> str | None:
    """What is wrong with a finished reply (a Summary) under its constraint, with why it ended
    where it ended (None: it keeps the constraint)."""
    from specchat.backends.base import STOP_CONSTRAINT, STOP_MAX_TOKENS

    problem = reply_problem(constraint, summary.text)
    if problem is None:
        return None
    if summary.stop_reason == STOP_MAX_TOKENS:
        problem += f" (the reply was cut at max_tokens, {summary.tokens} tokens: raise --max-tokens)"
    elif summary.stop_reason == STOP_CONSTRAINT:
        problem += " (the constraint left no token to continue with)"
    return problem


def replies_valid(checks) -> dict | None:
    """For `specchat verify`: whether every reply (speculative and reference) keeps its prompt's
    constraint; None where no check had one. {"replies", "valid", "invalid": [{id, reply, problem}]}."""
    rows = []
    for check in checks:
        constraint = check.request.constraint if check.request is not None else None
        if constraint is None:
            continue
        for side, summary in (("speculative", check.speculative), ("reference", check.reference)):
            rows.append({"id": check.label, "reply": side, "problem": summary_problem(constraint, summary)})
    if not rows:
        return None
    invalid = [r for r in rows if r["problem"]]
    return {"replies": len(rows), "valid": len(rows) - len(invalid), "invalid": invalid}
