"""How close the default model's logits come to its float32 logits on each 4-bit path: specchat's
kernel (int8 activations), torch's int4 kernel (bfloat16 activations) and llama.cpp, teacher-forced
over Spec-Bench prompts (one-token-pass arithmetic: row-exact blocks of 8).

    python scripts/kernel_accuracy.py [--prompts 12] [--tokens 200]

Prints, per path, top-1 agreement with float32, mean KL(float32 || path) and mean |logit
difference|. Each path runs in its own process (the kernel is chosen at load).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

QUESTIONS = Path(__file__).resolve().parents[2] / "shared/data/spec-bench/question.jsonl"


def prompts(n: int) -> list[str]:
    rows = [json.loads(line) for line in QUESTIONS.read_text().splitlines()]
    return [r["turns"][0] for r in rows[:: len(rows) // n]][:n]


def torch_logits(precision: str, n: int, tokens: int) -> list[torch.Tensor]:
    from specchat.backends.native.engine import TorchBackend
    from specchat.models import pull

    engine = TorchBackend(pull(progress=False), precision=precision, context=2048)
    out = []
    with torch.inference_mode():
        for text in prompts(n):
            ids = engine.tokenize_chat([{"role": "user", "content": text}])[:tokens]
            engine.truncate(0)
            out.append(torch.cat([engine.forward(ids[lo:lo + 8], lo, row_exact=precision == "int4")[0]
                                  for lo in range(0, len(ids), 8)]))
    return out


def llamacpp_logits(n: int, tokens: int) -> list[torch.Tensor]:
    import numpy as np
    from llama_cpp import Llama

    from specchat.backends.native.engine import TorchBackend
    from specchat.models import pull

    path = pull(progress=False)
    tokenizer = TorchBackend(path, precision="float32", context=64)  # the same chat template and ids
    llm = Llama(model_path=str(path), n_ctx=2048, logits_all=True, verbose=False, n_threads=2, n_batch=1)
    out = []
    for text in prompts(n):
        ids = tokenizer.tokenize_chat([{"role": "user", "content": text}])[:tokens]
        llm.reset()
        llm.eval(ids)
        out.append(torch.tensor(np.array(llm.scores[:len(ids)]), dtype=torch.float32))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--path", help=argparse.SUPPRESS)  # internal: one path, in a child process
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.path:
        kind = args.path.split(":")[0]
        logits = llamacpp_logits(args.prompts, args.tokens) if kind == "llamacpp" else \
            torch_logits(kind, args.prompts, args.tokens)
        torch.save(logits, args.out)
        return
    paths = {"float32": ("float32", {}), "specchat kernel (int8 activations)": ("int4", {}),
             "torch int4 kernel (bfloat16 activations)": ("int4", {"SPECCHAT_Q4_KERNEL": "0"}),
             "llama.cpp (batch 1)": ("llamacpp", {})}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, (kind, env)) in enumerate(paths.items()):
            out = f"{tmp}/{i}.pt"
            subprocess.run([sys.executable, __file__, "--path", kind, "--out", out, "--prompts", str(args.prompts),
                            "--tokens", str(args.tokens)], check=True, env=os.environ | env)
            results[name] = torch.cat(torch.load(out))
    ref = results.pop("float32")
    p = ref.log_softmax(1)
    print(f"{len(ref)} positions of {args.prompts} Spec-Bench prompts, against float32:")
    print("| path | top-1 agreement | mean KL | mean abs logit difference |\n|---|---|---|---|")
    for name, x in results.items():
        kl = (p.exp() * (p - x.log_softmax(1))).sum(1).mean()
        top = (x.argmax(1) == ref.argmax(1)).float().mean()
        print(f"| {name} | {top:.2%} | {kl:.5f} | {(x - ref).abs().mean():.3f} |")


if __name__ == "__main__":
    main()
