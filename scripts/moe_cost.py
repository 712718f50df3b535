"""What a mixture-of-experts target costs per pass, measured and on paper.

Measured (CPU): a random Qwen3-MoE model written by transformers' own class (every layer routed
experts) and a dense Qwen3 model of the same active size (its MLP as wide as top_k experts), both
on the torch engine in bfloat16 with row-exact passes (strict verification's arithmetic). For
K = 1..8 rows: the time of a pass with rows grouped by expert (each chosen expert's weights read
once per block, as the engine runs it) and with each row's experts run row by row (the naive
block), against the dense model's K-row pass; interleaved; per variant the fastest of --repeats
wall times and the median process CPU time (on a shared machine the fastest run is the one least
disturbed, and CPU time does not count the waits for a core); --threads 1 by default, so that
neither is a wait between the pass's own threads.

On paper (GPU): the bytes a Qwen3-30B-A3B pass reads for K rows, from its config (48 layers,
hidden 2048, 32 query / 4 key-value heads of 128, 128 experts of width 768, top-8, vocabulary
151,936), with rows choosing experts independently and uniformly (real routing repeats experts
between neighbouring tokens more, so these are upper bounds), and so the acceptance rate a draft
of each depth needs before its verify pass pays for itself (memory-bound decode, draft cost 0).

    nice -n 10 python scripts/moe_cost.py [--repeats 7] [--threads 1] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from specchat.backends.native.moe import RoutedExperts
from specchat.backends.native.weights import build_model, load_hf_dir

SHAPE = dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
             vocab_size=4096, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False)
EXPERTS, TOP_K, EXPERT_DIM = 32, 4, 512


def write_models(root: Path) -> tuple[Path, Path]:
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    moe = Qwen3MoeConfig(**SHAPE, num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=EXPERT_DIM,
                         intermediate_size=TOP_K * EXPERT_DIM, norm_topk_prob=True)
    dense = Qwen3Config(**SHAPE, intermediate_size=TOP_K * EXPERT_DIM)  # the same active MLP width
    paths = []
    for name, cfg in (("moe", moe), ("dense", dense)):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in n else 0.05 * torch.randn_like(p))
        model.to(torch.bfloat16).save_pretrained(str(root / name))
        paths.append(root / name)
    return paths[0], paths[1]


@contextmanager
def row_by_row():
    """RoutedExperts run one row at a time: every row reads its own top-k experts' weights."""
    grouped = RoutedExperts.forward
    RoutedExperts.forward = lambda self, h, exact=False: torch.cat(
        [grouped(self, h[i:i + 1], exact) for i in range(h.shape[0])])
    try:
        yield
    finally:
        RoutedExperts.forward = grouped


def timed(model, tokens: torch.Tensor, start: int) -> tuple[float, float]:
    """(wall, process CPU) seconds of one row-exact pass of `tokens` at `start`."""
    model.cache.length = start
    wall, cpu = time.perf_counter(), time.process_time()
    model(tokens[None], start, all_logits=True, row_exact=True)
    return time.perf_counter() - wall, time.process_time() - cpu


def distinct_experts(model, tokens: torch.Tensor, start: int) -> float:
    """Mean number of distinct experts a K-row block reads per sparse layer."""
    counts = []
    hooks = [layer.mlp.router.register_forward_hook(lambda m, a, out: counts.append(len(out[1].unique())))
             for layer in model.layers if isinstance(layer.mlp, RoutedExperts)]
    timed(model, tokens, start)
    for h in hooks:
        h.remove()
    return sum(counts) / len(counts)


