"""The constraint a chat's replies keep (REPL and TUI alike): one chosen in the session — a
command-line flag, `/schema FILE`, `/regex R`, `/grammar FILE` — over the profile's own
`constraint:` section; `/schema off` (or `/regex off`, `/grammar off`) leaves replies free, the
profile's constraint included, until one is chosen again."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from specchat.backends.base import Constraint
from specchat.constraints import ConstraintError, constraint_of, load_constraint

# slash command -> constraint kind, and its line in /help
COMMANDS = {"/schema": "json_schema", "/regex": "regex", "/grammar": "grammar"}
HELP = {
    "/schema": "/schema [FILE|off] every reply JSON valid against the schema (no FILE: show the constraint)",
    "/regex": "/regex [R|off]     every reply matches the regular expression as a whole",
    "/grammar": "/grammar [FILE|off] every reply follows the grammar (Lark, or llama.cpp's GBNF)",
}
KIND_NAMES = {"json_schema": "JSON schema", "regex": "regex", "grammar": "grammar"}


def short_origin(constraint: Constraint) -> str:
    """A file's name (not its folder), a regex itself: what fits a status line."""
    if constraint.kind == "regex":
        text = constraint.text if len(constraint.text) <= 40 else constraint.text[:39] + "…"
        return repr(text)
    return Path(constraint.origin).name if constraint.origin else "(inline)"


def label(constraint: Constraint) -> str:
    """`JSON schema person.json`, `regex '\\d+'`, `grammar yes-no.gbnf`."""
    return f"{KIND_NAMES[constraint.kind]} {short_origin(constraint)}"


def pretty_json(text: str) -> Optional[str]:
    """A reply that is a JSON object or array, indented for reading (None: it is not one). Only for
    display: the reply itself is kept, copied and compared as the model wrote it."""
    stripped = text.strip()
    if not stripped.startswith(("{", "[")):
        return None
    try:
        value = json.loads(stripped)
    except (json.JSONDecodeError, RecursionError):
        return None
    return json.dumps(value, indent=2, ensure_ascii=False)


class SessionConstraint:
    def __init__(self, given: Optional[Constraint] = None):
        self.chosen = given  # set in this session: a flag or a slash command
        self.off = False  # turned off in this session: the profile's own too
        self._read: Optional[tuple] = None  # (profile, its constraint or why it cannot be read), read once

    def current(self, profile) -> Optional[Constraint]:
        """What the next reply keeps. Raises ConstraintError where the profile's own file went bad."""
        if self.chosen is not None:
            return self.chosen
        if self.off or profile is None:
            return None
        if self._read is None or self._read[0] is not profile:  # read and compiled once per profile loaded
            try:
                self._read = (profile, constraint_of(profile))
            except ConstraintError as e:
                self._read = (profile, e)  # said where it is asked for, not read again 30 times a second
        if isinstance(self._read[1], ConstraintError):
            raise self._read[1]
        return self._read[1]

    def describe(self, profile) -> str:
        try:
            constraint = self.current(profile)
        except ConstraintError as e:
            return f"the profile's constraint cannot be read: {e}"
        if constraint is None:
            return "no constraint: replies are free" + (" (the profile's is off for this session)"
                                                        if self.off and getattr(profile, "constraint", None) else "")
        where = "set in this session" if self.chosen is not None else f"profile '{profile.name}'"
        return f"constraint: {KIND_NAMES[constraint.kind]} {constraint.origin or constraint.text} ({where})"

    def command(self, name: str, arg: str, profile) -> str:
        """Run /schema, /regex or /grammar: the line to show. Raises ConstraintError (one line naming
        the file or expression) for one that cannot be used; the constraint before stays."""
        arg = arg.strip()
        if not arg:
            return self.describe(profile)
        if arg == "off":
            had = self.current_or_none(profile)
            self.chosen, self.off = None, True
            return f"constraint off ({label(had)} no longer applies): replies are free" if had else \
                "no constraint: replies are free"
        constraint = load_constraint(COMMANDS[name], arg)
        self.chosen, self.off = constraint, False
        return f"constraint on: every reply keeps the {label(constraint)}"

    def current_or_none(self, profile) -> Optional[Constraint]:
        try:
            return self.current(profile)
        except ConstraintError:
            return None


def replies_line(constraint: Optional[Constraint], spec, ref) -> Optional[str]:
    """Whether both replies of an A/B run (Summaries) keep their constraint, in one line (None: none on)."""
    from specchat.constraints import summary_problem

    if constraint is None:
        return None
    broken = [(side, summary_problem(constraint, s)) for side, s in (("speculative", spec), ("reference", ref))]
    broken = [(side, problem) for side, problem in broken if problem]
    if not broken:
        return f"both replies keep the {label(constraint)}"
    return "; ".join(f"the {side} reply breaks the {label(constraint)}: {problem}" for side, problem in broken)
