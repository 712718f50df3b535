"""Speculative-decoding figures as servers report them, turned into `Summary` fields.

- vLLM: per request, `metrics.speculative_decoding` on the reply (a server started with
  `--per-request-spec-decode-metrics`); otherwise the Prometheus counters on `/metrics`
  (`vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`,
  `..._num_accepted_tokens_per_pos{position="i"}`). Those are server-wide, so one request's figures
  are the counters after it minus the counters before it (requests from anyone else in between are
  counted too).
- SGLang: per-request `meta_info` with `spec_verify_ct` (verify passes) and `completion_tokens`;
  newer builds add `spec_accept_token_num` and `spec_draft_token_num`.
- llama-server: `timings.draft_n` and `timings.draft_n_accepted` on the final response.

Names follow vLLM's, like the rest of specchat: drafts = passes that verified drafts, mean acceptance
length = 1 + accepted / drafts.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterator, Optional

from ..base import Summary

VLLM_PREFIX = "vllm:spec_decode_"
VLLM_DRAFTS = VLLM_PREFIX + "num_drafts"
VLLM_DRAFT_TOKENS = VLLM_PREFIX + "num_draft_tokens"
VLLM_ACCEPTED = VLLM_PREFIX + "num_accepted_tokens"
VLLM_PER_POSITION = VLLM_PREFIX + "num_accepted_tokens_per_pos"


@dataclass
class SpecFigures:
    """One reply's speculation as a server reported it."""

    source: str
    drafts: Optional[int]  # None: the server does not count passes (llama-server); derived from tokens
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafts_per_position: list[int] = field(default_factory=list)

    def apply(self, summary: Summary) -> Summary:
        summary.spec_source = self.source
        summary.spec_reported = True
        summary.drafts = self.drafts if self.drafts is not None else max(0, summary.tokens - self.accepted_tokens - 1)
        summary.draft_tokens = self.draft_tokens
        summary.accepted_tokens = self.accepted_tokens
        summary.accepted_per_position = list(self.accepted_per_position)
        summary.drafts_per_position = list(self.drafts_per_position)
        if summary.tokens:
            # Every token is either an accepted draft or the one token of a target pass.
            summary.passes = max(1, summary.tokens - self.accepted_tokens)
        return summary


# ----------------------------------------------------------------------------- vLLM

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def prometheus_samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """(name, labels, value) for every sample line of Prometheus text exposition."""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        yield m.group(1), dict(_LABEL.findall(m.group(2) or "")), value


@dataclass(frozen=True)
class VllmCounters:
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_position: tuple[float, ...] = ()


def vllm_counters(text: str, model: Optional[str] = None) -> Optional[VllmCounters]:
    """vLLM's speculative counters summed over engines, for `model` where samples name one;
    None when the server exposes none (vLLM without speculation, or not vLLM)."""
    totals = {VLLM_DRAFTS: 0.0, VLLM_DRAFT_TOKENS: 0.0, VLLM_ACCEPTED: 0.0}
    per_position: dict[int, float] = {}
    seen = False
    for name, labels, value in prometheus_samples(text):
        base = name[:-len("_total")] if name.endswith("_total") else name
        if not base.startswith(VLLM_PREFIX):
            continue
        if model is not None and labels.get("model_name", model) != model:
            continue
        if base in totals:
            totals[base] += value
            seen = True
        elif base == VLLM_PER_POSITION and labels.get("position", "").isdigit():
            pos = int(labels["position"])
            per_position[pos] = per_position.get(pos, 0.0) + value
            seen = True
    if not seen:
        return None
    positions = tuple(per_position.get(i, 0.0) for i in range(max(per_position) + 1)) if per_position else ()
    return VllmCounters(totals[VLLM_DRAFTS], totals[VLLM_DRAFT_TOKENS], totals[VLLM_ACCEPTED], positions)


def vllm_figures(before: VllmCounters, after: VllmCounters) -> SpecFigures:
    """One request's figures: the counters' growth across it."""
    drafts = round(after.drafts - before.drafts)
    accepted_per_position = [round(a - (before.per_position[i] if i < len(before.per_position) else 0.0))
                             for i, a in enumerate(after.per_position)]
    while accepted_per_position and accepted_per_position[-1] == 0 and drafts == 0:
        accepted_per_position.pop()
    return SpecFigures(
        source="vLLM /metrics",
        drafts=drafts,
        draft_tokens=round(after.draft_tokens - before.draft_tokens),
        accepted_tokens=round(after.accepted - before.accepted),
        accepted_per_position=accepted_per_position,
        # Every vLLM draft proposes all positions, so each position was drafted `drafts` times
        # (vLLM's per-position rate is accepted_per_pos[i] / num_drafts).
        drafts_per_position=[drafts] * len(accepted_per_position),
    )


def vllm_request_figures(stats: dict) -> Optional[SpecFigures]:
    """From the per-request `metrics.speculative_decoding` of a vLLM started with
    `--per-request-spec-decode-metrics` (this reply's own figures, nobody else's).
    `acceptance_histogram[j]` counts the verify passes that accepted exactly j drafts (a dense list,
    or a mapping from j); every pass drafted `num_spec_tokens`."""
    steps, drafted, accepted = (_int(stats.get(k)) for k in ("num_spec_steps", "num_draft_tokens",
                                                              "num_accepted_draft_tokens"))
    if steps is None or accepted is None:
        return None
    hist = stats.get("acceptance_histogram")
    if isinstance(hist, dict):
        hist = {int(k): _int(v) or 0 for k, v in hist.items() if str(k).isdigit()}
    elif isinstance(hist, list):
        hist = {j: _int(v) or 0 for j, v in enumerate(hist)}
    else:
        hist = {}
    width = _int(stats.get("num_spec_tokens")) or (max(hist) if hist else 0)
    per_position = [sum(n for j, n in hist.items() if j > i) for i in range(width)] if hist else []
    return SpecFigures(source="vLLM per-request metrics", drafts=steps, draft_tokens=drafted or 0,
                       accepted_tokens=accepted, accepted_per_position=per_position,
                       drafts_per_position=[steps] * len(per_position))


# --------------------------------------------------------------------------- SGLang

def _int(value) -> Optional[int]:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def sglang_figures(meta_info: dict) -> Optional[SpecFigures]:
    """From SGLang's per-request meta_info; None when it carries no verify count."""
    verify = _int(meta_info.get("spec_verify_ct"))
    if verify is None:
        return None
    accepted = _int(meta_info.get("spec_accept_token_num"))
    if accepted is None:
        completion = _int(meta_info.get("completion_tokens"))
        if completion is None:
            return None
        # SGLang's own accept length is completion_tokens / spec_verify_ct: each verify pass
        # emits its accepted drafts plus one token of the target's.
        accepted = max(0, completion - verify)
    return SpecFigures(source="SGLang meta_info", drafts=verify, accepted_tokens=accepted,
                       draft_tokens=_int(meta_info.get("spec_draft_token_num")) or 0)


# ---------------------------------------------------------------------- llama-server

def llama_server_figures(timings: dict) -> Optional[SpecFigures]:
    """From llama-server's `timings`; None when it has no draft counts.

    llama-server counts drafted and accepted tokens but not verify passes: every decode pass
    after the first token counts as one (tokens - accepted - 1), which is exact when the server
    drafts on every pass (a draft model) and understates the mean acceptance length otherwise."""
    drafted = _int(timings.get("draft_n"))
    accepted = _int(timings.get("draft_n_accepted"))
    if drafted is None or accepted is None:
        return None
    return SpecFigures(source="llama-server timings", drafts=None, draft_tokens=drafted, accepted_tokens=accepted)