def measure(repeats: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as root:
        moe_path, dense_path = write_models(Path(root))
        moe, dense = (build_model(load_hf_dir(p), torch.bfloat16, 256) for p in (moe_path, dense_path))
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, SHAPE["vocab_size"], (64,), generator=g)
    for m in (moe, dense):
        m(prompt[None], 0)
    start = len(prompt)
    rows = []
    for K in range(1, 9):
        block = torch.randint(0, SHAPE["vocab_size"], (K,), generator=g)
        times = {"grouped": [], "row_by_row": [], "dense": []}
        for i in range(repeats + 1):  # interleaved, so that a busy moment hits every variant alike
            grouped = timed(moe, block, start)
            with row_by_row():
                naive = timed(moe, block, start)
            plain = timed(dense, block, start)
            if i:  # the first round warms up
                times["grouped"].append(grouped)
                times["row_by_row"].append(naive)
                times["dense"].append(plain)
        rows.append({"rows": K, **{k: 1e3 * min(w for w, _ in v) for k, v in times.items()},
                     **{f"{k}_cpu": 1e3 * statistics.median(c for _, c in v) for k, v in times.items()},
                     "experts_read": distinct_experts(moe, block, start)})
    one = rows[0]
    for r in rows:
        r |= {f"{k}_x": r[k] / one[k] for k in ("grouped", "row_by_row", "dense")}
        r |= {f"{k}_cpu_x": r[f"{k}_cpu"] / one[f"{k}_cpu"] for k in ("grouped", "row_by_row", "dense")}
    return rows


# ---- on paper: Qwen3-30B-A3B on a GPU ----

QWEN3_30B = dict(layers=48, dim=2048, q_dim=32 * 128, kv_dim=4 * 128, experts=128, top_k=8, expert_dim=768,
                 vocab=151936)


def paper(bytes_per_weight: float = 2.0) -> list[dict]:
    c = QWEN3_30B
    d = c["dim"]
    attention = d * c["q_dim"] * 2 + d * c["kv_dim"] * 2  # q, o; k, v
    expert = 3 * d * c["expert_dim"]
    router = c["experts"] * d
    fixed = c["layers"] * (attention + router) + c["vocab"] * d  # and the LM head
    out = []
    for K in range(1, 9):
        unique = c["experts"] * (1 - (1 - c["top_k"] / c["experts"]) ** K)
        read = (fixed + c["layers"] * unique * expert) * bytes_per_weight
        out.append({"rows": K, "experts_per_layer": unique, "gb": read / 1e9})
    for r in out:
        r["cost_x"] = r["gb"] / out[0]["gb"]
        r["break_even_acceptance"] = break_even(r["rows"] - 1, r["cost_x"])
    return out


def break_even(depth: int, cost: float) -> float | None:
    """The per-token acceptance rate a at which a draft of `depth` tokens yields `cost` tokens per
    pass: (1 - a^(depth+1)) / (1 - a) = cost (None for depth 0)."""
    if depth == 0:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        if sum(a ** i for i in range(depth + 1)) < cost:
            lo = a
        else:
            hi = a
    return (lo + hi) / 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    measured, on_paper = measure(args.repeats), paper()
    if args.json:
        print(json.dumps({"measured": measured, "paper": on_paper}, indent=1))
        return
    print(f"measured, torch {torch.__version__}, {args.threads} thread(s), bfloat16 row-exact passes; "
          f"MoE {EXPERTS} experts top-{TOP_K} of width {EXPERT_DIM} vs dense MLP {TOP_K * EXPERT_DIM}")
    print("rows | MoE grouped: fastest ms (x one row), CPU ms (x) | MoE row by row: same | dense: same | "
          "experts read/layer")
    for r in measured:
        cells = [f"{r[k]:.1f} ({r[k + '_x']:.2f}x), {r[k + '_cpu']:.1f} ({r[k + '_cpu_x']:.2f}x)"
                 for k in ("grouped", "row_by_row", "dense")]
        print(f"{r['rows']} | " + " | ".join(cells) + f" | {r['experts_read']:.1f}")
    print("\non paper, Qwen3-30B-A3B in bfloat16, uniform independent routing")
    print("rows | experts read/layer | GB read a pass | x one-token pass | break-even acceptance at depth rows-1")
    for r in on_paper:
        be = "-" if r["break_even_acceptance"] is None else f"{r['break_even_acceptance']:.2f}"
        print(f"{r['rows']} | {r['experts_per_layer']:.1f} | {r['gb']:.2f} | {r['cost_x']:.2f} | {be}")


if __name__ == "__main__":
    main()
