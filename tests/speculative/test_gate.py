"""The draft gate: drafting pauses where it does not pay, comes back to check, and never changes
what is emitted."""
import random
import time

import pytest

from specchat.backends.base import Request, Sampling, run_to_summary
from specchat.backends.speculative import backend as backend_module
from specchat.backends.speculative.backend import SpeculativeBackend
from specchat.backends.speculative.drafters import LookupFirst
from specchat.backends.speculative.gate import ALL, DraftGate
from specchat.backends.speculative.loop import Draft, Drafter
from specchat.verify import fresh
from tests.speculative.conftest import PROMPTS, SAMPLINGS

PLAIN_SECONDS = 0.010  # a plain pass emits 1 token: 100 tokens per second


def drive(gate: DraftGate, source: str, tokens: float, seconds: float, passes: int) -> list[bool]:
    """Runs `passes` passes against the gate; True where the source sat out."""
    sat_out = []
    for _ in range(passes):
        plan = gate.plan()
        if ALL in plan or source in plan:
            gate.record(None, 1, PLAIN_SECONDS)
            sat_out.append(True)
        else:
            gate.record(source, round(tokens), seconds)
            sat_out.append(False)
    return sat_out


def test_the_first_passes_measure_plain_decoding():
    gate = DraftGate()
    for _ in range(3):
        assert gate.plan() == {ALL}
        gate.record(None, 1, PLAIN_SECONDS)
    assert gate.plan() == frozenset()


def test_one_slow_plain_pass_does_not_stand_for_them_all():
    """The first pass after a load took 30 ms where plain passes take 10: a drafter costing 12 ms a
    pass for one token must still be paused at once, not after hundreds of passes."""
    gate = DraftGate(warmup=3, probe=4, baseline_every=32)
    gate.plan()
    gate.record(None, 1, 0.030)
    sat_out = [True] + drive(gate, "mtp", 1, 0.012, 40)
    assert sat_out[:3] == [True] * 3 and sat_out[3:6] == [False] * 3  # plain passes, then the warm-up
    assert sum(sat_out[6:]) >= 30 and gate.plain.seconds == PLAIN_SECONDS


def test_a_source_slower_than_plain_passes_is_paused_and_probed():
    gate = DraftGate(warmup=3, probe=4, baseline_every=1000, first_plain=1)
    sat_out = drive(gate, "mtp", 1, 0.012, 41)  # 83 tokens/s against 100
    assert sat_out[0] and sat_out[1:4] == [False] * 3  # the baseline, then the warm-up drafts
    # a probe after 4 passes, then after 8, 16, ...: each probe that leaves it paused doubles the wait
    assert sat_out[4:] == [True] * 3 + [False] + [True] * 7 + [False] + [True] * 15 + [False] + [True] * 9


def test_probes_of_a_source_that_never_pays_grow_rare_and_come_back_to_often_once_it_pays():
    gate = DraftGate(warmup=3, probe=8, baseline_every=10**6, max_probe=64)
    sat_out = drive(gate, "mtp", 1, 0.020, 1000)  # 50 tokens/s against 100
    assert 1000 - sum(sat_out) <= 3 + 8 + 1000 // 64  # warm-up, the probes while they grow, then one in 64
    back = drive(gate, "mtp", 4, 0.012, 300)  # the text turned its way: probes that pay come soon again
    assert not any(back[-100:])
    assert gate._interval == {}


def test_a_source_far_below_plain_passes_sits_out_before_its_warm_up_ends():
    gate = DraftGate(warmup=8, probe=8, baseline_every=1000, first_plain=1)
    sat_out = drive(gate, "dspark", 1, 0.018, 12)  # 56 tokens/s against 100
    assert sat_out[:4] == [True, False, False, False] and all(sat_out[4:11])  # then a probe
    gate = DraftGate(warmup=8, probe=8, baseline_every=1000, first_plain=1)
    assert drive(gate, "mtp", 1, 0.0115, 12)[1:9] == [False] * 8  # 87 tokens/s: the whole warm-up


def test_a_source_that_pays_keeps_drafting():
    gate = DraftGate(warmup=3, probe=4, baseline_every=1000)
    assert not any(drive(gate, "ngram", 2, 0.013, 40)[3:])  # 154 tokens/s against 100


