"""`threads` above the physical cores only makes decoding slower: both CPU engines cap it at the
core count and say so in one line on stderr, once per process."""
from __future__ import annotations

import logging

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
