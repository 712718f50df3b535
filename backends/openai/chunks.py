"""Reading one chat-completion chunk (or a whole non-streamed response) the way servers send it."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

# vLLM with `return_tokens_as_token_ids` writes each logprobs token as "token_id:1234".
_TOKEN_ID = re.compile(r"^token_id:(\d+)$")


@dataclass
class Chunk:
    text: str = ""
    token_ids: Optional[list[int]] = None  # None: this chunk did not say which tokens it holds
    token_count: Optional[int] = None  # tokens its logprobs list, when it has them
    finish_reason: Optional[str] = None
    usage: Optional[dict] = None
    timings: Optional[dict] = None  # llama-server
    meta_info: Optional[dict] = None  # SGLang
    spec_decoding: Optional[dict] = None  # vLLM's per-request `metrics.speculative_decoding`
    error: Optional[str] = None


def error_message(data) -> Optional[str]:
    """The message of an error object as OpenAI, vLLM, SGLang and FastAPI servers shape it."""
    if not isinstance(data, dict):
        return None
    err = data.get("error")
    if isinstance(err, dict):
        return str(err.get("message") or err.get("type") or err)
    if isinstance(err, str):
        return err
    detail = data.get("detail")
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list) and detail and isinstance(detail[0], dict):  # FastAPI validation errors
        d = detail[0]
        return f"{'.'.join(str(p) for p in d.get('loc', []))}: {d.get('msg', '')}".strip(": ")
    if isinstance(data.get("message"), str) and data.get("object") == "error":
        return data["message"]
    return None


def _logprob_tokens(choice: dict) -> Optional[list]:
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, dict):
        return None
    content = logprobs.get("content")
    if isinstance(content, list):
        return content
    tokens = logprobs.get("tokens")  # the older completions shape
    return [{"token": t} for t in tokens] if isinstance(tokens, list) else None


def _entry_id(entry) -> Optional[int]:
    """A logprobs entry's token id: llama-server writes it as "id", vLLM (asked to) as "token_id:N"."""
    if not isinstance(entry, dict):
        return None
    if isinstance(entry.get("id"), int):
        return entry["id"]
    m = _TOKEN_ID.match(str(entry.get("token", "")))
    return int(m.group(1)) if m else None


def parse_chunk(data: dict) -> Chunk:
    chunk = Chunk(usage=data.get("usage") if isinstance(data.get("usage"), dict) else None,
                  timings=data.get("timings") if isinstance(data.get("timings"), dict) else None,
                  meta_info=data.get("meta_info") if isinstance(data.get("meta_info"), dict) else None)
    metrics = data.get("metrics")
    if isinstance(metrics, dict) and isinstance(metrics.get("speculative_decoding"), dict):
        chunk.spec_decoding = metrics["speculative_decoding"]  # on the final usage chunk when streaming
    if "error" in data or data.get("object") == "error":
        chunk.error = error_message(data) or "unknown error"
        return chunk
    choices = data.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return chunk
    choice = choices[0]
    message = choice.get("delta") or choice.get("message") or {}
    chunk.text = message.get("content") or ""
    chunk.finish_reason = choice.get("finish_reason")
    if isinstance(choice.get("meta_info"), dict):
        chunk.meta_info = choice["meta_info"]
    ids = choice.get("token_ids")  # vLLM with `return_token_ids`
    entries = _logprob_tokens(choice)
    if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
        chunk.token_ids = list(ids)
    elif entries:
        ids = [_entry_id(e) for e in entries]
        if all(i is not None for i in ids):
            chunk.token_ids = ids
    if chunk.token_ids is not None:
        chunk.token_count = len(chunk.token_ids)
    elif entries is not None:
        chunk.token_count = len(entries)
    return chunk
