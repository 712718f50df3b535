"""`threads` above the physical cores only makes decoding slower: both CPU engines cap it at the
core count and say so in one line on stderr, once per process."""
from __future__ import annotations

import logging
import os

import pytest
import torch

from specchat import cli
from specchat.backends import cpu
from specchat.backends.llamacpp import LlamaCppBackend
from specchat.backends.native.engine import TorchBackend
from tests.test_llamacpp import tiny_gguf

NOTE = "threads: 64 requested, this machine has 2 physical cores: using 2"


@pytest.fixture
def two_cores(monkeypatch):
    """A 2-core machine whose process has said nothing yet; torch's thread count restored after."""
    threads = torch.get_num_threads()
    monkeypatch.setattr(cpu, "physical_cores", lambda: 2)
    monkeypatch.setattr(cpu, "_noted", set())
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """(llama-arch GGUF, the Hugging Face directory it was made from)."""
    folder = tmp_path_factory.mktemp("threads")
    return tiny_gguf(folder), folder / "hf"


def notes(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == cpu.__name__]


def test_a_request_above_the_cores_is_capped_and_said_once(two_cores, caplog):
    assert [cpu.thread_count(n) for n in (0, 1, 2)] == [2, 1, 2]
    assert not notes(caplog)
    assert cpu.thread_count(64) == cpu.thread_count(64) == 2
    assert notes(caplog) == [NOTE]
    assert caplog.records[-1].levelno == logging.WARNING


def test_both_engines_run_at_most_one_thread_per_core(two_cores, tiny_models, caplog):
    gguf, hf_dir = tiny_models
    engine = TorchBackend(hf_dir, precision="float32", threads=64, context=64)
    assert torch.get_num_threads() == 2
    engine.close()
    llama = LlamaCppBackend(gguf, context=128, threads=64)
    try:
        assert llama.threads == llama.llm.n_threads == llama.llm.n_threads_batch == 2
    finally:
        llama.close()
    assert notes(caplog) == [NOTE]  # one line for the process, not one per engine


def test_specchat_run_prints_the_note_as_one_bare_line(two_cores, isolated_dirs, capsys):
    folder = isolated_dirs / "user-profiles"
    folder.mkdir(parents=True, exist_ok=True)
    tiny_gguf(folder)
    (folder / "many.yaml").write_text("backend: llamacpp\nmodel: ./tiny.gguf\ncontext: 256\nthreads: 64\n"
                                      "sampling: {max_tokens: 4}\n")
    handlers = logging.root.handlers[:]
    logging.root.handlers.clear()  # as in the `specchat` process, which configures no logging
    try:
        assert cli.main(["run", "-p", "many", "hi"]) == 0
        assert cli.main(["run", "-p", "many", "hi again"]) == 0
    finally:
        logging.root.handlers[:] = handlers
    err = capsys.readouterr().err
    assert err.splitlines().count(NOTE) == 1 and "Traceback" not in err, err


def cgroup_tree(tmp_path, files: dict[str, str], membership: str):
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp_path / "membership").write_text(membership)
    return root, tmp_path / "membership"


@pytest.mark.parametrize("files, membership, limit", [
    ({"cpu.max": "max 100000\n"}, "0::/\n", None),  # v2, unlimited
    ({"cpu.max": "150000 100000\n"}, "0::/\n", 1.5),  # a container seeing its own cgroup as the root
    ({"cpu.max": "max 100000\n", "app/cpu.max": "400000 100000\n", "app/job/cpu.max": "max 100000\n"},
     "0::/app/job\n", 4.0),  # a parent's quota binds its children
    ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, "2:cpuacct:/\n1:cpu:/\n0::/\n", 2.0),
    ({"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, "3:cpu,cpuacct:/\n", None),
    ({"cpu.max": "garbage\n"}, "0::/\n", None),  # unreadable: no limit assumed
])
def test_cgroup_cpu_quota_is_read(tmp_path, files, membership, limit):
    root, member = cgroup_tree(tmp_path, files, membership)
    assert cpu.cgroup_cpu_limit(root, member) == limit


def test_threads_respect_a_cgroup_quota(monkeypatch, caplog):
    """A container granted 1.5 CPUs of a bigger machine runs 2 threads, not one per host core."""
    monkeypatch.setattr(cpu, "_noted", set())
    monkeypatch.setattr(cpu, "cgroup_cpu_limit", lambda: 1.5)
    cores = cpu.physical_cores()
    assert cores == min(2, len(os.sched_getaffinity(0)))
    assert cpu.thread_count(0) == cores and cpu.thread_count(64) == cores
    monkeypatch.setattr(cpu, "cgroup_cpu_limit", lambda: 0.2)
    assert cpu.physical_cores() == 1
