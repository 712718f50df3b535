"""More training prompts from the same openly licensed tasks: each self-instruct task's texts are
reused in the kinds of request a chat model gets (summarise, translate, answer from a document,
rewrite, explain step by step, list key points, continue).

A drafter learns what the target does on the prompts it sees; 427 short tasks cover little of
that. The derived prompts add copying-heavy work (summaries, answers from a document,
translations) like Spec-Bench's subtasks without ever using Spec-Bench itself.
"""
from __future__ import annotations

import json
from pathlib import Path

from specchat.prompts import PromptItem

LANGUAGES = ("French", "German", "Spanish", "Italian", "Portuguese")
MIN_DOCUMENT_CHARS = 80


def _templates(instruction: str, given: str, doc: str, language: str) -> dict[str, str]:
    out = {
        "explain": f"{instruction}\n\n{given}\n\nExplain your answer step by step.".replace("\n\n\n\n", "\n\n"),
    }
    if len(doc) >= MIN_DOCUMENT_CHARS:
        out.update({
            "summary": f"Summarize the following text in a few sentences.\n\n{doc}",
            "translate": f"Translate the following text into {language}.\n\n{doc}",
            "document": f"Answer the question using the document below.\n\nDocument: {doc}\n\nQuestion: {instruction}",
            "rewrite": f"Rewrite the following text so that it is clearer and more formal.\n\n{doc}",
            "points": f"List the key points of the following text.\n\n{doc}",
            "continue": f"Continue this text.\n\n{doc}",
        })
    return out


def self_instruct_tasks(path: Path) -> list[tuple[int, dict]]:
    """(line number, record) of every task in a self-instruct jsonl file; [] for other formats."""
    tasks = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        rec = json.loads(line)
        if "instruction" not in rec:
            return []
        tasks.append((n, rec))
    return tasks


def derived_prompts(path: Path, tag: str) -> list[PromptItem]:
    """Derived prompts for every task of a self-instruct jsonl file (none for other formats).
    The document of a task is its longest instance text (input or output)."""
    items: list[PromptItem] = []
    for n, rec in self_instruct_tasks(path):
        instances = rec.get("instances") or [{}]
        given = instances[0].get("input", "")
        doc = max((t for i in instances for t in (i.get("input", ""), i.get("output", ""))), key=len, default="")
        task = rec.get("id", n)
        language = LANGUAGES[n % len(LANGUAGES)]
        for kind, text in _templates(rec["instruction"], given, doc.strip(), language).items():
            items.append(PromptItem(f"{tag}:{task}~{kind}", [text.strip()]))
    return items
