"""What is mutated (SCOPES) and which of cosmic-ray's mutants are kept (operator pairs, RULES), and the
source-reading the skip filter needs (annotations, strings, scoped line ranges)."""
from __future__ import annotations

import ast
import io
import tokenize

# --- what is mutated -------------------------------------------------------------------------------
# Module -> the top-level functions / classes (or "Class.method") whose lines are in scope; None: the
# whole module. A name the committed tree does not have is reported and skipped (the scope was
# written against the code being edited; it is picked up once that code is committed).
SCOPES: dict[str, list[str] | None] = {
    "backends/speculative/acceptance.py": None,  # accept_exact, accept_rejection, Verdict, _width
    "backends/speculative/loop.py": ["speculative_stream", "target_choices", "keyed_generator", "_sample_dist",
                                     "common_prefix"],
    "backends/speculative/drafters.py": ["NgramDrafter", "ModelBehind", "LookupFirst", "SuffixDrafter", "SuffixFirst",
                                         "DraftModelDrafter"],
    "backends/speculative/suffix.py": ["SuffixIndex"],
    "backends/constrained.py": ["RowMasks", "masked_probs"],  # each verify row's mask from its own prefix
    "backends/speculative/ngram.py": None,
    "backends/speculative/mtp.py": ["MtpDrafter"],
    "backends/speculative/dflash.py": ["DFlashDrafter", "ContextCache"],
    "backends/speculative/dspark.py": ["DSparkDrafter", "MarkovHead"],
    "backends/speculative/replay.py": ["verify_row_choice"],
    "backends/native/model.py": ["KVCache.write", "KVCache.truncate"],
    "backends/native/sampling.py": None,  # the position-keyed sampler, hash included (its noise is pinned)
    "specchat/compare.py": ["judge_tokens", "first_divergence", "judge_text", "Verdict"],
    "specchat/verify.py": ["shared_arithmetic", "row_choice_function", "judge_replies"],
}

# --- operator pairs kept ---------------------------------------------------------------------------
# cosmic-ray's ReplaceBinaryOperator turns every binary operator into each of the 12 others, and
# ReplaceComparisonOperator every comparison into each of the other 9: on the core that is ~1,600 of
# the ~2,200 mutants in scope. Most pairs only make noise here: `a + b` -> `a ** b`, `a % b`, `a << b`
# on tensors or floats fails at once with a TypeError or blows a shape up (killed by any test, telling
# nothing), and `==` -> `is` on small ints is CPython's int cache, not a bug a test should pin. We keep
# the mistake a person makes: the opposite arithmetic (Add<->Sub, Mul<->Div, Div<->FloorDiv), the
# neighbouring bit operator in the hash (BitXor/BitAnd -> BitOr, BitOr -> BitAnd, LShift<->RShift), the
# off-by-one boundary (Lt<->LtE, Gt<->GtE) and the flipped test (Eq<->NotEq, Is<->IsNot, In<->NotIn).
KEEP_BINARY = {"Add": {"Sub"}, "Sub": {"Add"}, "Mul": {"Div"}, "Div": {"Mul", "FloorDiv"}, "FloorDiv": {"Div"},
               "Mod": {"FloorDiv"}, "Pow": {"Mul"}, "MatMult": {"Mul"}, "BitXor": {"BitOr"}, "BitAnd": {"BitOr"},
               "BitOr": {"BitAnd"}, "LShift": {"RShift"}, "RShift": {"LShift"}}
KEEP_COMPARISON = {"Lt": {"LtE"}, "LtE": {"Lt"}, "Gt": {"GtE"}, "GtE": {"Gt"}, "Eq": {"NotEq"}, "NotEq": {"Eq"},
                   "Is": {"IsNot"}, "IsNot": {"Is"}, "In": {"NotIn"}, "NotIn": {"In"}}
# ReplaceUnaryOperator: USub -> UAdd is the same program as deleting the minus (Delete_USub, kept);
# USub -> Invert / Not on floats and tensors fails at once or turns an index into a bool.
KEEP_UNARY_PREFIX = "Delete_"
# NumberReplacer makes two mutants of every literal, n+1 and n-1 (occurrences 2k and 2k+1): ~350 of the
# core's mutants. The two land on the same site and are killed (or missed) by the same tests, so we keep
# n+1 only: every literal is still mutated once, and the count stays at a few hundred.
NUMBER_KEEP_EVEN_OCCURRENCE = True
# AddNot on a condition that is one ==, !=, is, is not, in, not in comparison is the same program as the
# kept comparison flip, and on `not x` it is the same program as ReplaceUnaryOperator_Delete_Not.
ADDNOT_DEDUPE = True

