"""A profile's weight memory from the checkpoint's headers, and the refusal before loading when it
exceeds the device's free memory (specchat/weight_memory.py)."""
import pytest
from safetensors import safe_open

from specchat import cli, weight_memory
from specchat.profiles import get_profile
from tests.test_llamacpp import tiny_gguf


@pytest.fixture
def tiny(isolated_dirs):
    folder = isolated_dirs / "user-profiles"
    folder.mkdir(parents=True, exist_ok=True)
    gguf_path = tiny_gguf(folder, "Q4_1")
    for name, text in {"t-f32": "model: ./hf\ndtype: float32", "t-bf16": "model: ./hf\ndtype: bfloat16",
                       "t-q4": "model: ./tiny.gguf", "t-cpp": "backend: llamacpp\nmodel: ./tiny.gguf"}.items():
        (folder / f"{name}.yaml").write_text(text + "\ncontext: 64\nthreads: 2\n")
    return folder, gguf_path


def test_parameters_and_bytes_come_from_the_headers(tiny):
    folder, gguf_path = tiny
    hf = weight_memory.read_checkpoint(folder / "hf", "hf_dir")
    with safe_open(str(folder / "hf" / "model.safetensors"), "pt") as f:
        assert hf.parameters == sum(f.get_tensor(k).numel() for k in f.keys())
    q4 = weight_memory.read_checkpoint(gguf_path, "gguf")
    assert q4.quantized and q4.file_bytes == gguf_path.stat().st_size
    # the KV cache at context 64 (65 positions): 3 layers x keys and values x 2 kv heads x head_dim 16,
    # in the compute dtype; the RoPE tables, cos and sin of head_dim 16, float32
    cache = lambda element: 65 * (3 * 2 * 2 * 16 * element + 2 * 16 * 4)  # noqa: E731
    assert weight_memory.weight_bytes(get_profile("t-f32")) == hf.parameters * 4 + cache(4)
    assert weight_memory.weight_bytes(get_profile("t-bf16")) == hf.parameters * 2 + cache(2)
    estimate, held = weight_memory.weight_bytes(get_profile("t-q4")), held_by_the_engine(gguf_path, 64)  # auto: int4
    assert abs(estimate - held) <= 0.05 * held
    assert weight_memory.weight_bytes(get_profile("t-cpp")) == q4.file_bytes  # llama.cpp maps the file


def held_by_the_engine(path, context: int) -> int:
    """What a loaded model holds: its weights (layers, head, embedding, norms) and its KV cache."""
    from specchat.backends.native.engine import TorchBackend
    from specchat.backends.native.memory_plan import held_bytes

    parts = held_bytes(TorchBackend(path, threads=2, context=context).model)
    return sum(parts.values())


def test_a_kquant_gguf_is_counted_type_by_type_as_the_engine_holds_it(isolated_dirs, kquant_ggufs, monkeypatch):
    """Q4_K_M (Q4_K and Q6_K tiles), Q8_0, F16 (float32 activations and cache): the estimate before loading is what the engine then holds,
    within 5%, with the head on the kernels' tiles as a big vocabulary's is, and without."""
    from specchat.backends.native import memory_plan

    folder = isolated_dirs / "user-profiles"
    folder.mkdir(parents=True, exist_ok=True)
    for limit in (memory_plan.HEAD_FLOAT_MAX_BYTES, 0):
        monkeypatch.setattr(memory_plan, "HEAD_FLOAT_MAX_BYTES", limit)
        for ftype in ("Q4_K_M", "Q8_0", "Q6_K", "F16"):
            (folder / "t-k.yaml").write_text(f"model: {kquant_ggufs[ftype]}\ncontext: 200\nthreads: 2\n")
            estimate, held = weight_memory.weight_bytes(get_profile("t-k")), held_by_the_engine(kquant_ggufs[ftype], 200)
            assert abs(estimate - held) <= 0.05 * held, (ftype, limit, estimate, held)


