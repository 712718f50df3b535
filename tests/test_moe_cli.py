"""Mixture-of-experts checkpoints as a user runs them: `specchat run --set model=DIR` streams
transformers' tokens (Qwen3-MoE, GLM-4.5, Qwen3.5-MoE), and `specchat verify` with a GLM-4.5-style
built-in MTP head (routed experts in its layer) finds no mismatch."""
import json

import pytest
import torch

from specchat import cli
from tests.native.tiny_moe import add_moe_mtp_head, make_moe_checkpoint

SEEDS = {"qwen3_moe": 51, "glm4_moe": 32, "qwen3_5_moe": 33}


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-cli")
    return {family: make_moe_checkpoint(root / family, family, seed=seed) for family, seed in SEEDS.items()}


@pytest.mark.parametrize("family", sorted(SEEDS))
def test_run_streams_what_transformers_generates(moe_dirs, family, isolated_dirs, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = moe_dirs[family]
    assert cli.main(["run", "-p", "smollm2", "--set", f"model={path}", "--set", "dtype=float32", "--json",
                     "--max-tokens", "20", "the quick brown fox"]) == 0
    out = json.loads(capsys.readouterr().out)
    tok = AutoTokenizer.from_pretrained(str(path))
    prompt = tok.apply_chat_template([{"role": "user", "content": "the quick brown fox"}], add_generation_prompt=True,
                                     return_dict=True)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=[2, 0],
                              pad_token_id=0)[0, len(prompt):].tolist()
    assert out["token_ids"] == want[:len(out["token_ids"])] and out["tokens"] >= 5
    if family == "qwen3_moe":  # the default profile compiles; on a MoE target it answers on eager passes, saying why
        assert cli.main(["run", "--set", f"model={path}", "--set", "dtype=float32", "--json", "--max-tokens", "20",
                         "the quick brown fox"]) == 0
        captured = capsys.readouterr()
        assert json.loads(captured.out)["token_ids"] == out["token_ids"]
        assert "mixture-of-experts model" in captured.err and "set compile: false" in captured.err


def test_verify_with_a_glm_style_moe_mtp_head_finds_no_mismatch(moe_dirs, isolated_dirs, tmp_path, capsys):
    import shutil

    path = shutil.copytree(moe_dirs["glm4_moe"], tmp_path / "glm-mtp")
    add_moe_mtp_head(path, "deepseek", seed=52)
    profile = tmp_path / "glm-mtp.yaml"
    profile.write_text(f"model: {path}\ndtype: float32\ncontext: 256\nspeculative: {{method: mtp, depth: 3}}\n")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "turns": [t]}) + "\n" for i, t in
                               enumerate(["the quick brown fox", "Paris is the capital of France."])))
    for extra in ([], ["--temperature", "0.7"]):
        code = cli.main(["verify", "-p", str(profile), "--prompts", str(prompts), "--max-tokens", "24", "--json", *extra])
        out = json.loads(capsys.readouterr().out)
        assert code == 0 and out["mismatches"] == 0 and len(out["prompts_checked"]) == 2
