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
    from `base`, else the working folder), for regex the expression itself. Checked now, with the
    grammar library too (an unsupported schema keyword, a regex or grammar that does not parse),
    so a bad one stops the command before a model loads. `origin`: how messages name it (default:
    the file, or `--regex`)."""
    from specchat.backends.constraint import compile_grammar

    if kind not in FLAGS:
        raise ConstraintError(f"unknown constraint kind {kind!r}; expected json_schema, regex or grammar")
    if kind == "regex":
        text, origin = value, origin or f"--regex {value!r}"
        if not value:
            raise ConstraintError(f"{origin}: the regular expression is empty")
    else:
        path = Path(value).expanduser()
        if base is not None and not path.is_absolute():
            path = base / path
        text, origin = _read(path, kind), origin or str(path)
        if kind == "json_schema":
            _check_schema(text, origin)
        elif not text.strip():
            raise ConstraintError(f"{origin}: the grammar file is empty")
    constraint = Constraint(kind, text, origin)
    try:
        compile_grammar(constraint)
    except BackendError as e:
        raise ConstraintError(str(e)) from None
    return constraint


def from_args(args, profile=None) -> Constraint | None:
    """The constraint a command's flags ask for, else the profile's `constraint:` section, else None."""
    given = [(kind, getattr(args, kind, None)) for kind in FLAGS if getattr(args, kind, None) is not None]
    if len(given) > 1:
        raise ConstraintError(f"{' and '.join(FLAGS[k] for k, _ in given)}: give one constraint, not several")
    if given:
        return load_constraint(*given[0])
    return from_profile(profile) if profile is not None else None


def from_profile(profile) -> Constraint | None:
    """A profile's `constraint:` section (files relative to the profile's own folder)."""
    section = getattr(profile, "constraint", None)
    if section is None:
        return None
    kind, value = section.chosen
    where = f"profile '{profile.name}': constraint.{kind}"
    origin = f"{where} ({value!r})" if kind == "regex" else None
    try:
        return load_constraint(kind, value, profile.base_dir, origin)
    except ConstraintError as e:
        raise ConstraintError(f"{where}: {e}" if kind != "regex" else str(e)) from None


def add_constraint_flags(p) -> None:
    """--json-schema / --regex / --grammar, one at most (argparse says so in one line)."""
    group = p.add_mutually_exclusive_group()
    group.add_argument("--json-schema", dest="json_schema", metavar="FILE",
                       help="every reply is JSON valid against this schema (overrides the profile's constraint)")
    group.add_argument("--regex", metavar="R", help="every reply matches this regular expression as a whole")
    group.add_argument("--grammar", metavar="FILE",
                       help="every reply follows this grammar (Lark, or llama.cpp's GBNF)")


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
