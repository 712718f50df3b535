"""Part 2: the speculative parity grid on the device. For every drafter, depth, sampling mode and
prompt, the speculative reply must be the target-only reply token for token (exact acceptance,
the same seed), as tests/speculative/test_parity.py demands on CPU.

Verification is strict wherever the engine can make verify rows bit for bit single-token passes
(`row_exact_supported`); there any difference is a mismatch. Elsewhere a multi-row pass may round
a near-tie the other way: each difference is judged (judge.py) and the near-tie rate is reported.
Either way a mismatch fails the part.
"""
from __future__ import annotations

from collections import Counter

from specchat.backends.base import Request, Sampling
from specchat.backends.native.engine import TorchBackend
from specchat.backends.native.mtp import MtpHead, read_mtp
from specchat.backends.speculative.backend import SpeculativeBackend
from specchat.backends.speculative.dflash import DFlashDrafter, load_dflash
from specchat.backends.speculative.drafters import DraftModelDrafter, LookupFirst, NgramDrafter
from specchat.backends.speculative.loop import Drafter
from specchat.backends.speculative.mtp import MtpDrafter

from .budget import Part
from .checkpoints import ParityCheckpoints
from .judge import compare
from .plan import Plan
from .report import failure

PROMPTS = [[{"role": "user", "content": "the quick brown fox jumps over the lazy dog"}],
           [{"role": "user", "content": "hello world, how are you today? Paris is the capital of France."}]]
# greedy, seeded sampling, and seeded sampling through top-k / top-p (tests/speculative/conftest.py)
SAMPLINGS = {"greedy": dict(), "t0.8": dict(temperature=0.8, seed=3),
             "t1.2-topk-topp": dict(temperature=1.2, top_k=20, top_p=0.9, seed=5)}
DRAFTERS = ("ngram", "draft", "self", "mtp", "dflash", "mtp+lookup")


def engine(path, precision: str, plan: Plan) -> TorchBackend:
    return TorchBackend(path, "hf_dir", **plan.engine(precision=precision, context=256))


def mtp_drafter(ck: ParityCheckpoints, target: TorchBackend) -> MtpDrafter:
    """The target's built-in MTP head, fed its final hidden state."""
    head = MtpHead(read_mtp(ck.target, target.model.cfg), target.model, target.context_length)
    return MtpDrafter(head, target.eos_ids, "post_norm")


def with_lookup(model: Drafter) -> LookupFirst:
    """Prompt lookup in front of a model drafter, on single-token matches (so that random models
    use both), as tests/speculative/conftest.py's."""
    return LookupFirst(model, lookup_depth=4, n_min=1, n_max=3, model_depth=8)


def drafter_factories(ck: ParityCheckpoints, target: TorchBackend, precision: str, plan: Plan) -> dict:
    """name -> a fresh drafter: prompt lookup, a different model, the target itself (every draft
    right under greedy: the longest accepted blocks), the built-in MTP head, DFlash, and prompt
    lookup in front of the MTP head."""
    draft, itself = engine(ck.draft, precision, plan), engine(ck.target, precision, plan)
    dflash = load_dflash(ck.dflash, target.model.cfg)
    return {"ngram": lambda: NgramDrafter(1, 3), "draft": lambda: DraftModelDrafter(draft),
            "self": lambda: DraftModelDrafter(itself), "mtp": lambda: mtp_drafter(ck, target),
            "dflash": lambda: DFlashDrafter(dflash, target), "mtp+lookup": lambda: with_lookup(mtp_drafter(ck, target))}


def run_precision(part: Part, plan: Plan, ck: ParityCheckpoints, precision: str, drafters=DRAFTERS) -> dict:
    target = engine(ck.target, precision, plan)
    factories = drafter_factories(ck, target, precision, plan)
    cases, strict = [], None
    # depth outermost: a budget that runs out drops the deepest blocks, not whole drafters
    for depth in plan.parity_depths:
        for label, kw in SAMPLINGS.items():
            for name in drafters:
                if not part.allows(1):
                    part.skip(f"{precision} {name} depth {depth} {label}")
                    continue
                try:
                    spec = SpeculativeBackend(target, factories[name](), depth, strict=None)  # strict where possible
                except Exception:
                    cases.append({"drafter": name, "depth": depth, "sampling": label, "verdict": "error", **failure()})
                    continue
                strict = spec.strict
                for p, messages in enumerate(PROMPTS[:plan.parity_prompts]):
                    case = {"drafter": name, "depth": depth, "sampling": label, "prompt": p}
                    sampling = Sampling(**kw, max_tokens=plan.parity_tokens)
                    try:
                        ref, out, v = compare(target, spec, Request(messages=messages), sampling)
                        case |= {"verdict": v.kind, "line": v.line(), "tokens": out.tokens, "passes": out.passes,
                                 "reference_passes": ref.passes, "mean_accepted": out.mean_accepted}
                    except Exception:
                        case |= {"verdict": "error", **failure()}
                    cases.append(case)
    counts = Counter(c["verdict"] for c in cases)
    return {"precision": precision, "device": plan.device, "strict": strict, "cases": len(cases),
            "identical": counts["identical"], "near_tie": counts["near-tie"], "mismatch": counts["mismatch"],
            "errors": counts["error"],
            "near_tie_rate": counts["near-tie"] / len(cases) if cases else None,
            "tokens_per_pass": {name: _tokens_per_pass([c for c in cases if c["drafter"] == name])
                                        for name in drafters},
            "passed": bool(cases) and counts["mismatch"] == counts["error"] == 0,
            "differences": [c for c in cases if c["verdict"] != "identical"]}


def _tokens_per_pass(cases: list[dict]) -> float | None:
    """Reply tokens per target pass: above 1 shows the drafter's guesses were really verified."""
    passes = sum(c.get("passes", 0) for c in cases)
    return sum(c.get("tokens", 0) for c in cases) / passes if passes else None


def run(part: Part, plan: Plan, ck: ParityCheckpoints) -> dict:
    grids = []
    for i, precision in enumerate(plan.precisions):  # each precision an equal share of what is left
        share = Part(part.clock, f"parity {precision}", part.left() / (len(plan.precisions) - i))
        grids.append(run_precision(share, plan, ck, precision))
        part.skipped += share.skipped
    return {"passed": all(g["passed"] for g in grids), "grids": grids}
