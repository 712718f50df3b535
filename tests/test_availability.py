"""Where each profile runs (here, after a download, on a GPU, on a server) and why not, and the
grouped `specchat profiles` listing. The model cache and the Hugging Face cache are empty folders of
each test's own, so the answers never depend on this machine's downloads; nothing leaves loopback."""
from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from rich.cells import cell_len

from specchat import availability, cli, paths
from specchat.availability import GROUPS, classify
from specchat.models import cached_path
from specchat.profiles import load_profiles

LOCAL_SMOLLM2 = ["smollm2", "smollm2-dflash", "smollm2-draft", "smollm2-fast", "smollm2-llamacpp", "smollm2-mtp",
                 "smollm2-mtp-lookup", "smollm2-ngram"]


@pytest.fixture
def machine(isolated_dirs, monkeypatch):
    """A CPU-only machine with empty caches; returns the user profile folder."""
    import huggingface_hub.constants

    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(isolated_dirs / "cache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(isolated_dirs / "hf"))
    monkeypatch.setattr(availability, "cuda_devices", lambda: 0)
    folder = isolated_dirs / "user-profiles"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def tiny_gguf(path):
    """A small GGUF whose header and tensor index read (its weights are only looked at, never loaded)."""
    import gguf
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("w", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_profile(folder, name, port, model="tiny", extra=""):
    (folder / f"{name}.yaml").write_text(
        f"backend: openai\nmodel: {model}\nserver:\n  base_url: http://127.0.0.1:{port}/v1\n{extra}")


@pytest.fixture
def models_server():
    """A loopback server that answers GET /v1/models, serving the model `tiny`."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"object": "list", "data": [{"id": "tiny", "object": "model"}]}).encode()
            self.send_response(200 if self.path == "/v1/models" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def by_name(found):
    return {a.name: a for a in found}


def test_shipped_profiles_on_a_cpu_machine_without_downloads(machine):
    found = classify(load_profiles(), probe_servers=False)
    got = by_name(found)
    for name in LOCAL_SMOLLM2:
        assert got[name].group == "download", (name, got[name])
        assert "specchat pull smollm2-135m-instruct" in got[name].reason and got[name].choosable
    for name in ("mimo-7b-mtp", "qwen3-8b-dflash"):
        assert got[name].group == "gpu" and "no CUDA GPU" in got[name].reason and not got[name].choosable
    assert "Qwen/Qwen3-8B and z-lab/Qwen3-8B-DFlash-b16 from the Hugging Face hub" in got["qwen3-8b-dflash"].reason
    remote = [n for n, p in load_profiles().profiles.items() if p.remote]
    assert len(remote) >= 10 and all(got[n].group == "needs-server" for n in remote)
    # listed group by group in GROUPS' order, by name within a group
    order = list(GROUPS)
    keys = [(order.index(a.group), a.name) for a in found]
    assert keys == sorted(keys)


def test_the_default_model_in_the_cache_runs_here(machine):
    tiny_gguf(cached_path("smollm2-135m-instruct"))  # only looked at, never loaded
    got = by_name(classify(load_profiles(), probe_servers=False))
    assert all(got[n].group == "here" and got[n].reason == "" for n in LOCAL_SMOLLM2)
    assert [a.group for a in classify(load_profiles(), probe_servers=False)][0] == "here"


def test_a_hub_model_needs_a_download_until_it_is_in_the_hub_cache(machine, isolated_dirs):
    (machine / "hubby.yaml").write_text("model: someone/tiny-model\n")
    got = by_name(classify(load_profiles(), probe_servers=False))["hubby"]
    assert got.group == "download" and "someone/tiny-model from the Hugging Face hub" in got.reason
    repo = isolated_dirs / "hf" / "models--someone--tiny-model"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for f in ("config.json", "model.safetensors"):
        (snapshot / f).write_text("{}")
    assert by_name(classify(load_profiles(), probe_servers=False))["hubby"].group == "here"


def test_a_gpu_profile_needs_a_gpu_on_a_cpu_only_machine(machine, monkeypatch):
    tiny_gguf(cached_path("smollm2-135m-instruct"))
    (machine / "on-gpu.yaml").write_text("model: smollm2-135m-instruct\ndevice: cuda\ndtype: bfloat16\n")
    (machine / "second-gpu.yaml").write_text("model: smollm2-135m-instruct\ndevice: cuda:1\n")
    got = by_name(classify(load_profiles(), probe_servers=False))
    assert got["on-gpu"].group == "gpu" and got["on-gpu"].reason == "device cuda: this machine has no CUDA GPU"
    monkeypatch.setattr(availability, "cuda_devices", lambda: 1)
    got = by_name(classify(load_profiles(), probe_servers=False))
    assert got["on-gpu"].group == "here"
    assert got["second-gpu"].group == "gpu" and "has 1 CUDA GPU" in got["second-gpu"].reason


def test_a_server_that_is_down_is_not_answering_and_listing_stays_fast(machine):
    import httpx  # noqa: F401  (imported once per process: not what is timed here)

    server_profile(machine, "down", free_port())
    ps = load_profiles()
    start = time.perf_counter()
    found = classify(ps)  # every shipped server too: all on loopback ports with nothing listening
    assert time.perf_counter() - start < 1.0
    down = by_name(found)["down"]
    assert down.group == "needs-server" and not down.choosable
    assert down.reason.startswith("not answering at 127.0.0.1:") and "connection refused" in down.reason


def test_a_server_that_never_replies_is_given_up_on_after_the_timeout(machine):
    with socket.socket() as silent:  # accepts connections (the kernel does), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        server_profile(machine, "stuck", silent.getsockname()[1])
        start = time.perf_counter()
        stuck = by_name(classify(load_profiles(), timeout_s=0.3))["stuck"]
        assert time.perf_counter() - start < 1.0
    assert stuck.group == "needs-server" and "no answer within 0.3s" in stuck.reason


def test_a_server_that_is_up_answers(machine, models_server):
    server_profile(machine, "up", models_server)
    server_profile(machine, "wrong-model", models_server, model="other")
    got = by_name(classify(load_profiles()))
    assert got["up"].group == "server" and got["up"].reason == f"answers at 127.0.0.1:{models_server}"
    assert got["up"].choosable
    assert got["wrong-model"].group == "needs-server" and "serves 'tiny', not 'other'" in got["wrong-model"].reason


def test_an_unset_api_key_and_a_broken_file_say_why(machine, monkeypatch):
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    server_profile(machine, "keyed", free_port(), extra="  api_key_env: NO_SUCH_KEY_VAR\n")
    (machine / "bad.yaml").write_text("model: m\nbogus: 1\n")
    found = classify(load_profiles(), probe_servers=False)
    got = by_name(found)
    assert got["keyed"].group == "needs-server" and "$NO_SUCH_KEY_VAR, which is not set" in got["keyed"].reason
    assert got["bad"].group == "broken" and "bogus" in got["bad"].reason and got["bad"].profile is None
    assert found[-1].group == "broken"


# ------------------------------------------------------------------------ the CLI listing

def listing(capsys, *flags):
    assert cli.main(["profiles", *flags]) == 0
    return capsys.readouterr().out


def test_profiles_at_80_columns_grouped_with_reasons(machine, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    server_profile(machine, "down", free_port())
    (machine / "bad.yaml").write_text("model: m\nbogus: 1\n")
    out = listing(capsys)
    lines = out.splitlines()
    assert max(cell_len(line) for line in lines) <= 80
    headings = [line for line in lines if line in GROUPS.values()]
    assert headings == ["needs a download", "needs a GPU", "needs a server", "broken"]
    assert any(line.startswith("  smollm2-fast *") for line in lines)  # the default, marked
    row = lines.index(next(line for line in lines if line.startswith("  down ")))
    assert lines[row + 1].strip().startswith("not answering at 127.0.0.1:")
    assert "specchat pull smollm2-135m-instruct" in out
    assert "bad.yaml: bogus: unknown key" in out
    assert "on the native torch engine" not in out  # descriptions only with --wide


def test_profiles_wide_prints_everything(machine, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    (machine / "beta.yaml").write_text("extends: smollm2\ndescription: '[beta] [bold]my[/bold] test'\n")
    out = listing(capsys, "--wide")
    assert "[beta] [bold]my[/bold] test" in out  # brackets are text, not markup
    assert "server: eagle3, 3 steps (jamesliu1/sglang-EAGLE3-Llama-3.1-Instruct-8B)" in out  # never cut
    assert "…" not in out
    assert "--speculative-num-draft-tokens" in out  # the descriptions, with how to start each server


def test_profiles_json_has_each_group_and_reason(machine, models_server, capsys):
    server_profile(machine, "up", models_server)
    (machine / "bad.yaml").write_text("model: m\nbogus: 1\n")
    listed = json.loads(listing(capsys, "--json"))
    assert listed["profiles"]["up"]["group"] == "server" and "answers at" in listed["profiles"]["up"]["reason"]
    assert listed["profiles"]["smollm2"]["group"] == "download" and listed["profiles"]["smollm2"]["model"]
    assert listed["profiles"]["mimo-7b-mtp"]["group"] == "gpu"
    assert "bogus" in listed["errors"]["bad"] and list(listed["groups"]) == list(GROUPS)
    unprobed = json.loads(listing(capsys, "--json", "--no-probe"))["profiles"]["up"]
    assert unprobed["group"] == "needs-server" and unprobed["reason"] == "server not asked (--no-probe)"


def test_a_llama_server_profile_says_it_builds_the_server_first(machine, monkeypatch):
    from specchat.backends.llamaserver import build

    tiny_gguf(cached_path("smollm2-135m-instruct"))
    got = by_name(classify(load_profiles(), probe_servers=False))["smollm2-llamaserver-ngram"]
    assert got.group == "download" and got.choosable and "builds llama-server" in got.reason
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    got = by_name(classify(load_profiles(), probe_servers=False))["smollm2-llamaserver"]
    assert got.group == "broken" and "needs CMake and a C++ compiler" in got.reason
    root = build.build_dir(paths.cache_dir())
    root.mkdir(parents=True)
    (root / build.BINARY).write_text("")
    (root / build.BINARY).chmod(0o755)
    (root / "build.json").write_text("{}")
    assert by_name(classify(load_profiles(), probe_servers=False))["smollm2-llamaserver"].group == "here"


def test_broken_weights_are_listed_broken_by_both_listings(machine, capsys, monkeypatch):
    """A checkpoint whose weights cannot be read (an empty or garbage safetensors file) is `broken`
    with the file's one line, in the plain listing and in --json alike; a sound one beside it runs."""
    import numpy as np
    from safetensors.numpy import save_file

    monkeypatch.setenv("COLUMNS", "200")
    for name in ("empty", "garbage", "sound"):
        d = machine.parent / "models" / name
        d.mkdir(parents=True)
        (d / "config.json").write_text('{"model_type": "llama"}')
        (machine / f"{name}.yaml").write_text(f"backend: torch\nmodel: {d}\n")
    save_file({"w": np.zeros((4, 4), dtype=np.float32)}, str(machine.parent / "models/sound/model.safetensors"))
    (machine.parent / "models/empty/model.safetensors").write_bytes(b"")
    garbage = (2**40).to_bytes(8, "little") + b"{not json" * 10
    (machine.parent / "models/garbage/model.safetensors").write_bytes(garbage)

    got = by_name(classify(load_profiles(), probe_servers=False))
    for name in ("empty", "garbage"):
        assert got[name].group == "broken" and not got[name].choosable
        assert "model.safetensors: broken weight file" in got[name].reason and "\n" not in got[name].reason
    assert got["sound"].group == "here"

    listed = json.loads(listing(capsys, "--json", "--no-probe"))["profiles"]
    assert listed["empty"]["group"] == "broken" and "broken weight file" in listed["empty"]["reason"]
    assert listed["empty"]["weights_bytes"] is None and listed["garbage"]["group"] == "broken"
    assert listed["sound"]["group"] == "here" and listed["sound"]["weights_bytes"] == 16 * 4
    lines = listing(capsys, "--no-probe").splitlines()
    row = lines.index(next(line for line in lines if line.startswith("  empty ")))
    assert lines.index("broken") < row and "broken weight file (0 bytes" in lines[row + 1]
    assert (machine.parent / "models/garbage/model.safetensors").read_bytes() == garbage  # only looked at
