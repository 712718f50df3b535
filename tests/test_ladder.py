import json
from xml.etree import ElementTree

import pytest

from specchat.backends.base import BackendError
from specchat import cli, ladder
from tests.native.tiny import add_mtp_head, make_hf_checkpoint


@pytest.fixture
def tiny_mtp_profile(isolated_dirs):
    folder = isolated_dirs / "user-profiles"
    add_mtp_head(make_hf_checkpoint(folder / "tiny", "llama"), "deepseek")
    (folder / "tiny-mtp.yaml").write_text("backend: torch\nmodel: ./tiny\ndtype: float32\ncontext: 256\nthreads: 2\n"
                                          "speculative: {method: mtp, depth: 2}\n")
    (folder / "tiny.yaml").write_text("backend: torch\nmodel: ./tiny\ndtype: float32\ncontext: 256\n")
    return "tiny-mtp"


def test_ladder_measures_every_depth_against_target_only(tiny_mtp_profile, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("the quick brown fox\nhello world, how are you today?\n")
    plot = tmp_path / "ladder.svg"
    assert cli.main(["ladder", "-p", tiny_mtp_profile, "--depths", "1-3", "--prompts", str(prompts),
                     "--max-tokens", "12", "--plot", str(plot), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["depth"] for r in out["rungs"]] == [1, 2, 3]
    for r in out["rungs"]:
        assert r["tokens"] == 24 and r["speedup"] > 0 and 1.0 <= r["mean_accepted"] <= r["depth"] + 1
        assert len(r["acceptance_by_position"]) == r["depth"]
        # the MTP head drafts on every pass, so a pass yields its accepted tokens and costs that over the speed-up
        assert r["tokens_per_pass"] == pytest.approx(r["mean_accepted"], abs=0.5)
        assert r["pass_cost"] == pytest.approx(r["tokens_per_pass"] / r["speedup"])
    assert out["best_depth"] in (1, 2, 3) and out["reference"]["prompts"] == 2
    svg = ElementTree.parse(plot).getroot()  # drawn by matplotlib: both lines, the legend naming them
    texts = {t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")}
    assert {"tokens per drafted pass", "speed-up vs target-only", "draft depth (tokens drafted per pass)"} <= texts
    assert {"1", "2", "3"} <= texts  # the depths, as integer ticks


def test_ladder_renders_a_table_and_chart(tiny_mtp_profile, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("the quick brown fox\n")
    assert cli.main(["ladder", "-p", tiny_mtp_profile, "--depths", "1,2", "--prompts", str(prompts),
                     "--max-tokens", "8"]) == 0
    text = capsys.readouterr().out
    assert "specchat ladder" in text and "speed-up vs target-only" in text and "best depth" in text
    assert "pass cost" in text and "a pass costs" in text


def test_bad_input_is_one_line(tiny_mtp_profile, capsys):
    assert cli.main(["ladder", "-p", tiny_mtp_profile, "--depths", "two"]) == 2
    assert cli.main(["ladder", "-p", "tiny", "--depths", "1-2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "range like 1-6" in err[0] and "no speculative method" in err[1]


def test_parse_depths_and_plateau():
    assert ladder.parse_depths("1-3,5") == [1, 2, 3, 5]
    with pytest.raises(BackendError):
        ladder.parse_depths("0-2")


def test_depths_beyond_a_dflash_block_are_refused(isolated_dirs, tmp_path, capsys):
    from tests.speculative.tiny_dflash import make_dflash_checkpoint

    folder = isolated_dirs / "user-profiles"
    target = make_hf_checkpoint(folder / "tiny", "llama")
    make_dflash_checkpoint(folder / "dflash", target, block_size=4)
    (folder / "tiny-dflash.yaml").write_text("backend: torch\nmodel: ./tiny\ndtype: float32\ncontext: 256\n"
                                             "speculative: {method: dflash, drafter: ./dflash, depth: 3}\n")
    prompts = tmp_path / "p.txt"
    prompts.write_text("the quick brown fox\n")
    capsys.readouterr()  # the checkpoint writers' progress
    assert cli.main(["ladder", "-p", "tiny-dflash", "--depths", "1-6", "--prompts", str(prompts)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "at most 3 tokens per pass; use --depths 1-3" in err.strip().splitlines()[-1]


def test_every_run_starts_from_an_empty_cache(tiny_mtp_profile, monkeypatch):
    """As `verify` runs: a rung that found the prompt cached by the run before would take its first
    token from a one-row pass instead of the prefill's last row (other arithmetic: on the real model
    4 of 16 Spec-Bench replies then differed from the reference's at the first near-tie)."""
    from specchat.profiles import get_profile
    from specchat.prompts import PromptItem

    seen = []
    real = ladder.run_one

    def recording(backend, profile, item):
        engine = getattr(backend, "target", backend)
        seen.append(len(engine.cached))
        return real(backend, profile, item)

    monkeypatch.setattr(ladder, "run_one", recording)
    items = [PromptItem(id=str(i), category="t", turns=[text]) for i, text in enumerate(["the quick brown fox", "hello"])]
    out = ladder.run_ladder(get_profile(tiny_mtp_profile).model_copy(update={"max_tokens": 6}), [1, 2], items)
    assert seen == [0] * 6 and len(out.reference.runs) == 2