def test_a_model_not_on_this_machine_has_no_figure(tiny):
    assert weight_memory.weight_bytes(get_profile("qwen3-8b-dflash")) is None  # a hub model, not downloaded


def test_weights_past_the_free_memory_are_refused_before_loading(tiny, monkeypatch, capsys):
    monkeypatch.setattr(weight_memory, "free_bytes", lambda device: 1000)

    def no_load(*a, **k):
        raise AssertionError("loaded although it cannot fit")
    monkeypatch.setattr("specchat.backends.native.engine.TorchBackend.__init__", no_load)
    assert cli.main(["run", "-p", "t-f32", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "MiB for its weights and KV cache and cpu has 0.0 MiB free" in err


@pytest.mark.parametrize("dtype, config", [("float16", {"torch_dtype": "float16"}), ("float32", {})])
def test_a_pytorch_pickle_counts_by_its_size_without_being_unpickled(isolated_dirs, monkeypatch, dtype, config):
    """An EAGLE-3 head ships as pytorch_model.bin: its size over the stored element size (config.json's
    torch_dtype, float32 when it does not say), never 0 and never torch.load."""
    import json

    import torch

    folder = isolated_dirs / "user-profiles"
    head = folder / "head"
    head.mkdir(parents=True)
    (head / "config.json").write_text(json.dumps(config | {"model_type": "llama"}))
    numel = 256 * 512 + 512
    torch.save({"fc.weight": torch.zeros(256, 512, dtype=getattr(torch, dtype)),
                "norm.weight": torch.zeros(512, dtype=getattr(torch, dtype))}, head / "pytorch_model.bin")

    def refuse(*a, **k):
        raise AssertionError("unpickled")
    monkeypatch.setattr(torch, "load", refuse)
    ck = weight_memory.read_checkpoint(head, "hf_dir")
    assert ck.file_bytes == (head / "pytorch_model.bin").stat().st_size
    assert numel <= ck.parameters <= numel * 1.02  # the pickle's own bytes on top of the tensors'
    (folder / "binned.yaml").write_text("model: ./head\ndtype: float32\n")
    assert weight_memory.weight_bytes(get_profile("binned")) == ck.parameters * 4


def test_an_int4_checkpoint_directory_is_counted_as_the_loader_quantizes_it(isolated_dirs, monkeypatch, capsys):
    """dtype: int4 on a safetensors folder: the headers, tensor by tensor (memory_plan.py), not 2.5
    bytes a parameter; refused only when that is more than is free."""
    from tests.native.tiny_moe import make_moe_checkpoint

    folder = isolated_dirs / "user-profiles"
    folder.mkdir(parents=True, exist_ok=True)
    make_moe_checkpoint(folder / "moe", "glm4_moe", seed=3)
    (folder / "t-moe4.yaml").write_text("model: ./moe\ndtype: int4\ncontext: 64\nthreads: 2\n")
    ck = weight_memory.read_checkpoint(folder / "moe", "hf_dir")
    need = weight_memory.weight_bytes(get_profile("t-moe4"))
    cache = 65 * (ck.kv_position_elements * 2 + ck.rope_position_bytes)  # context 64, bfloat16
    assert need == ck.int4_bytes + cache and need != int(ck.parameters * 2.5)

    def no_load(*a, **k):
        raise AssertionError("loaded although it cannot fit")
    monkeypatch.setattr("specchat.backends.native.engine.TorchBackend.__init__", no_load)
    monkeypatch.setattr(weight_memory, "free_bytes", lambda device: need - 1)
    assert cli.main(["run", "-p", "t-moe4", "hi"]) == 2
    assert f"needs {weight_memory.size(need)} for its weights" in capsys.readouterr().err
    monkeypatch.setattr(weight_memory, "free_bytes", lambda device: need)
    weight_memory.check_fits(get_profile("t-moe4"))  # no refusal
