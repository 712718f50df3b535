"""Part 1: the engine's logits against transformers' own forward pass, every architecture, each
precision, on the device.

The reference is transformers' model in float64. In each precision the engine's largest logit
error against it must stay within ERROR_RATIO times transformers' own error in that precision
(plus a floor for float32, whose errors are rounding-level on both sides): a wrong RoPE, norm,
bias or weight mapping costs errors of the logits' own size (O(10)), far outside it. In float32
the greedy reply must also be transformers' `generate` token for token.
"""
from __future__ import annotations

import torch

from specchat.backends.base import Request, Sampling, run_to_summary
from specchat.backends.hf_reference import load_hf_model
from specchat.backends.native.engine import TorchBackend

from .budget import Part
from .plan import Plan
from .report import failure

MESSAGES = [{"role": "user", "content": "hello world, how are you today?"}]
ERROR_RATIO = 4.0  # engine error / transformers' error in the same precision
FLOOR = {"float32": 1e-4, "bfloat16": 0.0}  # float32: the test suite's tolerance (tests/native/test_model_parity.py)
GREEDY_TOKENS = 24


def reference_model(path, dtype: torch.dtype, device: torch.device):
    # a GGUF goes through transformers' own GGUF converter, which dequantizes to float32 first
    return load_hf_model(path, torch.float32).to(device=device, dtype=dtype)


def check_one(name: str, path, precision: str, plan: Plan, ref64) -> dict:
    dtype, device = getattr(torch, precision), plan.torch_device
    engine = TorchBackend(path, **plan.engine(precision=precision, context=96))
    hf = reference_model(path, dtype, device)
    ids = engine.tokenize_chat(MESSAGES)
    x = torch.tensor([ids], device=device)
    with torch.inference_mode():
        exact = ref64(x).logits[0]
        theirs = hf(x).logits[0].double()
    ours = engine.forward(ids, 0)[0].double()
    engine_error = (ours - exact).abs().max().item()
    hf_error = (theirs - exact).abs().max().item()
    bound = ERROR_RATIO * hf_error + FLOOR[precision]
    row = {"checkpoint": name, "precision": precision, "engine_error": engine_error,
           "transformers_error": hf_error, "bound": bound, "engine_vs_transformers": (ours - theirs).abs().max().item(),
           "logit_scale": exact.abs().max().item(),
           "argmax_agreement": (ours.argmax(-1) == exact.argmax(-1)).double().mean().item(),
           "within_tolerance": engine_error <= bound}
    if precision == "float32":
        with torch.inference_mode():
            out = hf.generate(x, max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        engine.eos_ids = frozenset()  # transformers was told to ignore eos too
        got = run_to_summary(engine.stream(Request(prompt_ids=ids), Sampling(max_tokens=GREEDY_TOKENS))).token_ids
        row["greedy_equal_to_generate"] = got == out
    row["passed"] = row["within_tolerance"] and row.get("greedy_equal_to_generate", True)
    engine.close()
    return row


def run(part: Part, plan: Plan, checkpoints: dict) -> dict:
    rows = []
    for name, path in checkpoints.items():
        if not part.allows(2):
            part.skip(f"logits of {name}")
            continue
        try:
            ref64 = reference_model(path, torch.float64, plan.torch_device)
        except Exception:
            rows.append({"checkpoint": name, "precision": "float64 (reference)", "passed": False, **failure()})
            continue
        for precision in plan.precisions:
            try:
                rows.append(check_one(name, path, precision, plan, ref64))
            except Exception:
                rows.append({"checkpoint": name, "precision": precision, "passed": False, **failure()})
        del ref64
    return {"passed": bool(rows) and all(r["passed"] for r in rows), "rows": rows}
