"""`specchat train data` then `specchat train draft` end to end on a tiny target, through the CLI."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from safetensors.torch import load_file

from specchat.backends.base import Request, Sampling, run_to_summary
from specchat.backends.native.engine import TorchBackend
from specchat.backends.speculative.backend import SpeculativeBackend
from specchat.backends.speculative.drafters import DraftModelDrafter, check_same_tokenizer
from specchat.cli import main
from specchat.paths import cache_dir
from tests.native.tiny import CORPUS, make_hf_checkpoint

STEPS = 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target = make_hf_checkpoint(root / "target", "llama", seed=21)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in dict.fromkeys(CORPUS)) +
                       json.dumps({"instruction": "say hello", "instances": [{"input": "to the world"}]}) + "\n")
    return root, target, prompts


@pytest.fixture
def profile(tiny, isolated_dirs):
    root, target, _ = tiny
    d = Path(os.environ["SPECCHAT_PROFILES_DIR"])
    d.mkdir(parents=True, exist_ok=True)
    (d / "tiny.yaml").write_text(f"backend: torch\nmodel: {target}\ndtype: float32\nthreads: 1\ncontext: 256\n")
    return "tiny"


def make_data(tiny, profile, out: Path, limit=None) -> None:
    args = ["train", "data", "--target", profile, "--prompts", str(tiny[2]), "--out", str(out),
            "--max-tokens", "12", "--top-k", "8"]
    assert main(args + (["--limit", str(limit)] if limit else [])) == 0


def train(tiny, profile, data: Path, out: Path, *extra) -> int:
    return main(["train", "draft", "--data", str(data), "--target", profile, "--out", str(out), "--layers", "1",
                 "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--ffn", "64", "--steps", str(STEPS),
                 "--batch-tokens", "64", "--checkpoint-every", "2", "--eval-every", "3", "--seed", "5",
                 "--threads", "1", *extra])


def isolated_tiny_profile(root: Path, target: Path) -> pytest.MonkeyPatch:
    """specchat's directories under `root`, with profile `tiny` on `target`, for module-scoped
    fixtures (the per-test isolation does not reach them); `undo()` the patch when done."""
    mp = pytest.MonkeyPatch()
    for var in ("SPECCHAT_CONFIG_DIR", "SPECCHAT_DATA_DIR", "SPECCHAT_PROFILES_DIR"):
        mp.setenv(var, str(root / var.lower()))
    profiles = root / "specchat_profiles_dir"
    profiles.mkdir()
    (profiles / "tiny.yaml").write_text(f"backend: torch\nmodel: {target}\ndtype: float32\nthreads: 1\ncontext: 256\n")
    return mp


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory):
    """Data and one trained drafter, shared by the tests below (made inside an isolated profile dir)."""
    root = tmp_path_factory.mktemp("trained")
    mp = isolated_tiny_profile(root, tiny[1])
    make_data(tiny, "tiny", root / "data")
    assert train(tiny, "tiny", root / "data", root / "draft") == 0
    mp.undo()
    return root / "data", root / "draft"


def test_data_is_resumable_and_complete(tiny, profile, tmp_path, capsys):
    out = tmp_path / "data"
    make_data(tiny, profile, out, limit=2)
    first = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert len(first) == 2
    make_data(tiny, profile, out)
    manifest = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert manifest[:2] == first and len(manifest) == len({m["id"] for m in manifest}) == 6
    assert "2 already in" in capsys.readouterr().err
    shard = load_file(str(out / manifest[0]["shard"]))
    m = manifest[0]
    reply = shard["tokens"][m["offset"] + m["prompt_len"]:m["offset"] + m["prompt_len"] + m["reply_len"]]
    top = shard["topk_ids"][m["topk_offset"]:m["topk_offset"] + m["reply_len"]]
    assert top.shape[1] == 8
    assert (top[:, 0] == reply).all()  # greedy: the reply token is the target's top-1


def _replies(out: Path) -> dict[str, list[int]]:
    manifest = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    replies = {}
    for m in manifest:
        tokens = load_file(str(out / m["shard"]))["tokens"]
        start = m["offset"] + m["prompt_len"]
        replies[m["id"]] = tokens[start:start + m["reply_len"]].tolist()
    return replies


def test_batched_data_gives_the_same_greedy_replies(tiny, profile, tmp_path):
    """--batch decodes left-padded prompts together with transformers' model of the same weights:
    the same greedy replies as the engine's one-by-one decoding (float32 target) when it runs in
    float32 too; in bfloat16 (the default) every prompt still gets its reply."""
    make_data(tiny, profile, tmp_path / "one")
    args = ["train", "data", "--target", profile, "--prompts", str(tiny[2]), "--out", str(tmp_path / "batched"),
            "--max-tokens", "12", "--top-k", "8", "--batch", "4", "--dtype", "float32"]
    assert main(args) == 0
    one, batched = _replies(tmp_path / "one"), _replies(tmp_path / "batched")
    assert batched == one
    info = json.loads((tmp_path / "batched" / "info.json").read_text())
    assert info["generator"] == "transformers float32, batched"
    assert main(args[:-1] + ["bfloat16"]) == 2  # another precision is another kind of reply: not in one directory
    args_bf16 = args[:-2]
    args_bf16[args_bf16.index("--out") + 1] = str(tmp_path / "bf16")
    assert main(args_bf16) == 0
    assert json.loads((tmp_path / "bf16" / "info.json").read_text())["generator"] == "transformers bfloat16, batched"
    assert _replies(tmp_path / "bf16").keys() == one.keys()
    # resuming with the other generator would mix two kinds of reply in one directory
    args[args.index("--out") + 1] = str(tmp_path / "one")
    assert main(args) == 2


def test_variants_derive_prompts_from_each_task(tmp_path):
    from specchat.train.data import training_prompts

    doc = "The quick brown fox jumps over the lazy dog. " * 3
    f = tmp_path / "tasks.jsonl"
    f.write_text(json.dumps({"id": "t1", "instruction": "Name the animals.", "instances": [{"input": doc, "output": "fox, dog"}]})
                 + "\n" + json.dumps({"id": "t2", "instruction": "Say hi.", "instances": [{"input": "", "output": "hi"}]})
                 + "\n")
    plain = training_prompts([str(f)])
    items = training_prompts([str(f)], variants=True)
    assert [p.id for p in plain] == ["tasks:t1", "tasks:t2"]
    kinds = {p.id for p in items} - {p.id for p in plain}
    assert {"tasks:t1~summary", "tasks:t1~translate", "tasks:t1~document", "tasks:t1~explain",
            "tasks:t2~explain"} <= kinds
    assert not any(k.startswith("tasks:t2~summary") for k in kinds)  # no document long enough
    by_id = {p.id: p.first for p in items}
    assert doc.strip() in by_id["tasks:t1~summary"] and "Name the animals." in by_id["tasks:t1~document"]


def test_data_refuses_spec_bench(profile, tmp_path, capsys):
    bench = tmp_path / "question.jsonl"
    bench.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["hi"]}) + "\n")
    assert main(["train", "data", "--target", profile, "--prompts", str(bench), "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert "evaluation" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_trained_drafter_loads_and_matches_tokenizer(tiny, trained):
    _, draft = trained
    for name in ("config.json", "model.safetensors", "generation_config.json", "README.md", "tokenizer.json",
                 "train-log.jsonl"):
        assert (draft / name).exists(), name
    target, engine = TorchBackend(tiny[1], "hf_dir", threads=1, context=256), TorchBackend(draft, "hf_dir", threads=1,
                                                                                           context=256)
    check_same_tokenizer(target, engine, "trained")
    assert engine.model.cfg.n_layers == 1 and engine.model.cfg.dim == 32
    log = [json.loads(line) for line in (draft / "train-log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, STEPS + 1)) and "eval_agree" in log[-1]
    assert "specchat train draft" in (draft / "README.md").read_text()


def test_speculative_with_trained_drafter_equals_target_only(tiny, trained):
    target = TorchBackend(tiny[1], "hf_dir", precision="float32", threads=1, context=256)
    drafter = DraftModelDrafter(TorchBackend(trained[1], "hf_dir", threads=1, context=256))
    request = Request(messages=[{"role": "user", "content": CORPUS[0]}])
    for sampling in (Sampling(max_tokens=30), Sampling(temperature=0.8, seed=2, max_tokens=30)):
        ref = run_to_summary(target.stream(request, sampling))
        out = run_to_summary(SpeculativeBackend(target, drafter, 3).stream(request, sampling))
        assert out.token_ids == ref.token_ids and out.drafts > 0


def test_training_is_deterministic_and_resumable(tiny, trained, profile, tmp_path, capsys):
    data, reference = trained
    want = load_file(str(reference / "model.safetensors"))
    out = tmp_path / "resumed"
    assert train(tiny, profile, data, out, "--stop-at", "3") == 0
    assert not (out / "model.safetensors").exists()
    assert train(tiny, profile, data, out) == 0
    assert "resuming from step 3" in capsys.readouterr().err
    got = load_file(str(out / "model.safetensors"))
    assert want.keys() == got.keys()
    for k in want:
        assert (want[k] == got[k]).all(), k


def test_missing_data_is_one_line(profile, tmp_path, capsys):
    assert main(["train", "draft", "--data", str(tmp_path / "nothing"), "--target", profile,
                 "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "train data" in err


def test_holdout_keeps_every_variant_of_a_task_on_one_side():
    """A held-out reply must not share its source task with a training one (`--variants` derives
    several prompts from one task), or held-out agreement measures memory, not generalisation."""
    import torch

    from specchat.train.examples import Example, source_task, split

    ids = [f"seed:task_{t}" + (f"~{kind}" if kind else "") for t in range(40) for kind in ("", "summary", "explain")]
    examples = [Example(i, torch.tensor([1, 2, 3]), 1, torch.zeros(2, 1), torch.zeros(2, 1)) for i in ids]
    train, held = split(examples, 0.1, seed=0)
    assert len(train) + len(held) == len(examples) and 12 <= len(held) <= 15
    assert {source_task(e.id) for e in train}.isdisjoint(source_task(e.id) for e in held)
    assert [e.id for e in split(examples, 0.1, seed=0)[1]] == [e.id for e in held]  # deterministic


@pytest.mark.timeout(600)
def test_the_default_model_writes_its_own_training_prompts(default_gguf, tmp_path, capsys):
    out = tmp_path / "self.jsonl"
    args = ["train", "prompts", "--target", "smollm2", "--out", str(out), "--batch", "4", "--max-tokens", "64"]
    assert main(args + ["--count", "2"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2 and len({r["prompt"] for r in records}) == 2
    assert all(len(r["prompt"]) >= 12 and "<|im_" not in r["prompt"] for r in records)
    # the file is a prompt set `train data` reads; a second run only tops it up
    from specchat.train.data import training_prompts

    assert [p.first for p in training_prompts([str(out)])] == [r["prompt"] for r in records]
    assert main(args + ["--count", "3"]) == 0
    again = [json.loads(line) for line in out.read_text().splitlines()]
    assert again[:2] == records and len(again) == 3 and again[2]["attempt"] > records[-1]["attempt"]
    # how it was written is kept beside it, so a drafter's re-train command can write it again
    from specchat.train.self_prompts import remake_command

    assert remake_command(out) == (f"specchat train prompts --target smollm2 --out {out} --count 3 --max-tokens 64 "
                                   "--temperature 1.0 --top-p 0.95 --batch 4 --seed 0 --dtype bfloat16")
    assert remake_command(tmp_path / "other.jsonl") is None


def test_prompt_prefix_ends_where_the_users_text_starts(default_gguf):
    from specchat.backends.native.tokenizer import ChatTokenizer
    from specchat.train.self_prompts import user_turn_prefix

    tok = ChatTokenizer(default_gguf, cache_dir())
    prefix = tok.hf.decode(user_turn_prefix(tok, None))
    assert prefix.endswith("<|im_start|>user\n")
    full = tok.hf.decode(tok.encode_chat([{"role": "user", "content": "Hi there"}]))
    assert full.startswith(prefix + "Hi there")


def test_retrain_command_remakes_every_data_directory(tmp_path):
    from specchat.profiles import load_profiles
    from specchat.train.draft import DraftShape, retrain_command
    from specchat.train.settings import DraftTrainConfig

    profile = load_profiles().get("smollm2")
    a, b = tmp_path / "a", tmp_path / "b"
    for d, info in ((a, {"max_tokens": 256, "top_k": 32, "prompt_files": ["x.jsonl"], "limit": 224}),
                    (b, {"max_tokens": 128, "top_k": 16, "prompt_files": ["x.jsonl", "y.jsonl"], "variants": True,
                         "temperature": 0.7, "seed": 3, "generator": "transformers float32, batched", "batch": 32})):
        d.mkdir()
        (d / "info.json").write_text(json.dumps(info))
    steps = retrain_command(profile, [a, b], tmp_path / "out", DraftShape(), DraftTrainConfig()).split(" && \\\n  ")
    assert steps[0].endswith(f"--out {a} --max-tokens 256 --top-k 32 --limit 224")
    assert "--prompts x.jsonl y.jsonl" in steps[1] and steps[1].endswith(
        f"--out {b} --max-tokens 128 --top-k 16 --temperature 0.7 --seed 3 --variants --batch 32 --dtype float32")
    assert steps[2].startswith(f"specchat train draft --data {a} {b} ")
    # prompts the target wrote itself (`train prompts` keeps its settings beside them) are written first
    own = tmp_path / "own.jsonl"
    own.write_text('{"id": "self-0-0", "prompt": "Tell me about tides.", "attempt": 0}\n')
    (tmp_path / "own.info.json").write_text(json.dumps({"target": "smollm2", "count": 1, "max_tokens": 64,
                                                        "temperature": 1.0, "top_p": 0.95, "batch": 48, "seed": 0,
                                                        "dtype": "bfloat16"}))
    info = json.loads((a / "info.json").read_text()) | {"prompt_files": [str(own)]}
    (a / "info.json").write_text(json.dumps(info))
    steps = retrain_command(profile, [a], tmp_path / "out", DraftShape(), DraftTrainConfig()).split(" && \\\n  ")
    assert steps[0] == (f"specchat train prompts --target smollm2 --out {own} --count 1 --max-tokens 64 "
                        "--temperature 1.0 --top-p 0.95 --batch 48 --seed 0 --dtype bfloat16")
    assert steps[1].startswith(f"specchat train data --target smollm2 --prompts {own} --out {a} ")


def test_the_corpus_keeps_replies_compactly_and_gives_them_back(tiny, trained, profile, tmp_path):
    """Packed: uint16 ids and a manifest, nothing else; appending is idempotent; unpacked: the same
    samples, with the target's top-k recomputed (greedy replies: each reply token is its top 1)."""
    import numpy as np

    from specchat.train.examples import load_examples

    data, _ = trained
    corpus = tmp_path / "corpus"
    assert main(["train", "corpus", "--data", str(data), "--out", str(corpus)]) == 0
    assert sorted(p.name for p in corpus.iterdir()) == ["info.json", "manifest.jsonl", "tokens.npz"]
    with np.load(corpus / "tokens.npz") as z:
        assert z["tokens"].dtype == np.uint16
    size = (corpus / "manifest.jsonl").read_text()
    assert main(["train", "corpus", "--data", str(data), "--out", str(corpus)]) == 0
    assert (corpus / "manifest.jsonl").read_text() == size  # nothing twice
    out = tmp_path / "unpacked"
    assert main(["train", "unpack", "--target", profile, "--corpus", str(corpus), "--out", str(out),
                 "--top-k", "8"]) == 0
    want, got = load_examples([data]), load_examples([out])
    assert [e.id for e in want] == [e.id for e in got]
    for a, b in zip(want, got):
        assert a.tokens.tolist() == b.tokens.tolist() and a.prompt_len == b.prompt_len
        replies = a.tokens[a.prompt_len:]
        assert (b.topk_ids[:, 0] == replies).float().mean() > 0.9  # teacher-forced prefill vs decoding
    # a drafter trained on it says how to make the data again: unpack, not regenerate
    from specchat.profiles import load_profiles
    from specchat.train.card import data_commands

    commands = data_commands(load_profiles().profiles.get(profile), [data, out])
    assert commands[0].startswith("specchat train data ")
    assert commands[1] == f"specchat train unpack --target {profile} --corpus {corpus} --out {out} --top-k 8"
