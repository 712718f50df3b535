"""A regular expression as a GBNF grammar whose language is the strings the expression matches as a
whole, for llama.cpp (which constrains by GBNF only).

Python's own regex parser (`re._parser`, the stdlib's since 1.5) reads the expression; this module
only writes its tree out as GBNF: literals, classes, alternation, groups, bounded and unbounded
repetition. What a grammar cannot say (backreferences, lookaround, word boundaries, anchors inside
the expression, inline flags) is refused in one line. Classes read as the torch engine's library
and vLLM read them by default, except `\\d`, `\\w`, `\\s`, which mean their ASCII sets here.
"""
from __future__ import annotations

import re

try:  # Python 3.11+; sre_parse before (the same module)
    from re import _constants as C, _parser as parser
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as C
    import sre_parse as parser

CATEGORIES = {
    C.CATEGORY_DIGIT: ("0-9", False), C.CATEGORY_NOT_DIGIT: ("0-9", True),
    C.CATEGORY_WORD: ("a-zA-Z0-9_", False), C.CATEGORY_NOT_WORD: ("a-zA-Z0-9_", True),
    C.CATEGORY_SPACE: (" \\t\\n\\r\\f\\v", False), C.CATEGORY_NOT_SPACE: (" \\t\\n\\r\\f\\v", True),
}
EDGE_ANCHORS = (C.AT_BEGINNING, C.AT_BEGINNING_STRING, C.AT_END, C.AT_END_STRING)


class Unsupported(ValueError):
    """What in the expression a grammar cannot say."""


def char(code: int, in_class: bool = False) -> str:
    """One character escaped as GBNF reads it in a literal ("...") or a class ([...])."""
    c = chr(code)
    special = "\\]^-[" if in_class else '\\"'
    if c in special:
        return "\\" + c
    if code < 0x20 or code == 0x7F:
        return {0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"}.get(code, f"\\x{code:02X}")
    if code > 0xFFFF:
        return f"\\U{code:08X}"
    return c if c.isprintable() else f"\\u{code:04X}"


def char_class(items, negate: bool = False) -> str:
    parts = []
    for op, av in items:
        if op is C.NEGATE:
            negate = True
        elif op is C.LITERAL:
            parts.append(char(av, True))
        elif op is C.RANGE:
            parts.append(f"{char(av[0], True)}-{char(av[1], True)}")
        elif op is C.CATEGORY and av in CATEGORIES:
            chars, negated = CATEGORIES[av]
            if negated and len(items) > 1:
                raise Unsupported("a negated class (\\D, \\W, \\S) inside [...]")
            parts.append(chars)
            negate = negate != negated
        else:
            raise Unsupported(f"{op} in a character class")
    return f"[{'^' if negate else ''}{''.join(parts)}]"


def repeat(body: str, low: int, high: int) -> str:
    if (low, high) == (0, C.MAXREPEAT):
        return f"{body}*"
    if (low, high) == (1, C.MAXREPEAT):
        return f"{body}+"
    if (low, high) == (0, 1):
        return f"{body}?"
    if high == C.MAXREPEAT:
        return f"{body}{{{low},}}"
    return f"{body}{{{low}}}" if low == high else f"{body}{{{low},{high}}}"


def sequence(pattern, top: bool = False) -> str:
    items = list(pattern)
    out = []
    for i, (op, av) in enumerate(items):
        if op is C.AT:
            at_edge = top and ((i == 0 and av in EDGE_ANCHORS[:2]) or (i == len(items) - 1 and av in EDGE_ANCHORS[2:]))
            if not at_edge:
                raise Unsupported("an anchor or word boundary inside the expression")
            continue
        out.append(node(op, av))
    return " ".join(out) if out else '""'


def node(op, av) -> str:
    if op is C.LITERAL:
        return f'"{char(av)}"'
    if op is C.NOT_LITERAL:
        return f"[^{char(av, True)}]"
    if op is C.ANY:
        return "[^\\n]"
    if op is C.IN:
        return char_class(av)
    if op is C.CATEGORY and av in CATEGORIES:
        return char_class([(op, av)])
    if op is C.BRANCH:
        return "(" + " | ".join(sequence(alt) for alt in av[1]) + ")"
    if op is C.SUBPATTERN:
        _, add_flags, del_flags, inner = av
        if add_flags or del_flags:
            raise Unsupported("an inline flag such as (?i:...)")
        return f"({sequence(inner)})"
    if op in (C.MAX_REPEAT, C.MIN_REPEAT, getattr(C, "POSSESSIVE_REPEAT", C.MAX_REPEAT)):
        low, high, inner = av
        return repeat(f"({sequence(inner)})", low, high)
    names = {C.GROUPREF: "a backreference", C.ASSERT: "a lookahead or lookbehind",
             C.ASSERT_NOT: "a negative lookahead or lookbehind"}
    raise Unsupported(names.get(op, f"{str(op).lower()}"))


def regex_to_gbnf(pattern: str) -> str:
    """The GBNF of a regular expression matched as a whole. Raises re.error for one Python cannot
    read, Unsupported for one a grammar cannot say."""
    tree = parser.parse(pattern)
    if tree.state.flags & ~(re.UNICODE | getattr(C, "SRE_FLAG_UNICODE", 0)):
        raise Unsupported("a global flag such as (?i) or (?s)")
    return f"root ::= {sequence(tree, top=True)}\n"
