"""What a Qwen3-30B-A3B model holds in memory on the CPU with `dtype: int4`, measured on a few of its
layers and extrapolated to its 48 (docs/results.md, "a 30B-A3B MoE in 24 GB").

Writes a checkpoint with the real model's shapes (transformers' Qwen3MoeConfig: hidden 2048, 32
query / 4 key-value heads of 128, 128 experts of width 768, top-8, vocabulary 151,936, untied head)
but only N layers, random bfloat16 weights stored as published (per-expert tensors, a safetensors
shard a layer; the N-layer folders share the shards), and the tests' small tokenizer. Then, for each
N, a fresh process loads it through the engine (TorchBackend, int4, context 4096, 2 threads) and
reports the bytes of every tensor the built model holds by part (memory_plan.held_bytes), the
estimate weight_memory makes from the headers before loading, and the process's own resident
memory (RssAnon: VmRSS without the mapped pages of the safetensors files, which the kernel can
drop) before and after the load and its peak during it (sampled every 20 ms). As the 48-layer
model (whose bfloat16 copies of attention would take 1.8 GB, over DENSE_COPY_MAX_BYTES) the loads
keep no such copies.
Per layer = the difference between two depths over their layer difference; fixed = the rest; the
48-layer figure = fixed + 48 x per layer, the KV cache counted for all 4096 positions.

Needs about 6 GB of disk and, for --layers 2 4, at most ~5 GB of memory:

    nice -n 10 python scripts/moe_memory.py runs/moe-memory --layers 2 4 [--json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' tokenizer writer

SHAPE = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
             moe_intermediate_size=768, num_experts_per_tok=8, intermediate_size=6144, vocab_size=151936,
             max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6, norm_topk_prob=True,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
FULL_LAYERS, CONTEXT = 48, 4096
GB = 1e9


def write_checkpoint(root: Path, depths: list[int]) -> dict[int, Path]:
    """One shard per layer (and one for the embedding, head and final norm) under root/shards;
    root/L{n} holds config, index, tokenizer and links to the shards of its n layers."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from tests.native.tiny import make_tokenizer

    shards = root / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):  # names and shapes from transformers' own class, no memory
        shapes = {n: tuple(p.shape) for n, p in AutoModelForCausalLM.from_config(
            Qwen3MoeConfig(**SHAPE, num_hidden_layers=1)).named_parameters()}
    g = torch.Generator().manual_seed(0)

    def random(shape) -> torch.Tensor:
        return torch.randn(shape, generator=g, dtype=torch.bfloat16).mul_(0.02)

    def layer_tensors(i: int) -> dict[str, torch.Tensor]:
        out = {}
        for name, shape in shapes.items():
            if not name.startswith("model.layers.0."):
                continue
            name = name.replace("model.layers.0.", f"model.layers.{i}.")
            if name.endswith("mlp.experts.gate_up_proj"):  # held fused in memory, published per expert
                base = name.removesuffix("gate_up_proj")
                for e in range(shape[0]):
                    for part in ("gate", "up"):
                        out[f"{base}{e}.{part}_proj.weight"] = random((shape[1] // 2, shape[2]))
            elif name.endswith("mlp.experts.down_proj"):
                base = name.removesuffix("down_proj")
                out |= {f"{base}{e}.down_proj.weight": random(shape[1:]) for e in range(shape[0])}
            else:
                out[name] = torch.ones(shape, dtype=torch.bfloat16) if "norm" in name else random(shape)
        return out

    where = {}
    top = {n: s for n, s in shapes.items() if not n.startswith("model.layers.")}
    for i in range(-1, max(depths)):
        f = shards / ("top.safetensors" if i < 0 else f"layer-{i:02d}.safetensors")
        if not f.exists():
            tensors = {n: torch.ones(s, dtype=torch.bfloat16) if "norm" in n else random(s) for n, s in top.items()} \
                if i < 0 else layer_tensors(i)
            save_file(tensors, str(f), metadata={"format": "pt"})
            del tensors
        from specchat.backends.weight_files import safetensors_header

        where |= {name: (i, f.name) for name in safetensors_header(f).tensors}
    dirs = {}
    for n in depths:
        d = root / f"L{n}"
        d.mkdir(exist_ok=True)
        Qwen3MoeConfig(**SHAPE, num_hidden_layers=n).save_pretrained(str(d))
        make_tokenizer(d)
        mine = {name: f for name, (i, f) in where.items() if i < n}
        for f in set(mine.values()):
            if not (d / f).exists():
                (d / f).unlink(missing_ok=True)  # a broken link
                (d / f).symlink_to((shards / f).resolve())
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": mine}))
        dirs[n] = d
    return dirs


def rss() -> dict[str, int]:
    """VmRSS and its peak VmHWM count the safetensors files' mapped pages too (RssFile: page cache
    the kernel can drop); RssAnon is the process's own memory."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {k: int(status[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}


class AnonPeak(threading.Thread):
    """The highest RssAnon seen, sampled every 20 ms (the kernel keeps a peak only of VmRSS)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.done = 0, threading.Event()
        self.start()

    def run(self) -> None:
        while not self.done.wait(0.02):
            self.peak = max(self.peak, rss()["RssAnon"])

    def stop(self) -> int:
        self.done.set()
        self.join()
        return max(self.peak, rss()["RssAnon"])


def measure(path: Path) -> dict:
    """Runs in its own process: load, then what is held."""
    import torch

    import specchat.backends.native.memory_plan as plan
    import specchat.backends.native.weights as weights
    from specchat import weight_memory
    from specchat.backends.native import q4_kernel
    from specchat.backends.native.engine import TorchBackend

    plan.DENSE_COPY_MAX_BYTES = weights.DENSE_COPY_MAX_BYTES = 0  # as the 48-layer model: see the top
    q4_kernel.available()  # the kernel's library loaded before the first figure
    torch.ones(1) @ torch.ones(1)
    before, started, peak = rss(), time.perf_counter(), AnonPeak()
    engine = TorchBackend(path, "hf_dir", precision="int4", threads=2, context=CONTEXT)
    loaded, seconds, anon_peak = rss(), time.perf_counter() - started, peak.stop()
    held = plan.held_bytes(engine.model)
    estimate = weight_memory.read_checkpoint(path, "hf_dir").int4_bytes
    return {"layers": engine.model.cfg.n_layers, "load_s": round(seconds, 1), "rss_before": before["RssAnon"],
            "rss_after": loaded["RssAnon"], "rss_peak": anon_peak, "vm_rss_after": loaded["VmRSS"],
            "vm_hwm": loaded["VmHWM"], "held": held, "estimate": estimate,
            "kernel": engine.model.kernel, "argmax_head": engine.model.argmax_head is not None}


def extrapolate(a: dict, b: dict) -> dict:
    """Per layer and fixed parts from two depths; the 48-layer totals."""
    span = b["layers"] - a["layers"]

    def split(key_a: float, key_b: float) -> tuple[float, float]:
        per = (key_b - key_a) / span
        return per, key_a - a["layers"] * per

    def weights(m: dict) -> int:
        return sum(v for k, v in m["held"].items() if k != "cache")

    per_w, fixed_w = split(weights(a), weights(b))
    per_rss, fixed_rss = split(a["rss_after"] - a["rss_before"], b["rss_after"] - b["rss_before"])
    cache = b["held"]["cache"] / b["layers"] * FULL_LAYERS
    return {"per_layer_weights": per_w, "fixed_weights": fixed_w, "per_layer_rss": per_rss, "fixed_rss": fixed_rss,
            "weights_48": fixed_w + FULL_LAYERS * per_w, "cache_48": cache,
            "resident_48": fixed_rss + FULL_LAYERS * per_rss + cache,
            "peak_over_resident": max(m["rss_peak"] - m["rss_after"] for m in (a, b))}


def estimate_48(path: Path) -> int:
    """weight_memory's figure for the full model: the plan on layer 0's shapes repeated 48 times."""
    from specchat.backends.native.memory_plan import int4_dir_bytes
    from specchat.backends.weight_files import safetensors_header

    shapes = {n: tuple(t.shape) for f in path.glob("*.safetensors") for n, t in safetensors_header(f).tensors.items()}
    full = {n: s for n, s in shapes.items() if not n.startswith("model.layers.")}
    for i in range(FULL_LAYERS):
        full |= {n.replace("model.layers.0.", f"model.layers.{i}."): s for n, s in shapes.items()
                 if n.startswith("model.layers.0.")}
    return int4_dir_bytes(full, {"num_hidden_layers": FULL_LAYERS, "tie_word_embeddings": False})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--layers", type=int, nargs=2, default=[2, 4])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--measure", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return
    dirs = write_checkpoint(args.root, args.layers)
    runs = [json.loads(subprocess.run([sys.executable, __file__, str(args.root), "--measure", str(dirs[n])],
                                      check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            for n in args.layers]
    out = {"runs": runs, "extrapolated": extrapolate(*runs), "estimate_48": estimate_48(dirs[args.layers[0]])}
    if args.json:
        print(json.dumps(out, indent=1))
        return
    for r in runs:
        h, grew = r["held"], (r["rss_after"] - r["rss_before"]) / GB
        print(f"{r['layers']} layers: held {sum(h.values()) / GB:.3f} GB (layers {h['layers'] / GB:.3f}, "
              f"embedding {h['embed'] / GB:.3f}, head {h['head'] / GB:.3f}, KV cache {h['cache'] / GB:.3f}, "
              f"other {h['other'] / GB:.3f}); estimate {r['estimate'] / GB:.3f}; own RSS +{grew:.3f} GB, peak "
              f"{r['rss_peak'] / GB:.3f} GB over {r['rss_after'] / GB:.3f} GB (VmRSS {r['vm_rss_after'] / GB:.3f}, "
              f"VmHWM {r['vm_hwm'] / GB:.3f} with the files' pages); load {r['load_s']} s "
              f"({r['kernel']}, argmax head: {r['argmax_head']})")
    x = out["extrapolated"]
    print(f"per layer: weights {x['per_layer_weights'] / GB:.4f} GB, own RSS {x['per_layer_rss'] / GB:.4f} GB; "
          f"fixed: weights {x['fixed_weights'] / GB:.3f} GB, own RSS {x['fixed_rss'] / GB:.3f} GB")
    print(f"48 layers: weights {x['weights_48'] / GB:.2f} GB, KV cache ({CONTEXT} positions) "
          f"{x['cache_48'] / GB:.2f} GB, resident {x['resident_48'] / GB:.2f} GB "
          f"({x['resident_48'] / 2**30:.2f} GiB); peak over resident while loading "
          f"{x['peak_over_resident'] / GB:.2f} GB; weight_memory's estimate {out['estimate_48'] / GB:.2f} GB")

if __name__ == "__main__":
    main()
