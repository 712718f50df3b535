"""GGUF files with MTP (nextn) layers on the native engine (gguf_archs.py, gguf_mtp.py): tiny qwen35,
qwen35moe and glm4moe checkpoints written by transformers with MTP heads, converted by llama.cpp's own
converter. The file's main model scores as transformers does on the checkpoint; loaded through a
profile it gives the same reply and the same MTP drafts as the checkpoint directory; `verify` finds
no mismatch; and a file without MTP layers is one clear line."""
from __future__ import annotations

import json

import pytest
import torch

from specchat import cli
from specchat.backends.base import BackendError, Request, Sampling, run_to_summary
from specchat.backends.native import gguf_loader, q4_kernel
from specchat.backends.native.engine import TorchBackend
from specchat.backends.native.gguf_mtp import read_gguf_mtp
from specchat.backends.native.mtp import read_mtp
from specchat.loading import load_speculative
from specchat.profiles import Profile
from tests.native.tiny import assert_reply_and_logits_match
from tests.native.tiny_mtp import MTP_ARCHS

# max |logit difference| of the float32 engine against transformers on the same weights (logits O(5));
# the Gated DeltaNet's decay is stored as -exp(A_log) in the file, a float32 rounding away from the checkpoint's
FP32_TOL = 2e-4
PROMPT = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog. Paris is the capital of"}]


@pytest.mark.parametrize("arch", MTP_ARCHS)
def test_the_file_replies_and_scores_as_transformers(mtp_ggufs, arch):
    from transformers import AutoModelForCausalLM

    e = TorchBackend(mtp_ggufs[arch], threads=2, context=256, precision="float32")
    cfg = e.model.cfg
    assert cfg.arch == arch and cfg.n_layers == (3 if arch == "glm4moe" else 4)  # the nextn block is not a layer
    assert cfg.hybrid == (arch != "glm4moe") and (cfg.moe is not None) == (arch != "qwen35")
    ref = AutoModelForCausalLM.from_pretrained(str(mtp_ggufs[arch, "hf"]), dtype=torch.float32).eval()
    assert_reply_and_logits_match(e, ref, max_tokens=12, atol=FP32_TOL)


@pytest.mark.parametrize("arch", MTP_ARCHS)
def test_the_files_mtp_head_is_the_directorys(mtp_ggufs, arch):
    """Every tensor of the MTP layer as the directory reader gives it (norms with their 1, Qwen3.5's
    gate rows, the experts one by one)."""
    e = TorchBackend(mtp_ggufs[arch], threads=2, context=64, precision="float32")
    from_file = read_gguf_mtp(mtp_ggufs[arch], e.model.cfg)
    from_dir = read_mtp(mtp_ggufs[arch, "hf"], e.model.cfg)
    assert from_file.layout == from_dir.layout and len(from_file.layers) == len(from_dir.layers) == 1
    got, want = from_file.layers[0], from_dir.layers[0]
    assert set(got) == set(want)
    for key, w in want.items():
        if key == "experts":
            assert got[key].count == w.count
            for i in range(w.count):
                assert all(torch.equal(a, b) for a, b in zip(got[key].matrices(i), w.matrices(i))), (key, i)
        else:
            assert torch.equal(got[key], w), key


def spec_run(model, messages, sampling: Sampling, depth: int = 3):
    """The reply of an MTP profile on `model`, and every draft its head proposed (tokens, in order);
    drafting on every pass (`adaptive` off: the gate's choice follows measured times, which differ)."""
    profile = Profile(name="t", model=str(model), dtype="float32", context=256, threads=2,
                      speculative={"method": "mtp", "depth": depth, "adaptive": False})
    spec = load_speculative(profile)
    drafts = []
    propose = spec.drafter.propose

    def recording(tokens, d):
        draft = propose(tokens, d)
        drafts.append((len(tokens), list(draft.tokens)))
        return draft

    spec.drafter.propose = recording
    try:
        return run_to_summary(spec.stream(Request(messages=messages), sampling)), drafts
    finally:
        spec.close()


@pytest.mark.parametrize("arch", MTP_ARCHS)
@pytest.mark.parametrize("sampling", [Sampling(max_tokens=16), Sampling(temperature=0.8, seed=5, max_tokens=16)],
                         ids=["greedy", "t0.8"])
def test_the_file_drafts_as_the_directory(mtp_ggufs, arch, sampling):
    """`model: FILE.gguf` with method mtp drafts from the file's own head: the reply and every draft
    are the directory's, and the target keeps some of them (the head is in the loop)."""
    reply, drafts = spec_run(mtp_ggufs[arch], PROMPT, sampling)
    want_reply, want_drafts = spec_run(mtp_ggufs[arch, "hf"], PROMPT, sampling)
    assert reply.token_ids == want_reply.token_ids and len(reply.token_ids) >= 10
    assert drafts == want_drafts and len(drafts) >= 6
    assert reply.draft_tokens == want_reply.draft_tokens > 0


def write_prompts(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "turns": [t]}) + "\n" for i, t in
                               enumerate(["the quick brown fox", "Paris is the capital of France."])))
    return prompts


@pytest.mark.parametrize("key, dtype", [("qwen35", "float32"), ("glm4moe", "float32"), (("qwen35", "Q8_0"), "auto"),
                                        (("glm4moe", "Q8_0"), "auto")],
                         ids=["qwen35", "glm4moe", "qwen35-Q8_0-kernels", "glm4moe-Q8_0-kernels"])
