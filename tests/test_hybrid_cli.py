"""A hybrid checkpoint as a user runs it: `specchat run --set model=DIR` streams transformers'
tokens, `specchat verify` with its built-in MTP head finds no mismatch in either rollback mode."""
import json

import pytest
import torch

from specchat import cli
from tests.native.tiny import add_mtp_head, make_hybrid_checkpoint


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    path = make_hybrid_checkpoint(tmp_path_factory.mktemp("hybrid-cli") / "m", "qwen3_5", seed=3)
    add_mtp_head(path, "qwen3_next", seed=4)
    return path


def test_run_streams_what_transformers_generates(hybrid_dir, isolated_dirs, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert cli.main(["run", "-p", "smollm2", "--set", f"model={hybrid_dir}", "--set", "dtype=float32", "--json",
                     "--max-tokens", "24", "the quick brown fox"]) == 0
    out = json.loads(capsys.readouterr().out)
    tok = AutoTokenizer.from_pretrained(str(hybrid_dir))
    prompt = tok.apply_chat_template([{"role": "user", "content": "the quick brown fox"}], add_generation_prompt=True,
                                     return_dict=True)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(str(hybrid_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=[2, 0],
                              pad_token_id=0)[0, len(prompt):].tolist()
    assert out["token_ids"] == want[:len(out["token_ids"])] and out["tokens"] >= 5
    # the default profile compiles; a hybrid's graphs are bfloat16 or int4, so in float32 the reply runs on
    # eager passes and says why
    assert cli.main(["run", "--set", f"model={hybrid_dir}", "--set", "dtype=float32", "--json",
                     "--max-tokens", "24", "the quick brown fox"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["token_ids"] == out["token_ids"]
    said = " ".join(captured.err.split())  # as one line, however the terminal wraps it
    assert "hybrid (linear-attention) model" in said and "set dtype: bfloat16" in said and "compile: false" in said


@pytest.mark.parametrize("rollback", ["snapshot", "replay"])
def test_verify_with_the_builtin_mtp_head_finds_no_mismatch(hybrid_dir, isolated_dirs, tmp_path, capsys, rollback):
    profile = tmp_path / "hybrid-mtp.yaml"
    profile.write_text(f"model: {hybrid_dir}\ndtype: float32\ncontext: 256\n"
                       f"speculative: {{method: mtp, depth: 3, rollback: {rollback}}}\n")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "turns": [t]}) + "\n" for i, t in
                               enumerate(["the quick brown fox", "hello world, how are you today?",
                                          "Paris is the capital of France."])))
    for extra in ([], ["--temperature", "0.7"]):
        code = cli.main(["verify", "-p", str(profile), "--prompts", str(prompts), "--max-tokens", "40", "--json", *extra])
        out = json.loads(capsys.readouterr().out)
        assert code == 0 and out["mismatches"] == 0 and len(out["prompts_checked"]) == 3


def test_the_shipped_recurrent_drafter_fits_its_profile():
    """profiles/drafters/smollm2-replayssm: at most 30 MB, every layer Gated DeltaNet, a card that
    says how to make it again, and the profile that drafts with it."""
    from specchat.backends.native.engine import TorchBackend
    from specchat.profiles import load_profiles

    profile = load_profiles().profiles["smollm2-replayssm"]
    assert profile.speculative.method == "replayssm"
    path = profile.resolve_path(profile.speculative.drafter)
    assert (path / "model.safetensors").stat().st_size <= 30e6
    cfg = TorchBackend(path, "hf_dir", threads=1, context=64).model.cfg
    assert cfg.n_layers >= 1 and all(cfg.is_linear(i) for i in range(cfg.n_layers))
    card = (path / "README.md").read_text()
    assert "specchat train replayssm" in card and "specchat train unpack" in card
