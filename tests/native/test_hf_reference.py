"""The transformers reference row of `specchat bench` streams the same greedy reply as the engine."""
from specchat.backends.base import Request, Sampling, run_to_summary
from specchat.backends.hf_reference import TransformersBackend
from specchat.backends.native.engine import TorchBackend

CHAT = [{"role": "user", "content": "the quick brown fox"}]


def test_transformers_reference_streams_the_engines_greedy_reply(tiny_dirs):
    path = tiny_dirs["llama"]
    ref = TransformersBackend(path, dtype="float32", threads=2, context=256)
    engine = TorchBackend(path, "hf_dir", precision="float32", threads=2, context=256)
    a = run_to_summary(ref.stream(Request(messages=CHAT), Sampling(max_tokens=16)))
    b = run_to_summary(engine.stream(Request(messages=CHAT), Sampling(max_tokens=16)))
    assert a.token_ids == b.token_ids and a.stop_reason == b.stop_reason
    assert a.passes == a.tokens and a.text == engine.detokenize(a.token_ids)
