"""From a profile's method to llama-server's command line, and from its stream to passes."""
from __future__ import annotations

from pathlib import Path

import pytest

from specchat.backends.base import BackendError
from specchat.backends.llamaserver.backend import PassGrouper, Piece, spec_counters
from specchat.backends.llamaserver.flags import server_args, spec_label, speculation_args


def test_methods_map_to_llama_cpp_types_with_only_the_sizes_given():
    assert speculation_args("none") == []
    assert speculation_args("ngram") == ["--spec-type", "ngram-simple"]  # llama.cpp's own defaults
    assert speculation_args("ngram", depth=3, lookup=2) == [
        "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2", "--spec-ngram-simple-size-m", "3"]
    assert speculation_args("ngram", ngram_type="ngram-map-k", depth=5)[-2:] == ["--spec-ngram-map-k-size-m", "5"]
    assert speculation_args("ngram", ngram_type="ngram-mod", depth=8, lookup=4) == [
        "--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "4", "--spec-ngram-mod-n-max", "8",
        "--spec-ngram-mod-n-min", "1"]
    assert speculation_args("draft", drafter=Path("d.gguf"), depth=4) == [
        "--spec-type", "draft-simple", "-md", "d.gguf", "--spec-draft-n-max", "4", "--spec-draft-n-min", "0"]


def test_model_drafters_map_to_llama_cpp_draft_types_with_their_file():
    for method, kind in (("eagle3", "draft-eagle3"), ("dflash", "draft-dflash"), ("dspark", "draft-dspark"),
                         ("mtp", "draft-mtp")):
        assert speculation_args(method, drafter=Path("h.gguf")) == ["--spec-type", kind, "-md", "h.gguf"]
        assert speculation_args(method, drafter=Path("h.gguf"), depth=3, p_min=0.25) == [
            "--spec-type", kind, "-md", "h.gguf", "--spec-draft-n-max", "3", "--spec-draft-n-min", "0",
            "--spec-draft-p-min", "0.25"]
    # MTP without a file: the target's own nextn layers
    assert speculation_args("mtp", depth=2) == ["--spec-type", "draft-mtp", "--spec-draft-n-max", "2",
                                                "--spec-draft-n-min", "0"]
    assert speculation_args("ngram", ngram_type="ngram-cache", depth=8) == ["--spec-type", "ngram-cache"]
    assert spec_label(speculation_args("eagle3", drafter=Path("h.gguf"), depth=1)) == "draft-eagle3 ×1"
    assert spec_label(speculation_args("mtp")) == "draft-mtp"


def test_what_llama_server_cannot_run_is_one_line():
    with pytest.raises(BackendError, match="GGUF"):
        speculation_args("draft", drafter=Path("a-directory"))
    with pytest.raises(BackendError, match="ngram, draft, mtp, eagle3, dflash, dspark, not 'suffix'"):
        speculation_args("suffix")
    for method in ("eagle3", "dflash", "dspark"):
        with pytest.raises(BackendError, match=f"{method} drafter must be a GGUF file"):
            speculation_args(method, drafter=None)
    with pytest.raises(BackendError, match="p_min applies to a model drafter"):
        speculation_args("ngram", p_min=0.5)
    with pytest.raises(BackendError, match="unknown llama.cpp n-gram type"):
        speculation_args("ngram", ngram_type="ngram-fancy")


def test_command_line_and_label():
    args = server_args(Path("m.gguf"), "smollm2", 2048, 2, spec=speculation_args("ngram", depth=3), extra=["-b", "64"])
    assert args[:6] == ["-m", "m.gguf", "--alias", "smollm2", "-c", "2048"]
    assert "--metrics" in args and args[args.index("-t") + 1] == "2" and args[-2:] == ["-b", "64"]
    assert "--no-repack" in server_args(Path("m.gguf"), "m", 64, 0, repack=False)
    assert spec_label(speculation_args("ngram", depth=3)) == "ngram-simple ×3"
    assert spec_label([]) == "target-only"


def piece(ids, text, drafted=None, accepted=None, stop=None):
    return Piece(list(ids), text, drafted, accepted, [None] * len(ids), stop)


def test_cumulative_draft_counts_group_tokens_into_passes():
    g = PassGrouper()
    steps = [s for p in (piece([1], "a"), piece([2], "b"),
                         piece([3], "c", 4, 4), piece([4], "d", 4, 4), piece([5], "e", 4, 4), piece([6], "f", 4, 4),
                         piece([7], "g", 4, 4),  # the pass: 4 accepted + its own token
                         piece([8], "h", 7, 4),  # a draft of 3, none accepted
                         piece([9], "i", 7, 4),  # no draft this time
                         piece([10], "j", 11, 6), piece([11], "k", 11, 6))  # cut short by the end of sequence
             for s in g.add(p)] + list(g.flush())
    assert [(s.token_ids, s.drafted, s.accepted) for s in steps] == [
        ([1], 0, 0), ([2], 0, 0), ([3, 4, 5, 6, 7], 4, 4), ([8], 3, 0), ([9], 0, 0), ([10, 11], 4, 2)]
    assert "".join(s.text for s in steps) == "abcdefghijk"


def test_a_native_chunk_and_the_counters():
    p = Piece.of({"content": "hi", "tokens": [5], "stop": False, "timings": {"draft_n": 3, "draft_n_accepted": 1},
                  "completion_probabilities": [{"id": 5, "top_logprobs": [{"id": 5, "logprob": -0.1},
                                                                         {"id": 9, "logprob": -2.0}]}]})
    assert (p.token_ids, p.text, p.drafted, p.accepted, p.stop_type) == ([5], "hi", 3, 1, None)
    assert p.alternatives == [[(5, -0.1), (9, -2.0)]]
    assert Piece.of({"content": "", "tokens": [], "stop": True, "stop_type": "eos"}).stop_type == "eos"
    text = "\n".join(["# HELP llamacpp:spec_decode_num_drafts_total x", "llamacpp:spec_decode_num_drafts_total 5",
                      "llamacpp:spec_decode_num_draft_tokens_total 20", "llamacpp:spec_decode_num_accepted_tokens_total 9",
                      'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 4',
                      'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 3',
                      "llamacpp:prompt_tokens_total 99"])
    c = spec_counters(text)
    assert (c.drafts, c.draft_tokens, c.accepted, c.accepted_per_position) == (5, 20, 9, (4, 3))
    assert c.since(spec_counters("llamacpp:spec_decode_num_drafts_total 2")).drafts == 3


def test_tokens_whose_ids_the_server_withheld_are_counted_and_the_ids_left_out():
    """llama-server sends no chunk for a token whose text ends inside a UTF-8 character; the chunk
    that completes it names only its own token, and `tokens_predicted` counts both."""
    from specchat.backends.llamaserver.backend import _withheld

    assert Piece.of({"content": "é", "tokens": [7], "stop": False, "tokens_predicted": 3}).predicted == 3
    g, received, steps = PassGrouper(), 0, []
    for p in (Piece([1], "a", None, None, [None], None, 1), Piece([4], "日", None, None, [None], None, 3),
              Piece([5], "b", 2, 1, [None], None, 4), Piece([8], "本", 2, 1, [None], None, 6),
              Piece([], "", None, None, [], "limit", 7)):  # the reply ended inside a character
        p = _withheld(p, received)
        received += p.count
        steps += list(g.add(p))
    steps += list(g.flush())
    assert [(s.token_ids, s.n_tokens, s.text) for s in steps] == [([1], 1, "a"), ([4], 2, "日"), ([5, 8], 3, "b本"),
                                                                  ([], 1, "")]
    assert received == 7
