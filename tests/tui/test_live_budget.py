"""Live figures and the render budget, without a UI."""
import queue
import threading

from specchat.backends.base import Request, Sampling
from specchat.live import Failed, LiveStats, pump
from specchat.tui import budget as budget_mod
from specchat.tui.budget import RenderBudget
from tests.scripted import ScriptedBackend


def test_live_stats_per_pass_and_positions():
    b = ScriptedBackend(["a b c d e f g h"], accept=[3, 1, 0], depth=3)
    q = queue.Queue()
    summary = pump(b, Request(messages=[{"role": "user", "content": "x"}]), Sampling(), threading.Event(), q)
    live = LiveStats()
    items = []
    while not q.empty():
        items.append(q.get())
    for it in items[:-1]:
        live.add(it.event, it.at)
    assert live.per_pass == [4, 2, 1, 1]  # 8 tokens: 3+1, 1+1, 0+1, then 1 left (0 accepted)
    assert live.acceptance_by_position == [2 / 4, 1 / 4, 1 / 4]
    assert abs(live.mean_per_pass - 2.0) < 1e-9
    # the accepted drafts of a pass are the first characters of its text
    assert items[0].draft_chars == len("a b c")
    live.finish(summary)
    assert live.mean_per_pass == summary.tokens / summary.passes


def test_pump_turns_exceptions_into_one_line():
    b = ScriptedBackend(["x"], fail_with="model file missing: run `specchat pull`")
    q = queue.Queue()
    pump(b, Request(messages=[{"role": "user", "content": "x"}]), Sampling(), threading.Event(), q)
    ev = q.get().event
    assert isinstance(ev, Failed) and ev.message == "model file missing: run `specchat pull`"


def test_render_budget_spaces_redraws_by_their_cost(monkeypatch):
    clock = {"wall": 100.0, "cpu": 5.0}
    monkeypatch.setattr(budget_mod.time, "perf_counter", lambda: clock["wall"])
    monkeypatch.setattr(budget_mod.time, "thread_time", lambda: clock["cpu"])
    b = RenderBudget(share=0.05, min_interval=1 / 30, max_interval=1.0)
    assert b.due()  # the first frame draws at once
    b.drew()
    clock["wall"] += 0.034
    clock["cpu"] += 0.010  # that redraw cost 10 ms of UI time -> wait 200 ms
    assert not b.due() and abs(b.interval - 0.2) < 1e-9
    clock["wall"] += 0.17
    assert b.due()
    b.drew()
    clock["wall"] += 0.034
    clock["cpu"] += 0.0001  # cheap redraws: back to 30 Hz
    assert b.due() and b.interval == 1 / 30
    b.drew()
    clock["cpu"] += 5.0  # a very slow terminal: never less than one redraw a second
    clock["wall"] += 1.0
    assert b.due() and b.interval == 1.0
