"""Tiny checkpoints with MTP layers, written by transformers' own classes, and their GGUFs as llama.cpp's
converter writes them (its nextn blocks: backends/native/gguf_mtp.py).

- qwen35: the Qwen3.5 hybrid (tiny.make_hybrid_checkpoint) with a Qwen3.5 MTP head (`mtp.*`, its
  gated attention layer and dense MLP);
- qwen35moe: Qwen3.5-MoE (tiny_moe) with its head's layer routed experts and a gated shared expert;
- glm4moe: GLM-4.5 (tiny_moe) with a GLM-style head (`model.layers.{N}.eh_proj` ..., routed experts).

The MTP tensors go to `model-mtp.safetensors`, a second part of the checkpoint, as the published
checkpoints keep them beside the main weights: the converter reads the parts named `model*`, the
engine's directory loader every `*.safetensors`. Qwen3.5's multimodal RoPE sections are fitted to the
tiny heads' 4 rotated dims ([1, 1, 0] pairs, for Qwen3.5's [11, 11, 10] of 64): llama.cpp checks that
they fit (with the default, llama-server aborts: `GGML_ASSERT(sect_dims <= ne0)`); text positions
are the same in every section, so transformers' and the engine's RoPE are unchanged.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from tests.native.tiny import add_mtp_head, make_hybrid_checkpoint
from tests.native.tiny_moe import add_moe_mtp_head, make_moe_checkpoint

MTP_ARCHS = ("qwen35", "qwen35moe", "glm4moe")
SEEDS = {"qwen35": 61, "qwen35moe": 62, "glm4moe": 63}


def make_mtp_checkpoint(out: Path, arch: str) -> Path:
    seed = SEEDS[arch]
    if arch == "qwen35":
        path = make_hybrid_checkpoint(out, "qwen3_5", seed=seed)
        add_mtp_head(path, "qwen3_next", seed=seed + 100)
    else:
        path = make_moe_checkpoint(out, "qwen3_5_moe" if arch == "qwen35moe" else "glm4_moe", seed=seed)
        add_moe_mtp_head(path, "qwen3_next" if arch == "qwen35moe" else "deepseek", seed=seed + 100)
    os.replace(path / "mtp.safetensors", path / "model-mtp.safetensors")
    if arch != "glm4moe":
        config = json.loads((path / "config.json").read_text())
        config["rope_parameters"]["mrope_section"] = [1, 1, 0]
        (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def make_mtp_ggufs(root: Path) -> dict:
    """arch -> the F32 GGUF of its tiny checkpoint with MTP layers; (arch, "Q8_0") -> qwen35's and
    glm4moe's as Q8_0 (their matrices on specchat's kernels); (arch, "hf") -> the checkpoint."""
    from tests.native.convert import convert

    out = {(arch, "hf"): make_mtp_checkpoint(root / arch, arch) for arch in MTP_ARCHS}
    jobs = {arch: (out[arch, "hf"], root / f"{arch}-F32.gguf", "f32") for arch in MTP_ARCHS}
    jobs |= {(arch, "Q8_0"): (out[arch, "hf"], root / f"{arch}-Q8_0.gguf", "q8_0") for arch in ("qwen35", "glm4moe")}
    convert(list(jobs.values()))
    return out | {key: path for key, (_, path, _) in jobs.items()}


def teach_mtp_head(ckpt: Path, prompts: list[list[int]], max_tokens: int = 40, steps: int = 300) -> Path:
    """The Qwen3.5 MTP head of `ckpt` (model-mtp.safetensors) trained, in place, to predict the
    target's own greedy continuations of `prompts` (token ids): entry t sees the target's final-normed
    state at t and token t+1 and learns token t+2, as the engine's head runs (backends/native/mtp.py,
    post_norm). A random head's guesses land on no engine; this one's land where it has learnt the
    reply, so two engines running the file's MTP can be compared by what they accept. Written with
    transformers' own Qwen3.5 decoder layer, independently of specchat's."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel

    target = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    embed, head = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    data = []
    with torch.no_grad():
        for ids in prompts:
            seq = target.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                                  eos_token_id=[2, 0], pad_token_id=0)[0]
            data.append((seq, target.model(seq[None]).last_hidden_state[0]))
    config = target.config.get_text_config()
    config.num_hidden_layers, config.layer_types = 1, ["full_attention"]
    body = Qwen3_5TextModel(config).float()
    mtp = load_file(str(ckpt / "model-mtp.safetensors"))
    state = {"layers.0." + k[len("mtp.layers.0."):]: v for k, v in mtp.items() if k.startswith("mtp.layers.0.")}
    body.load_state_dict(state | {"norm.weight": mtp["mtp.norm.weight"], "embed_tokens.weight": embed}, strict=True)
    own = {k: torch.nn.Parameter(mtp[k].clone()) for k in
           ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight")}
    eps = config.rms_norm_eps

    def norm(x, w):  # Qwen3.5's zero-centred RMSNorm
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)

    params = [p for n, p in body.named_parameters() if not n.startswith("embed_tokens")] + list(own.values())
    opt = torch.optim.Adam(params, lr=3e-3)
    torch.manual_seed(0)
    for step in range(steps):
        seq, hidden = data[step % len(data)]
        u = torch.cat([norm(embed[seq[1:-1]], own["mtp.pre_fc_norm_embedding.weight"]),
                       norm(hidden[:-2], own["mtp.pre_fc_norm_hidden.weight"])], -1) @ own["mtp.fc.weight"].T
        logits = body(inputs_embeds=u[None]).last_hidden_state[0] @ head.T
        loss = torch.nn.functional.cross_entropy(logits, seq[2:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = {"mtp.layers.0." + k[len("layers.0."):]: v for k, v in body.state_dict().items() if k.startswith("layers.0.")}
    out |= {"mtp.norm.weight": body.norm.weight} | own
    assert set(out) == set(mtp)
    save_file({k: v.detach().clone().contiguous() for k, v in out.items()}, str(ckpt / "model-mtp.safetensors"))
    return ckpt
