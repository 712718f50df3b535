"""Part 3: the compiled decode path (`compile=True`) against eager, on the device.

On CUDA, and on CPU in float32, `compile=True` runs every pass through torch.compile over static
shapes ("reduce-overhead": CUDA graphs on CUDA); the eager engine of the same device is the
reference. Another graph rounds differently, so single-token logits must be close (not equal), the
greedy reply the same up to a near-tie, and speculative decoding on the compiled target must
still reproduce compiled target-only decoding (judge.py), with drafters that read the target's
hidden states out of the graphs (MTP, DFlash) as well as those that do not.
"""
from __future__ import annotations

import time
from collections import Counter

import torch
from torch._dynamo.utils import counters

from specchat.backends.base import Request, Sampling, run_to_summary
from specchat.backends.native.engine import TorchBackend
from specchat.backends.speculative.backend import SpeculativeBackend
from specchat.backends.speculative.dflash import DFlashDrafter, load_dflash
from specchat.backends.speculative.drafters import DraftModelDrafter, NgramDrafter

from .budget import Part
from .checkpoints import ParityCheckpoints
from .judge import compare, fresh, judge_engines
from .parity import PROMPTS, SAMPLINGS, mtp_drafter, with_lookup
from .plan import Plan
from .report import failure

# Largest logit differences compiled vs eager (logits are O(10)): float32 rounding-level; for
# bfloat16, tests/speculative/test_compiled.py's bounds for another graph's rounding.
LIMITS = {"float32": dict(max=1e-3, mean=1e-4, agreement=1.0),
          "bfloat16": dict(max=0.5, mean=0.05, agreement=0.9)}
DEPTH = 3
DECODE_STEPS = 20


def _row(engine: TorchBackend, ids: list[int]) -> torch.Tensor:
    fresh(engine).forward(ids, 0)
    return torch.cat([engine.forward([t], len(ids) + i)[0] for i, t in enumerate(ids[:DECODE_STEPS])])


def run(part: Part, plan: Plan, ck: ParityCheckpoints) -> dict:
    started = time.perf_counter()
    precision = plan.compiled_precision
    torch._dynamo.reset()  # graphs of another part would count against dynamo's recompile limit
    graphs, skips = counters["stats"]["unique_graphs"], counters["inductor"]["cudagraph_skips"]
    eager = TorchBackend(ck.target, "hf_dir", **plan.engine(precision=precision, context=256))
    compiled = TorchBackend(ck.target, "hf_dir", **plan.engine(precision=precision, context=256, compile=True))
    ids = eager.tokenize_chat(PROMPTS[1])
    a, b = _row(compiled, ids), _row(eager, ids)
    first_s = time.perf_counter() - started  # loading both, and compiling the prefill and decode graphs
    diff = (a - b).abs()
    limit = LIMITS[precision]
    logits = {"max_diff": diff.max().item(), "mean_diff": diff.mean().item(),
              "argmax_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item(), "limits": limit}
    logits["passed"] = (logits["max_diff"] <= limit["max"] and logits["mean_diff"] <= limit["mean"]
                        and logits["argmax_agreement"] >= limit["agreement"])
    result = {"precision": precision, "device": plan.device, "static_shapes": compiled.model.static,
              "load_and_first_graphs_s": first_s, "decode_logits": logits}
    cases = [("target-only vs eager target-only", compare_replies(compiled, eager))]
    dflash = load_dflash(ck.dflash, compiled.model.cfg)
    # those that read hidden states out of the graphs first (the shipped CUDA profiles' methods):
    # each new set of layers is another graph to compile, and the budget may not reach the last
    drafters = {"dflash": lambda: DFlashDrafter(dflash, compiled),
                "mtp+lookup": lambda: with_lookup(mtp_drafter(ck, compiled)),
                "draft (eager)": lambda: DraftModelDrafter(eager), "ngram": lambda: NgramDrafter(1, 3)}
    for name, make in drafters.items():
        for label in ("greedy", "t0.8"):
            if not part.allows(5):
                part.skip(f"compiled {name} {label}")
                continue
            sampling = Sampling(**SAMPLINGS[label], max_tokens=40)
            try:
                spec = SpeculativeBackend(compiled, make(), DEPTH, strict=None)
                _, out, v = compare(compiled, spec, Request(messages=PROMPTS[0]), sampling)
                case = {"verdict": v.kind, "line": v.line(), "mean_accepted": out.mean_accepted}
            except Exception:
                case = {"verdict": "error", **failure()}
            cases.append((f"speculative {name} depth {DEPTH} {label}", case))
    counts = Counter(c["verdict"] for _, c in cases)
    result.update(cases=dict(cases), identical=counts["identical"], near_tie=counts["near-tie"],
                  mismatch=counts["mismatch"], errors=counts["error"],
                  graphs_compiled=counters["stats"]["unique_graphs"] - graphs,
                  cudagraph_skips=counters["inductor"]["cudagraph_skips"] - skips,  # why: in log.txt
                  seconds=time.perf_counter() - started)
    result["passed"] = logits["passed"] and counts["mismatch"] == counts["error"] == 0 and len(cases) > 1
    return result


def compare_replies(compiled: TorchBackend, eager: TorchBackend) -> dict:
    """The compiled engine's greedy reply against the eager engine's, judged on the eager one's scores."""
    request, sampling = Request(messages=PROMPTS[1]), Sampling(max_tokens=40)
    ref = run_to_summary(fresh(eager).stream(request, sampling))
    out = run_to_summary(fresh(compiled).stream(request, sampling))
    v = judge_engines(eager, request, sampling, ref, out)
    return {"verdict": v.kind, "line": v.line()}
