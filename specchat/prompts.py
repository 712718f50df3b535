"""Prompt sets: Spec-Bench `question.jsonl`, self-instruct jsonl, `{"prompt": ...}` jsonl, or plain text."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from specchat.backends.base import Constraint
from specchat.profiles import ProfileError

# Spec-Bench reports the eight MT-Bench categories as one subtask.
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


@dataclass
class PromptItem:
    id: str
    turns: list[str]
    category: str = ""
    meta: dict = field(default_factory=dict)
    # the JSON schema this prompt's replies keep (a record's `schema`: a file beside the prompt file, or
    # the schema itself), unless the command gives one for all
    constraint: Optional[Constraint] = None

    @property
    def first(self) -> str:
        return self.turns[0]

    @property
    def task(self) -> str:
        """Spec-Bench subtask: mt_bench, translation, summarization, qa, math_reasoning, rag."""
        return "mt_bench" if self.category in MT_BENCH else self.category


def _from_record(rec: dict, n: int) -> PromptItem | None:
    if "turns" in rec:  # Spec-Bench / MT-Bench
        return PromptItem(str(rec.get("question_id", n)), list(rec["turns"]), rec.get("category", ""))
    if "instruction" in rec:  # self-instruct
        inputs = [i.get("input", "") for i in rec.get("instances", [])] or [""]
        text = rec["instruction"] + (f"\n\n{inputs[0]}" if inputs[0] else "")
        return PromptItem(str(rec.get("id", n)), [text], rec.get("category", ""))
    for key in ("prompt", "question", "text"):
        if key in rec:
            return PromptItem(str(rec.get("id", n)), [rec[key]], rec.get("category", ""))
    return None


def load_prompts(path: str | Path, limit: int | None = None, categories: list[str] | None = None) -> list[PromptItem]:
    path = Path(path)
    if not path.exists():
        raise ProfileError(f"{path}: no such prompt file")
    items: list[PromptItem] = []
    text = path.read_text(encoding="utf-8")
    if path.suffix in (".jsonl", ".json"):
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = _from_record(json.loads(line), n)
            except json.JSONDecodeError as e:
                raise ProfileError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if item is None:
                raise ProfileError(f"{path}:{n}: expected `turns`, `instruction` or `prompt` in each record")
            item.constraint = _schema_of(json.loads(line).get("schema"), path, n)
            items.append(item)
    else:
        items = [PromptItem(str(n), [line]) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if categories:
        items = [i for i in items if i.category in categories or i.task in categories]
    if limit:
        items = _spread(items, limit)
    return items


def _schema_of(schema, path: Path, n: int) -> Optional[Constraint]:
    """A record's `schema`: a JSON schema file (relative to the prompt file's folder) or the schema."""
    from specchat.constraints import ConstraintError, checked_constraint, load_constraint

    if schema is None:
        return None
    if isinstance(schema, str):
        try:
            return load_constraint("json_schema", schema, path.parent)
        except ConstraintError as e:
            raise ConstraintError(f"{path}:{n}: schema: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ProfileError(f"{path}:{n}: schema: expected a JSON schema file's path or a schema object")
    return checked_constraint("json_schema", json.dumps(schema), f"{path}:{n}: schema")


def _spread(items: list[PromptItem], limit: int) -> list[PromptItem]:
    """Take `limit` prompts spread evenly over the subtasks (Spec-Bench lists them in blocks)."""
    cats: dict[str, list[PromptItem]] = {}
    for it in items:
        cats.setdefault(it.task, []).append(it)
    if len(cats) <= 1 or limit >= len(items):
        return items[:limit]
    out: list[PromptItem] = []
    i = 0
    while len(out) < limit:
        for group in cats.values():
            if i < len(group) and len(out) < limit:
                out.append(group[i])
        i += 1
    return sorted(out, key=items.index)
