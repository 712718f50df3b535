import json

import pytest

from rich.console import Console

from specchat import bench, cli, loading
from specchat.backends.base import Summary
from specchat.profiles import load_profiles
from specchat.prompts import PromptItem
from tests.native.tiny import make_hf_checkpoint
from tests.scripted import ScriptedBackend


def test_speculative_profiles_get_their_target_only_reference():
    ps = load_profiles()
    rows = bench.plan([ps.get("smollm2-ngram")])
    assert [(label, p.method, ref) for label, p, ref in rows] == [
        ("smollm2-ngram", "ngram", "smollm2-ngram:target-only"), ("smollm2-ngram:target-only", "none", None)]
    rows = bench.plan([ps.get("smollm2"), ps.get("smollm2-ngram")])
    assert [ref for _, _, ref in rows] == [None, "smollm2"]  # an existing target-only row is reused
    # ... but only one that runs the target as the speculative profile does
    other = ps.get("smollm2").with_overrides({"threads": 1, "sampling.temperature": 0.7})
    rows = bench.plan([other, ps.get("smollm2-ngram")])
    assert [ref for _, _, ref in rows] == [None, "smollm2-ngram:target-only", None]
    compiled = ps.get("smollm2-ngram").with_overrides({"compile": True})  # other graphs, other speed
    rows = bench.plan([ps.get("smollm2"), compiled])
    assert [ref for _, _, ref in rows] == [None, "smollm2-ngram:target-only", None]
    assert rows[2][1].compile


def test_llama_server_profiles_share_one_target_only_server_row():
    ps = load_profiles()
    names = ["smollm2-llamaserver", "smollm2-llamaserver-ngram", "smollm2-llamaserver-ngram-mod",
             "smollm2-llamaserver-draft", "smollm2-llamacpp"]
    rows = bench.plan([ps.get(n) for n in names])
    assert [ref for _, _, ref in rows] == [None] + ["smollm2-llamaserver"] * 3 + [None]
    batch = ps.get("smollm2-llamaserver-ngram-mod").with_overrides({"llama_server.args": ["-b", "64"]})
    assert bench.plan([ps.get("smollm2-llamaserver"), batch])[1][2] == "smollm2-llamaserver-ngram-mod:target-only"


def test_a_user_profile_extending_a_shipped_one_shares_its_reference(isolated_dirs):
    folder = isolated_dirs / "user-profiles"
    folder.mkdir()
    (folder / "my-mtp.yaml").write_text("extends: smollm2-mtp\nspeculative: {depth: 2}\n")
    ps = load_profiles()
    rows = bench.plan([ps.get("smollm2"), ps.get("my-mtp")])
    assert [ref for _, _, ref in rows] == [None, "smollm2"]  # the named default model, wherever the profile lives


@pytest.fixture
def tiny_spec_profile(isolated_dirs):
    folder = isolated_dirs / "user-profiles"
    make_hf_checkpoint(folder / "tiny", "llama")
    (folder / "tiny-ngram.yaml").write_text("backend: torch\nmodel: ./tiny\ndtype: float32\ncontext: 256\nthreads: 2\n"
                                            "speculative: {method: ngram, depth: 3}\n")
    return "tiny-ngram"


