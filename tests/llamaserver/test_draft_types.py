"""llama.cpp's model draft types on a real llama-server, with specchat's shipped SmolLM2 drafters
(EAGLE-3, DFlash, DSpark) exported in llama.cpp's layouts: the server loads them, drafts, and streams token ids with the
passes its counters report."""
from __future__ import annotations

from pathlib import Path

import pytest

from specchat.backends.base import BackendError, Request, Sampling, Step, Summary
from specchat.backends.llamaserver.drafter_export import export
from specchat.backends.llamaserver.flags import speculation_args

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the first test may build llama-server

DRAFTERS = Path(__file__).resolve().parents[2] / "profiles" / "drafters"
CODE = [{"role": "user", "content": "Write a Python function that reverses a list, with an example."}]


@pytest.mark.parametrize("method", ["eagle3", "dflash", "dspark"])
def test_an_exported_drafter_drafts_on_llama_server(method, start, default_gguf, tmp_path):
    drafter = export(method, DRAFTERS / f"smollm2-{method}", default_gguf, tmp_path / f"{method}.gguf")
    server = start(speculation_args(method, drafter=drafter, depth=3))
    assert server.spec_label == f"draft-{method} ×3"
    events = list(server.stream(Request(messages=CODE), Sampling(max_tokens=64)))
    steps, last = events[:-1], events[-1]
    assert steps and all(isinstance(e, Step) for e in steps) and isinstance(last, Summary)
    assert last.token_ids == [t for s in steps for t in s.token_ids] and last.tokens == 64
    assert last.text == server.detokenize(last.token_ids)
    assert last.spec_source == "llama-server /metrics"
    # a trained drafter's guesses land: more than one token a pass, the first position most often
    assert last.draft_tokens > 0 and last.accepted_tokens > 0 and last.tokens / last.passes > 1.1
    assert last.accepted_per_position[0] == max(last.accepted_per_position)


def test_mtp_on_a_target_without_mtp_layers_is_one_line(start):
    """SmolLM2 (llama architecture) has no nextn layers: llama-server refuses draft-mtp, and says so."""
    with pytest.raises(BackendError, match="llama-server"):
        start(speculation_args("mtp", depth=1))