def test_a_source_only_breaking_even_sits_out_one_that_pays_by_the_margin_drafts():
    """Drafting at break-even buys nothing, and a rate judged over a few passes that seems to break
    even may be a loss."""
    gate = DraftGate(warmup=3, probe=4, baseline_every=1000)
    assert sum(drive(gate, "mtp", 1, 0.0100, 40)) > 25  # 100 tokens/s against 100: paused but for probes
    gate = DraftGate(warmup=3, probe=4, baseline_every=1000)
    assert not any(drive(gate, "mtp", 1, 0.0097, 40)[3:])  # 103 tokens/s: beyond the default 2%
    gate = DraftGate(warmup=3, probe=4, baseline_every=1000, margin=0.05)
    assert sum(drive(gate, "mtp", 1, 0.0097, 40)) > 25


def test_a_probe_counts_for_its_tokens_not_its_catching_up():
    gate = DraftGate(warmup=3, probe=4, baseline_every=1000)
    drive(gate, "mtp", 1, 0.012, 8)  # paused by now
    seconds, passes = gate.sources["mtp"].seconds, gate.sources["mtp"].passes
    sat_out = drive(gate, "mtp", 1, 0.050, 16)  # probes, slow because the drafter catches up
    probes = sat_out.count(False)
    assert probes >= 1 and gate.sources["mtp"].passes == passes + probes and gate.sources["mtp"].seconds == seconds


def test_a_paused_source_comes_back_when_it_pays_again():
    gate = DraftGate(warmup=3, probe=4, baseline_every=1000)
    assert sum(drive(gate, "lookup", 1, 0.012, 20)) > 10
    back = drive(gate, "lookup", 3, 0.013, 40)  # the text turned into a quote: long accepted runs
    assert not any(back[-20:])


def test_plain_decoding_is_measured_again_as_the_reply_grows():
    gate, baselines = DraftGate(warmup=1, baseline_every=5, first_plain=1), []
    for n in range(1, 16):
        if ALL in gate.plan():
            gate.record(None, 1, PLAIN_SECONDS)
            baselines.append(n)
        else:
            gate.record("mtp", 2, 0.011)  # a source that pays: only the baseline passes are plain
    assert baselines == [1, 5, 10, 15]


class Scripted(Drafter):
    name = "mtp"

    def __init__(self):
        self.calls = 0

    def propose(self, tokens, depth):
        self.calls += 1
        return Draft([7])


def test_lookup_keeps_drafting_while_the_model_half_sits_out():
    model = Scripted()
    drafter = LookupFirst(model, lookup_depth=3, n_min=1, n_max=2)
    assert drafter.sources == ("lookup", "mtp")
    drafter.paused = frozenset({"mtp"})
    assert drafter.propose([1, 2, 3, 1, 2], 3) == Draft([3, 1], source="lookup")  # a 2-token match drafts 2
    assert drafter.propose([5, 6], 3) == Draft([]) and model.calls == 0
    drafter.paused = frozenset()
    assert drafter.propose([5, 6], 3) == Draft([7], source="mtp") and model.calls == 1
    drafter.paused = frozenset({"lookup"})
    assert drafter.propose([1, 2, 3, 1, 2], 3) == Draft([7], source="mtp")


def test_lookup_drafts_to_its_own_depth_not_the_models():
    model = Scripted()
    drafter = LookupFirst(model, lookup_depth=4, n_min=1, n_max=4, model_depth=1)
    drafter.plan_depth(1)  # the profile's depth: the model drafter's
    assert drafter.propose([1, 2, 3, 4, 5, 6, 1, 2, 3, 4], 8) == Draft([5, 6, 1, 2], source="lookup")
    assert drafter.propose([1, 2, 3, 4, 5, 6, 7, 2, 3, 4], 8) == Draft([5, 6, 7], source="lookup")
    assert drafter.propose([9, 8], 8) == Draft([7], source="mtp")


class SlowAndWrong(Drafter):
    """Guesses token 0 after a 50 ms think: never worth a pass, however busy the machine."""

    name = "slow"

    def __init__(self):
        self.passes = 0

    def propose(self, tokens, depth):
        self.passes += 1
        time.sleep(0.05)
        return Draft([0] * depth)


def test_a_drafter_that_never_pays_sits_out_and_the_reply_is_the_same(target):
    request, sampling = Request(messages=PROMPTS[0]), Sampling(max_tokens=48)
    ref = run_to_summary(fresh(target).stream(request, sampling))
    always, gated = SlowAndWrong(), SlowAndWrong()
    out_always = run_to_summary(fresh(SpeculativeBackend(target, always, 2)).stream(request, sampling))
    out_gated = run_to_summary(fresh(SpeculativeBackend(target, gated, 2, adaptive=True)).stream(request, sampling))
    assert out_always.token_ids == out_gated.token_ids == ref.token_ids
    assert always.passes > 30 and gated.passes <= always.passes // 3