@pytest.mark.parametrize("mode", [[], ["--sequential"]])
def test_bench_measures_speedup_against_the_reference(tiny_spec_profile, tmp_path, capsys, mode):
    prompts = tmp_path / "p.txt"
    prompts.write_text("the quick brown fox\nhello world, how are you today?\n")
    assert cli.main(["bench", "-p", tiny_spec_profile, "--prompts", str(prompts), "--max-tokens", "12", "--json",
                     *mode]) == 0
    rows = {r["label"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    spec, ref = rows["tiny-ngram"], rows["tiny-ngram:target-only"]
    assert spec["reference"] == "tiny-ngram:target-only" and spec["speedup"] > 0
    assert spec["prompts"] == ref["prompts"] == 2 and spec["tokens"] == ref["tokens"]
    assert spec["mean_accepted"] >= 1.0 and ref["speedup"] is None
    # every pass counts: target-only emits one token per pass, drafting at most mean_accepted
    assert ref["tokens_per_pass"] == 1.0 and 1.0 <= spec["tokens_per_pass"] <= spec["mean_accepted"]


class Paced(ScriptedBackend):
    """Scripted replies at set speeds: the k-th run of a prompt decodes at speeds[k] tok/s (TTFT
    1/speed, so a row's figures show which run it kept); every run is logged as (label, prompt)."""

    def __init__(self, label: str, speeds: list[float], log: list):
        super().__init__(["one two three four five six"])
        self.label, self.speeds, self.log = label, speeds, log

    def stream(self, request, sampling, cancel=None):
        prompt = request.messages[-1]["content"]
        for ev in super().stream(request, sampling, cancel):
            if isinstance(ev, Summary) and prompt != "Hi":  # "Hi": the warm-up
                speed = self.speeds[sum(1 for lab, p in self.log if (lab, p) == (self.label, prompt))]
                self.log.append((self.label, prompt))
                ev.decode_s, ev.ttft_s = (ev.tokens - 1) / speed, 1 / speed
            yield ev


SPEEDS = {"smollm2": [10.0, 30.0, 20.0], "smollm2-ngram": [50.0, 40.0, 60.0]}  # medians 20 and 50


@pytest.fixture
def paced(monkeypatch):
    log: list = []
    monkeypatch.setattr(bench, "load_backend", lambda p: Paced(p.name, SPEEDS[p.name], log))
    return log


@pytest.mark.parametrize("interleave", [True, False])
def test_repeat_runs_each_prompt_n_times_and_keeps_the_median_run(paced, interleave):
    ps = load_profiles()
    prompts = [PromptItem("1", ["first prompt"]), PromptItem("2", ["second prompt"])]
    results = bench.bench([ps.get("smollm2"), ps.get("smollm2-ngram")], prompts, interleave=interleave, repeat=3)
    rows = [("smollm2", p) for p in ("first prompt", "second prompt") for _ in range(3)]
    spec = [("smollm2-ngram", prompt) for _, prompt in rows]
    if interleave:  # the rows take turns on each run of each prompt
        assert paced == [x for pair in zip(rows, spec) for x in pair]
    else:
        assert paced == rows + spec
    ref, ngram = results
    assert [len(r.runs) for r in results] == [2, 2]  # one kept run per prompt
    assert [r.summary.ttft_s for r in ref.runs] == [1 / 20] * 2 and [r.summary.ttft_s for r in ngram.runs] == [1 / 50] * 2
    out = bench.to_json(results)
    assert out["repeat"] == 3 and out["statistic"] == "median"
    by_label = {r["label"]: r for r in out["rows"]}
    assert by_label["smollm2"]["decode_tok_s"] == pytest.approx(20.0)
    assert by_label["smollm2-ngram"]["speedup"] == pytest.approx(2.5) and by_label["smollm2-ngram"]["prompts"] == 2
    assert by_label["smollm2"]["tokens"] == 2 * 6  # the kept runs' tokens, not all six runs'
    console = Console(record=True, width=100)
    console.print(bench.render(results))
    assert "each prompt run 3 times, its median-tok/s run kept" in console.export_text()


def test_an_even_repeat_keeps_the_slower_middle_run():
    runs = [bench.Run(PromptItem("1", ["x"]), Summary("eos", tokens=11, decode_s=10 / s)) for s in (4.0, 1.0, 3.0, 2.0)]
    assert bench.median_run(runs).summary.decode_tok_s == pytest.approx(2.0)
    assert bench.median_run(runs[:1]) is runs[0]


def test_bench_repeat_from_the_command_line(paced, capsys):
    assert cli.main(["bench", "-p", "smollm2", "-p", "smollm2-ngram", "--repeat", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["repeat"] == 3 and out["statistic"] == "median" and len(paced) == 2 * 2 * 3
    assert [r["decode_tok_s"] for r in out["rows"]] == [pytest.approx(20.0), pytest.approx(50.0)]
    paced.clear()
    assert cli.main(["bench", "-p", "smollm2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["repeat"] == 1


@pytest.mark.parametrize("argv", [["bench", "--limit", "-1"], ["bench", "--limit", "0"], ["bench", "--repeat", "0"],
                                  ["bench", "--repeat=-2"], ["bench", "--repeat", "two"], ["verify", "--limit", "0"],
                                  ["ladder", "--limit", "-1"]])
def test_a_count_below_one_is_refused_before_anything_loads(argv, monkeypatch, capsys):
    def no_loading(*_):
        raise AssertionError("loaded a model")

    monkeypatch.setattr(bench, "load_backend", no_loading)
    monkeypatch.setattr(loading, "load_backend", no_loading)
    assert cli.main([argv[0], "-p", "smollm2-ngram", *argv[1:]]) == 2
    err = capsys.readouterr().err
    flag = argv[1].partition("=")[0]
    assert err.startswith(f"specchat: error: {flag} ") and "whole number of 1 or more" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_suffix_profile_with_memory_gets_an_empty_history_row_beside_it():
    ps = load_profiles()
    rows = bench.plan([ps.get("smollm2-ngram"), ps.get("smollm2-suffix")])
    labels = [(label, p.speculative.suffix.history if p.method == "suffix" else None, ref) for label, p, ref in rows]
    assert labels == [("smollm2-ngram", None, "smollm2-ngram:target-only"),
                      ("smollm2-suffix", True, "smollm2-suffix:target-only"),
                      ("smollm2-suffix:empty-history", False, "smollm2-suffix:target-only"),
                      ("smollm2-ngram:target-only", None, None), ("smollm2-suffix:target-only", None, None)]
    no_memory = ps.get("smollm2-suffix").with_overrides({"speculative.suffix.history": False})
    assert [label for label, _, _ in bench.plan([no_memory])] == ["smollm2-suffix", "smollm2-suffix:target-only"]


def test_bench_warms_the_suffix_memory_with_the_runs_earlier_replies_only(isolated_dirs, capsys):
    from specchat.history import History

    folder = isolated_dirs / "user-profiles"
    make_hf_checkpoint(folder / "tiny", "llama")
    (folder / "tiny-suffix.yaml").write_text("backend: torch\nmodel: ./tiny\ndtype: float32\ncontext: 256\nthreads: 2\n"
                                             "speculative: {method: suffix, depth: 4}\n")
    history = History()  # the user's own replies: a bench never reads them
    history.add_message(history.new_conversation(), "assistant", "a reply from the user's own history")
    ps = load_profiles()
    prompts = [PromptItem(str(i), [text]) for i, text in enumerate(["the quick brown fox", "hello world", "the quick"])]
    results = bench.bench([ps.get("tiny-suffix")], prompts, repeat=2)
    warm, empty, ref = results
    assert (warm.label, empty.label) == ("tiny-suffix", "tiny-suffix:empty-history")
    assert [r.memory for r in warm.runs] == [(0, 0), (1, warm.runs[0].summary.tokens),
                                             (2, warm.runs[0].summary.tokens + warm.runs[1].summary.tokens)]
    assert [r.summary.token_ids for r in warm.runs] == [r.summary.token_ids for r in ref.runs]  # parity, warm or not
    assert all(r.memory is None for r in empty.runs)
    out = {r["label"]: r for r in bench.to_json(results)["rows"]}
    assert out["tiny-suffix"]["suffix_memory"]["replies"] == [0, 2] and out["tiny-suffix:empty-history"]["suffix_memory"] is None
    console = Console(record=True, width=100)
    console.print(bench.render(results))
    text = " ".join(console.export_text().split())
    assert "tiny-suffix: the suffix memory held the run's earlier replies, 0 to 2" in text
    assert "tiny-suffix:empty-history: the same drafter with no memory of earlier replies" in text


def test_a_backend_running_below_its_best_here_says_so_under_the_table(monkeypatch):
    """A peer that runs handicapped on this machine (llama.cpp in-process without its AMX buffers)
    is never read without its line: under the table, and in the JSON."""
    log: list = []

    def load(p):
        backend = Paced(p.name, SPEEDS[p.name], log)
        if p.name == "smollm2":
            backend.caveat = "its extra CPU buffers are off here"
        return backend

    monkeypatch.setattr(bench, "load_backend", load)
    ps = load_profiles()
    results = bench.bench([ps.get("smollm2"), ps.get("smollm2-ngram")], [PromptItem("1", ["first prompt"])])
    console = Console(record=True, width=100)
    console.print(bench.render(results))
    assert "smollm2: its extra CPU buffers are off here" in console.export_text()
    rows = {r["label"]: r for r in bench.to_json(results)["rows"]}
    assert rows["smollm2"]["caveat"] == "its extra CPU buffers are off here" and rows["smollm2-ngram"]["caveat"] is None
