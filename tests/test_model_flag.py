"""`-m FILE` / `--model FILE`: a GGUF file or checkpoint directory on every command without a
profile written; which engine runs it and why; bad files as one line and exit 2."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import gguf
import numpy as np
import pytest

from specchat import cli, paths
from specchat.backends.base import BackendError
from specchat.backends.native.gguf_support import NATIVE_MATRIX_TYPES, native_refusal
from specchat.model_flag import SUFFIX, flagged_engine_line, forget, profile_for_model
from specchat.profiles import DEFAULT_PROFILE, get_profile, load_profiles
from tests.native.tiny import add_mtp_head, make_gguf, make_hf_checkpoint


@pytest.fixture(autouse=True)
def no_session_profiles():
    """-m's profiles live for the process: none leaks from one test into the next."""
    forget()
    yield
    forget()


def header_only_gguf(path, arch: str, ffn_down=gguf.GGMLQuantizationType.F32):
    """A GGUF of `arch` with an embedding and one layer matrix, the matrix stored as `ffn_down`
    (raw bytes of the right size for a quantized type): enough for the tensor index, no model."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 256), np.float32))
    if ffn_down == gguf.GGMLQuantizationType.F32:
        w.add_tensor("blk.0.ffn_down.weight", np.zeros((4, 256), np.float32))
    else:
        block, block_bytes = gguf.GGML_QUANT_SIZES[ffn_down]
        w.add_tensor("blk.0.ffn_down.weight", np.zeros((4, 256 // block * block_bytes), np.uint8), raw_dtype=ffn_down)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("model-flag") / "tiny-llama", "llama", seed=11)


@pytest.fixture(scope="module")
def q3_gguf(tmp_path_factory):
    """A complete small llama GGUF whose matrices llama.cpp's quantizer made Q3_K (Q3_K_M): llama.cpp
    runs it, the native engine does not (no 3-bit kernel)."""
    from tests.native.tiny import quantize_with_llamacpp

    root = tmp_path_factory.mktemp("q3")
    source = make_gguf(root / "tiny-f32.gguf", make_hf_checkpoint(root / "hf", "llama", seed=11, hidden=256, ffn=512))
    return quantize_with_llamacpp(source, root / "tiny-q3.gguf", "Q3_K_M")


# ---------------------------------------------------------------- native_refusal
def test_native_refusal_names_an_architecture_the_engine_does_not_run(tmp_path):
    for arch in ("phi3", "foo"):
        why = native_refusal(header_only_gguf(tmp_path / f"{arch}.gguf", arch))
        assert why == (f"architecture '{arch}' is not one the native engine runs (llama, qwen2, qwen3, qwen3moe, gemma3, "
                       "qwen35, qwen35moe, glm4moe)")
    assert native_refusal(header_only_gguf(tmp_path / "llama.gguf", "llama")) is None
    assert native_refusal(tmp_path) is None  # a checkpoint directory: its loader checks it


def test_native_refusal_names_the_tensor_of_a_type_it_does_not_run(tmp_path):
    why = native_refusal(header_only_gguf(tmp_path / "iq2.gguf", "llama", gguf.GGMLQuantizationType.IQ2_XXS))
    assert why == "blk.0.ffn_down.weight is IQ2_XXS, a weight type the native engine does not run"
    # the types in NATIVE_MATRIX_TYPES pass (Q6_K: one the kernels being added run)
    assert "Q6_K" in NATIVE_MATRIX_TYPES
    assert native_refusal(header_only_gguf(tmp_path / "q6k.gguf", "llama", gguf.GGMLQuantizationType.Q6_K)) is None


# ---------------------------------------------------------------- the profile -m builds
def test_m_alone_builds_the_default_profile_with_suffix_decoding_in_memory(tmp_path):
    path = header_only_gguf(tmp_path / "my-model.gguf", "llama")
    profile = profile_for_model(str(path))
    default = get_profile(DEFAULT_PROFILE)
    assert profile.name == "my-model" and profile.model == str(path) and profile.backend == "torch"
    assert profile.method == "suffix" and profile.speculative.depth == SUFFIX["depth"]
    assert (profile.compile, profile.context, profile.sampling) == (default.compile, default.context, default.sampling)
    assert load_profiles().get("my-model") == profile  # the chat and the REPL find it by name
    assert not list(paths.user_profiles_dir().glob("*")) and not list(tmp_path.glob("*.y*ml"))  # no file written
    assert flagged_engine_line(profile) == ("engine: specchat (native) · suffix decoding: lookup in the conversation "
                                            "and earlier replies, up to 7 a pass")
    assert flagged_engine_line(get_profile("smollm2")) is None  # a profile file's status bar stays as it was


def test_m_with_p_replaces_the_profiles_model(tmp_path):
    path = header_only_gguf(tmp_path / "other.gguf", "qwen3")
    profile = profile_for_model(str(path), "smollm2-ngram")
    shipped = get_profile("smollm2-ngram")
    assert profile.model == str(path) != shipped.model  # -m wins over the profile's own model
    assert profile.speculative == shipped.speculative and profile.name == "smollm2-ngram@other"
    # a file the native engine cannot run, under a profile that runs the native engine: one line naming both
    refused = header_only_gguf(tmp_path / "phi.gguf", "phi3")
    with pytest.raises(BackendError, match=r"architecture 'phi3' is not one .* leave out -p"):
        profile_for_model(str(refused), "smollm2-ngram")


def test_a_checkpoint_directory_with_mtp_layers_drafts_with_them(tiny_dir, tmp_path, capsys):
    import shutil

    with_mtp = shutil.copytree(tiny_dir, tmp_path / "with-mtp")
    add_mtp_head(with_mtp, "deepseek", seed=13)
    prompt = ["the quick brown fox the quick brown fox", "--json", "--max-tokens", "12", "--set", "dtype=bfloat16"]
    replies = {}
    for label, argv in (("mtp", ["-m", str(with_mtp)]), ("plain", ["-m", str(tiny_dir)]),
                        ("target-only", ["-p", "smollm2", "--set", f"model={tiny_dir}"])):
        assert cli.main(["run", *argv, *prompt]) == 0
        captured = capsys.readouterr()
        replies[label] = json.loads(captured.out)
    assert replies["mtp"]["method"] == "mtp" and "the checkpoint's own MTP layers" in replies["mtp"]["engine_reason"]
    assert replies["plain"]["method"] == "suffix"  # no MTP layers: suffix decoding
    assert replies["mtp"]["engine"] == replies["plain"]["engine"] == "specchat (native)"
    # lossless: both drafters give the target-only reply (bfloat16: strict verification)
    assert replies["mtp"]["token_ids"] == replies["plain"]["token_ids"] == replies["target-only"]["token_ids"]
    assert len(replies["mtp"]["token_ids"]) >= 5


@pytest.mark.parametrize("arch", ["qwen3moe", "gemma3"])
def test_a_qwen3moe_or_gemma3_gguf_runs_on_the_native_engine(arch_ggufs, arch, capsys):
    """llama.cpp-converted files of these archs chat on the native engine with suffix decoding, eagerly
    (no compiled graphs for routed experts or sliding windows yet, where the default profile has them),
    and the reply is target-only's."""
    path = arch_ggufs[arch, "Q4_K_M"]
    prompt = ["the quick brown fox the quick brown fox", "--json", "--max-tokens", "12", "--set", "threads=2"]
    assert cli.main(["run", "-m", str(path), *prompt]) == 0
    flagged = json.loads(capsys.readouterr().out)
    assert profile_for_model(str(path)).compile is False and get_profile(DEFAULT_PROFILE).compile
    assert cli.main(["run", "-p", "smollm2", "--set", f"model={path}", *prompt]) == 0
    reference = json.loads(capsys.readouterr().out)
    assert flagged["engine"] == "specchat (native)" and flagged["method"] == "suffix"
    assert flagged["token_ids"] == reference["token_ids"] and len(flagged["token_ids"]) >= 5