# Each rule: (name, reason). The reason is written into the session as the skipped item's output
# and into the report.
RULES = {
    "out-of-scope": "outside the speculative core's functions and classes (SCOPES)",
    "annotation": "inside a type annotation: every core module has `from __future__ import annotations`, "
                  "so annotations are never evaluated and the mutant cannot change behaviour",
    "string": "inside a string literal (an error message's f-string): only changes the message text",
    "binary-pair": "ReplaceBinaryOperator pair other than the kept partner (KEEP_BINARY): fails at once or "
                   "duplicates the kept one",
    "comparison-pair": "ReplaceComparisonOperator pair other than the boundary / flip (KEEP_COMPARISON): "
                       "duplicates those, or is CPython small-int caching (== -> is)",
    "unary-pair": "ReplaceUnaryOperator other than deleting the operator: USub->UAdd equals Delete_USub, "
                  "->Invert/->Not fail at once",
    "number-minus-one": "NumberReplacer's n-1 twin of a literal whose n+1 mutant is kept (same site, same tests)",
    "addnot-duplicate": "AddNot on a condition whose negation is already a kept mutant (a single ==/!=/is/in "
                        "comparison: its flip; `not x`: Delete_Not)",
    "limit": "beyond --limit",
}


def scope_ranges(source: str, names: list[str] | None) -> tuple[list[tuple[int, int]], list[str]]:
    """Line ranges (decorators included) of the named top-level defs/classes, and the names not found."""
    if names is None:
        return [(1, len(source.splitlines()) + 1)], []
    found: dict[str, tuple[int, int]] = {}

    def span(node) -> tuple[int, int]:
        return min([node.lineno] + [d.lineno for d in node.decorator_list]), node.end_lineno

    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    for node in ast.parse(source).body:
        if isinstance(node, defs):
            found[node.name] = span(node)
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, defs):
                        found[f"{node.name}.{sub.name}"] = span(sub)
    return [found[n] for n in names if n in found], [n for n in names if n not in found]


def char_col(line: str, byte_col: int) -> int:
    return len(line.encode("utf-8")[:byte_col].decode("utf-8", errors="ignore"))


def annotation_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    lines = source.splitlines()
    spans = []
    for node in ast.walk(ast.parse(source)):
        anns = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            anns.append(node.returns)
            anns += [x.annotation for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if x]
        elif isinstance(node, ast.AnnAssign):
            anns.append(node.annotation)
        for x in anns:
            if x is not None:
                spans.append(((x.lineno, char_col(lines[x.lineno - 1], x.col_offset)),
                              (x.end_lineno, char_col(lines[x.end_lineno - 1], x.end_col_offset))))
    return spans


def string_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    toks = tokenize.generate_tokens(io.StringIO(source).readline)
    return [(t.start, t.end) for t in toks if t.type == tokenize.STRING]


def inside(pos: tuple[int, int], spans) -> bool:
    return any(a <= pos < b for a, b in spans)


def rule_for(mutation, module: dict) -> str | None:
    """The RULES key that skips this mutation, or None if it is kept."""
    row = mutation.start_pos[0]
    if not any(a <= row <= b for a, b in module["ranges"]):
        return "out-of-scope"
    pos = tuple(mutation.start_pos)
    if inside(pos, module["annotations"]):
        return "annotation"
    if inside(pos, module["strings"]):
        return "string"
    op = mutation.operator_name.split("/", 1)[-1]
    family, _, pair = op.partition("_")
    if family == "ReplaceBinaryOperator":
        src, dst = pair.split("_")
        return None if dst in KEEP_BINARY.get(src, ()) else "binary-pair"
    if family == "ReplaceComparisonOperator":
        src, dst = pair.split("_")
        return None if dst in KEEP_COMPARISON.get(src, ()) else "comparison-pair"
    if family == "ReplaceUnaryOperator":
        return None if pair.startswith(KEEP_UNARY_PREFIX) else "unary-pair"
    if op == "NumberReplacer" and NUMBER_KEEP_EVEN_OCCURRENCE and mutation.occurrence % 2:
        return "number-minus-one"
    if op == "AddNot" and ADDNOT_DEDUPE and pos in module["negated_elsewhere"]:
        return "addnot-duplicate"
    return None


FLIPPED_ELSEWHERE = (ast.Eq, ast.NotEq, ast.Is, ast.IsNot, ast.In, ast.NotIn)


def negated_elsewhere(source: str) -> set[tuple[int, int]]:
    """Start positions of the expressions whose negation another kept mutant already makes: a single
    ==, !=, is, is not, in, not in comparison, or `not x`. (AddNot mutates the largest expression
    that starts at its position.)"""
    lines = source.splitlines()
    largest: dict[tuple[int, int], ast.expr] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.expr):
            pos = (node.lineno, char_col(lines[node.lineno - 1], node.col_offset))
            best = largest.get(pos)
            if best is None or (node.end_lineno, node.end_col_offset) > (best.end_lineno, best.end_col_offset):
                largest[pos] = node
    return {pos for pos, node in largest.items()
            if (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], FLIPPED_ELSEWHERE))
            or (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not))}


def family(operator_name: str) -> str:
    """ReplaceBinaryOperator_Add_Sub -> ReplaceBinaryOperator; core/NumberReplacer -> NumberReplacer."""
    return operator_name.split("/", 1)[-1].split("_")[0]