def test_verify_with_an_mtp_profile_on_the_file_finds_no_mismatch(mtp_ggufs, key, dtype, isolated_dirs, tmp_path,
                                                                  capsys):
    """A shipped MTP profile with its model replaced by the file (`--set model=FILE.gguf`); the Q8_0
    files on specchat's kernels (their blocks: the Gated DeltaNet's matrices, the routed and shared
    experts), strict verification."""
    prompts = write_prompts(tmp_path)
    for extra in ([], ["--temperature", "0.7"]):
        code = cli.main(["verify", "-p", "qwen3.5-0.8b-mtp", "--set", f"model={mtp_ggufs[key]}", "--set",
                         f"dtype={dtype}", "--set", "context=256", "--set", "speculative.depth=3", "--prompts",
                         str(prompts), "--max-tokens", "20", "--json", *extra])
        out = json.loads(capsys.readouterr().out)
        assert code == 0 and out["mismatches"] == 0 and len(out["prompts_checked"]) == 2, out


def test_q8_0_files_run_their_blocks_on_the_kernels(mtp_ggufs):
    """qwen35's value-head order is run as stored (config.LinearAttentionShape.tiled), so its Gated
    DeltaNet matrices stay Q8_0 blocks on specchat's kernels, as glm4moe's routed and shared experts do; with their int8 activations the
    greedy choice is the float32 engine's on the same file's weights wherever that one's is clear
    (top-2 margin of half a logit or more; logits here O(5)), and on most positions: measured 42 of
    47, the other five near-ties (margins 0.05-0.17; largest logit error 0.51)."""
    if not q4_kernel.available():
        pytest.skip("specchat's kernels could not be built here")
    e = TorchBackend(mtp_ggufs["qwen35", "Q8_0"], threads=2, context=256)
    assert e.precision == "int4" and e.model.cfg.linear.tiled
    mixer = e.model.layers[0].mixer
    assert mixer.out.kq is not None and e.model.layers[1].attention.o.kq is not None
    f32 = TorchBackend(mtp_ggufs["qwen35", "Q8_0"], threads=2, context=256, precision="float32")
    ids = f32.tokenize_chat(PROMPT)
    got, want = e.forward(ids, 0)[0], f32.forward(ids, 0)[0]
    top2 = want.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] >= 0.5
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.85
    assert clear.sum() >= 10 and torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
    glm = TorchBackend(mtp_ggufs["glm4moe", "Q8_0"], threads=2, context=64).model.layers[1].mlp
    assert all(m.kq is not None for m in (*glm.expert_linears(), glm.shared.gate_up, glm.shared.down))


def test_dash_m_with_the_file_drafts_from_its_mtp_layers(mtp_ggufs, isolated_dirs, capsys):
    assert cli.main(["run", "-m", str(mtp_ggufs["qwen35"]), "--json", "--max-tokens", "8", "--set", "dtype=float32",
                     "the quick brown fox"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == "mtp" and out["engine"] == "specchat (native)" and out["tokens"] == 8
    assert "the file's own MTP (nextn) layers" in out["engine_reason"]


def test_an_mtp_profile_on_a_file_without_mtp_layers_is_one_line(tiny_ggufs, isolated_dirs, capsys):
    code = cli.main(["run", "-p", "qwen3.5-0.8b-mtp", "--set", f"model={tiny_ggufs['F32']}", "hi"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "carries no MTP layers (llama files have none)" in err and "speculative.drafter" in err


def test_a_qwen35_file_converted_without_its_mtp_layers_says_so(mtp_ggufs, monkeypatch):
    """The same file as if converted with --no-mtp: no `nextn_predict_layers`, so no head."""
    index = gguf_loader.read_index(mtp_ggufs["qwen35"])
    del index.fields["qwen35.nextn_predict_layers"]
    index.tensors = {n: t for n, t in index.tensors.items() if not n.startswith("blk.4.")}
    index.fields["qwen35.block_count"] = 4
    monkeypatch.setattr(gguf_loader, "read_index", lambda *a, **k: index)
    monkeypatch.setattr("specchat.backends.native.gguf_mtp.read_index", lambda *a, **k: index)
    profile = Profile(name="t", model=str(mtp_ggufs["qwen35"]), dtype="float32", context=64,
                      speculative={"method": "mtp"})
    with pytest.raises(BackendError, match=r"carries no MTP layers \(no `qwen35.nextn_predict_layers`.*--no-mtp\); "
                                           "use a GGUF of this model converted with its MTP layers"):
        load_speculative(profile)


def test_an_mtp_profile_on_a_file_the_engine_does_not_run_points_to_llama_server(mtp_ggufs, monkeypatch):
    """A file with nextn layers whose main model the native engine does not run (here: as if it were
    llama.cpp's qwen3next) stops before loading, naming the engine that runs its MTP."""
    index = gguf_loader.read_index(mtp_ggufs["qwen35"])
    index.fields = index.fields | {"general.architecture": "qwen3next"}
    monkeypatch.setattr("specchat.backends.native.gguf_support.read_index", lambda *a, **k: index)
    profile = Profile(name="t", model=str(mtp_ggufs["qwen35"]), dtype="float32", context=64,
                      speculative={"method": "mtp"})
    with pytest.raises(BackendError, match=r"architecture 'qwen3next' is not one the native engine runs .*so it cannot "
                                           "draft from its MTP layers here; run it with backend: llamaserver and "
                                           "method: mtp"):
        load_speculative(profile)


def test_a_files_mtp_layers_on_another_target_belong_to_another_model(mtp_ggufs):
    """`drafter:` a GGUF whose head does not fit the target: qwen35's gated attention on glm4moe."""
    glm = TorchBackend(mtp_ggufs["glm4moe"], threads=2, context=64, precision="float32")
    with pytest.raises(BackendError, match="MTP layer 0 uses gated attention .* belongs to another model"):
        read_gguf_mtp(mtp_ggufs["qwen35"], glm.model.cfg)