@pytest.mark.parametrize("arch, name", [("qwen3moe", "blk.1.ffn_up_exps.weight"),
                                        ("gemma3", "blk.1.post_ffw_norm.weight")])
def test_a_tensor_missing_from_such_a_file_is_one_line_and_exit_2(arch_ggufs, monkeypatch, capsys, arch, name):
    from specchat.backends.native import gguf_loader

    path = arch_ggufs[arch, "Q8_0"]
    index = gguf_loader.read_index(path)
    del index.tensors[name]
    monkeypatch.setattr(gguf_loader, "read_index", lambda *a, **k: index)  # what loading reads of the file
    assert cli.main(["run", "-m", str(path), "hi", "--set", "threads=2"]) == 2
    err = capsys.readouterr().err.splitlines()  # the engine line -m always writes, then the error
    errors = [line for line in err if not line.startswith("engine:")]
    assert len(errors) == 1 and errors[0].endswith(f"{path}: tensor {name} missing; the file may be truncated"), err


def test_a_file_the_native_engine_cannot_run_goes_to_llamacpp_and_says_why(q3_gguf, capsys):
    assert cli.main(["run", "-m", str(q3_gguf), "hello", "--json", "--max-tokens", "6", "--set", "threads=2"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["backend"] == "llamacpp" and out["method"] == "none" and out["tokens"] > 0
    assert out["engine"] == "llama.cpp target-only"
    assert re.fullmatch(r"blk\.0\.\w+\.weight is Q3_K, a weight type the native engine does not run .*",
                        out["engine_reason"]), out["engine_reason"]
    said = [line for line in captured.err.splitlines() if line.startswith("engine:")]
    assert said == [f"engine: llama.cpp target-only · {out['engine_reason']}"]  # once


@pytest.mark.asyncio
async def test_the_chat_status_bar_names_the_engine_and_why(q3_gguf, isolated_dirs):
    from specchat.tui.app import SpecChatApp
    from tests.scripted import ScriptedBackend
    from tests.tui.conftest import Loader, wait_until

    profile = profile_for_model(str(q3_gguf))
    app = SpecChatApp(profile.name, loader=Loader({profile.name: ScriptedBackend(["hi"])}))
    async with app.run_test(size=(200, 30)) as pilot:
        await wait_until(pilot, lambda: app.backend is not None and app.loading is None, what="backend loaded")
        status = " ".join(str(app.chat.query_one("#status-text").render()).split())
        assert re.search(r"tiny-q3 · engine: llama\.cpp target-only · blk\.0\.\w+\.weight is Q3_K", status), status


# ---------------------------------------------------------------- one line, exit 2
@pytest.mark.parametrize("argv", [["run", "hi"], ["chat"], [], ["ab"], ["repl"], ["bench"], ["ladder"], ["verify"]],
                         ids=lambda a: " ".join(a) or "specchat")
def test_an_architecture_neither_engine_knows_is_one_line_and_exit_2(argv, tmp_path, capsys):
    foo = header_only_gguf(tmp_path / "foo.gguf", "foo")
    command, rest = (argv[:1], argv[1:])
    assert cli.main([*command, "-m", str(foo), *rest]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "architecture 'foo' is not one the native engine runs" in err and "llama.cpp does not load it" in err


def test_bad_files_are_one_line_and_exit_2(tmp_path, q3_gguf):
    text = tmp_path / "notes.gguf"
    text.write_text("these are notes, not weights\n" * 4)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(q3_gguf.read_bytes()[: q3_gguf.stat().st_size // 2])
    empty_dir = tmp_path / "checkpoint"
    empty_dir.mkdir()
    cases = {str(tmp_path / "missing.gguf"): "no such file or directory",
             str(empty_dir): "no config.json, so not a checkpoint directory",
             str(text): "not a GGUF file (it starts with b'thes'",
             str(truncated): "truncated"}
    for path, says in cases.items():
        done = subprocess.run([sys.executable, "-m", "specchat.cli", "run", "-m", path, "hi"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
        assert says in done.stderr and path in done.stderr, done.stderr


def test_m_and_set_model_together_is_a_usage_error(tmp_path, capsys):
    path = header_only_gguf(tmp_path / "m.gguf", "llama")
    assert cli.main(["run", "-m", str(path), "--set", "model=smollm2-135m-instruct", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "give it once" in err


# ---------------------------------------------------------------- the real default model
@pytest.mark.slow
def test_m_on_the_real_default_gguf_replies_as_the_target_only_profile(default_gguf, capsys):
    prompt = ["What is the capital of France?", "--json", "--max-tokens", "8"]
    # compile off for this one-shot run: with the default's compile: true its reply runs on the same eager
    # passes, then starts a background process compiling graphs for minutes (beside the rest of the suite)
    assert cli.main(["run", "-m", str(default_gguf), "--set", "compile=false", *prompt]) == 0
    captured = capsys.readouterr()
    flagged = json.loads(captured.out)
    assert cli.main(["run", "-p", "smollm2", *prompt]) == 0
    reference = json.loads(capsys.readouterr().out)
    assert flagged["engine"] == "specchat (native)" and flagged["method"] == "suffix"
    assert flagged["engine_reason"].startswith("suffix decoding")
    assert [line for line in captured.err.splitlines() if line.startswith("engine:")] == [
        f"engine: specchat (native) · {flagged['engine_reason']}"]
    assert flagged["token_ids"] == reference["token_ids"] and flagged["text"] == reference["text"]
    assert flagged["tokens"] == 8 or flagged["stop_reason"] == "eos"