def test_what_the_gate_learned_carries_into_the_next_reply(target):
    """A chat's replies are short: a drafter that does not pay must not get a warm-up of drafted passes
    again in each of them."""
    request, sampling = Request(messages=PROMPTS[0]), Sampling(max_tokens=48)
    drafter = SlowAndWrong()
    spec = SpeculativeBackend(target, drafter, 2, adaptive=True)
    first = run_to_summary(fresh(spec).stream(request, sampling))
    in_first = drafter.passes
    second = run_to_summary(fresh(spec).stream(request, sampling))
    assert second.token_ids == first.token_ids
    assert in_first >= 3 and drafter.passes - in_first <= 2  # a probe or two, no second warm-up
    assert second.paused_passes >= 0.9 * second.passes  # all but a probe and the plain passes the gate times


def test_passes_of_another_kind_are_measured_afresh(target, monkeypatch):
    spec = SpeculativeBackend(target, SlowAndWrong(), 2, adaptive=True)
    run_to_summary(fresh(spec).stream(Request(messages=PROMPTS[0]), Sampling(max_tokens=8)))
    learned = spec.gate
    monkeypatch.setattr(target, "switch_if_ready", lambda: None)
    spec.switch_if_ready()
    assert spec.gate is learned
    monkeypatch.setattr(target, "switch_if_ready", lambda: "compiled graphs from here on")
    spec.switch_if_ready()
    assert spec.gate is None


def test_a_paused_drafter_says_so_and_why(target):
    request, sampling = Request(messages=PROMPTS[0]), Sampling(max_tokens=48)
    out = run_to_summary(fresh(SpeculativeBackend(target, SlowAndWrong(), 2, adaptive=True)).stream(request, sampling))
    assert out.paused_passes > out.passes // 2
    assert out.paused_note.startswith("drafting paused: slow 1.00 tok/drafted pass, ")
    needed = float(out.paused_note.split(", ")[1].split()[0])
    assert needed > 2  # a 50 ms proposal costs several plain passes of the tiny target


def test_the_reason_names_only_the_sources_held_back():
    gate = DraftGate(warmup=3, probe=4, baseline_every=1000)
    drive(gate, "mtp", 1, 0.012, 10)
    assert gate.why_paused(frozenset({ALL})) == ""  # a baseline pass holds nothing back
    assert gate.why_paused(frozenset({"mtp"}), every=False) == "paused: mtp 1.00 tok/drafted pass, 1.22 needed to pay"


class RandomGate(DraftGate):
    """Pauses a random subset of sources every pass: any pattern of drafting and sitting out."""

    def __init__(self):
        super().__init__()
        self.random = random.Random(0)

    def plan(self):
        return frozenset(s for s in ("lookup", "mtp", "draft", "ngram", "dflash", ALL) if self.random.random() < 0.4)


@pytest.mark.parametrize("method", ["ngram", "mtp", "draft", "dflash", "mtp+lookup", "draft+lookup"])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "t0.8", "t1.2-topk-topp"])
def test_any_pattern_of_pauses_keeps_the_reply(target, drafters, method, sampling, monkeypatch):
    monkeypatch.setattr(backend_module, "DraftGate", RandomGate)
    request = Request(messages=PROMPTS[1])
    ref = run_to_summary(fresh(target).stream(request, sampling))
    spec = SpeculativeBackend(target, drafters[method]("exact"), 3, adaptive=True)
    out = run_to_summary(fresh(spec).stream(request, sampling))
    assert out.token_ids == ref.token_ids and out.stop_reason == ref.stop_reason


class ListeningGate(DraftGate):
    """Never pauses; keeps what the loop tells it about each pass."""

    heard: list[tuple[str | None, int]] = []

    def plan(self):
        return frozenset()

    def record(self, source, tokens, seconds):
        ListeningGate.heard.append((source, tokens))
        super().record(source, tokens, seconds)


def test_the_gate_hears_each_pass_with_the_source_that_drafted_it(target, drafters, monkeypatch):
    monkeypatch.setattr(backend_module, "DraftGate", ListeningGate)
    monkeypatch.setattr(ListeningGate, "heard", [])
    spec = SpeculativeBackend(target, drafters["ngram"]("exact"), 3, adaptive=True)
    events = list(fresh(spec).stream(Request(messages=PROMPTS[1]), Sampling(max_tokens=40)))
    passes = events[1:-1]  # after the prefill's token, one step per verify pass
    assert any(p.drafted for p in passes) and not all(p.drafted for p in passes)
    assert ListeningGate.heard == [("ngram" if p.drafted else None, len(p.token_ids)) for p in passes]
