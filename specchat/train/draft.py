"""`specchat train draft` / `specchat train replayssm`: a small draft model distilled from the
target's replies: a Llama (attention layers), or with `recurrent` a stack of Gated DeltaNet layers
only (Qwen3.5's linear attention), whose cost per drafted token does not grow with the context.

- Shape: `DraftShape` (layers, hidden, heads, ffn; linear heads); the tied embedding is the target's,
  dequantized by the engine's own loader and, when the hidden size is smaller, projected onto
  its top principal directions (a low-rank init that keeps the head close to the target's).
- Loss at every reply position: KL from the target's top-k distribution (renormalised over
  those k) to the drafter's, plus cross-entropy on the token the target chose.
- The model is transformers' own class (Llama, or Qwen3.5's text model with every layer
  `linear_attention`): the output is a checkpoint transformers and the torch engine read, and a
  drafter's arithmetic only decides how often it guesses right. The run is the shared loop
  (loop.py): deterministic for a seed, resumable.
- Output: a Hugging Face directory (config, bfloat16 safetensors, the target's tokenizer,
  generation_config, model card, training log) that `TorchBackend` loads like any model.
"""
from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specchat import paths
from specchat.backends.base import BackendError
from specchat.loading import target_path
from specchat.train import loop
from specchat.train.settings import DraftTrainConfig, flags_of
from specchat.train.card import data_info_of, full_command, prompt_sources
from specchat.train.examples import Example, load_examples, schedule, split


@dataclass
class DraftShape:
    layers: int = 1
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 768
    recurrent: bool = False  # Gated DeltaNet layers instead of attention (the ReplaySSM drafter)
    linear_heads: int = 2  # recurrent: key heads (value heads: twice as many, as in Qwen3.5)
    linear_head_dim: int = 64

    @property
    def kind(self) -> str:
        return "Gated DeltaNet (recurrent)" if self.recurrent else "Llama-architecture"

    @property
    def command(self) -> str:
        """The `specchat train` subcommand that trains this shape."""
        return "replayssm" if self.recurrent else "draft"


# ---- the target's pieces ----

def target_parts(profile):
    """(embedding float32 [V, D], model config, ChatTokenizer) of the target, via the engine's loaders."""
    from specchat.backends.native.engine import load_checkpoint
    from specchat.backends.native.tokenizer import ChatTokenizer

    path, kind = target_path(profile)
    ck = load_checkpoint(path, kind, keep_int4=False, cache_dir=paths.cache_dir())
    return ck.embed.float(), ck.cfg, ChatTokenizer(path, paths.cache_dir())


def project_embedding(embed: torch.Tensor, hidden: int, gen: torch.Generator) -> torch.Tensor:
    """The target's embedding in `hidden` dimensions: its top principal directions when smaller,
    zero-padded with small noise when larger."""
    v, d = embed.shape
    if hidden == d:
        return embed.clone()
    if hidden > d:
        extra = torch.randn(v, hidden - d, generator=gen) * embed.std() * 0.1
        return torch.cat([embed, extra], dim=1)
    _, vecs = torch.linalg.eigh(embed.T.double() @ embed.double())  # ascending eigenvalues
    basis = vecs[:, -hidden:].flip(1).float()
    return embed @ basis


def draft_config(shape: DraftShape, tcfg, tokenizer):
    from transformers import LlamaConfig

    if not shape.recurrent and (shape.hidden % shape.heads or shape.heads % shape.kv_heads):
        raise BackendError(f"hidden {shape.hidden} must divide by heads {shape.heads}, and heads by kv-heads "
                           f"{shape.kv_heads}")
    eos = sorted(tokenizer.eos_ids)
    if shape.recurrent:
        from transformers import Qwen3_5TextConfig

        lh, d = shape.linear_heads, shape.linear_head_dim
        return Qwen3_5TextConfig(vocab_size=tcfg.vocab_size, hidden_size=shape.hidden, intermediate_size=shape.ffn,
                                 num_hidden_layers=shape.layers, layer_types=["linear_attention"] * shape.layers,
                                 linear_num_key_heads=lh, linear_num_value_heads=2 * lh, linear_key_head_dim=d,
                                 linear_value_head_dim=d, linear_conv_kernel_dim=4,
                                 num_attention_heads=1, num_key_value_heads=1, head_dim=d,  # no attention layer
                                 max_position_embeddings=tcfg.max_position, rms_norm_eps=tcfg.norm_eps,
                                 tie_word_embeddings=True, bos_token_id=tokenizer.hf.bos_token_id,
                                 eos_token_id=eos[0] if len(eos) == 1 else eos)
    return LlamaConfig(vocab_size=tcfg.vocab_size, hidden_size=shape.hidden, intermediate_size=shape.ffn,
                       num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                       num_key_value_heads=shape.kv_heads, head_dim=shape.hidden // shape.heads,
                       max_position_embeddings=tcfg.max_position, rms_norm_eps=tcfg.norm_eps,
                       rope_theta=tcfg.rope_theta, tie_word_embeddings=True,
                       bos_token_id=tokenizer.hf.bos_token_id, eos_token_id=eos[0] if len(eos) == 1 else eos)


# ---- data ----

def collate(batch: list[Example]):
    """Right-padded ids [B, T] and, per reply position, (row, column of the hidden state that predicts
    it, top-k ids, top-k log-probs, target token)."""
    t = max(len(e.tokens) for e in batch)
    ids = torch.zeros(len(batch), t, dtype=torch.long)
    rows, cols = [], []
    for b, e in enumerate(batch):
        ids[b, :len(e.tokens)] = e.tokens
        r = len(e.tokens) - e.prompt_len
        rows.append(torch.full((r,), b, dtype=torch.long))
        cols.append(torch.arange(e.prompt_len - 1, len(e.tokens) - 1))
    rows_t, cols_t = torch.cat(rows), torch.cat(cols)
    targets = ids[rows_t, cols_t + 1]
    return (ids, rows_t, cols_t, torch.cat([e.topk_ids for e in batch]), torch.cat([e.topk_logp for e in batch]),
            targets)


# ---- loss ----

def losses(model, batch, cfg: DraftTrainConfig):
    ids, rows, cols, top_ids, top_logp, targets = batch
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[rows, cols]  # [N, H] at reply positions
    logq = torch.log_softmax(F.linear(hidden, model.get_input_embeddings().weight).float(), dim=-1)
    p = torch.softmax(top_logp, dim=-1)  # the target's top-k, renormalised
    kl = (p * (torch.log(p.clamp_min(1e-12)) - logq.gather(1, top_ids))).sum(-1).mean()
    ce = F.nll_loss(logq, targets)
    agree = (logq.argmax(-1) == targets).float().mean()
    return cfg.kl_weight * kl + cfg.ce_weight * ce, kl, ce, agree


def evaluate(model, examples: list[Example], cfg: DraftTrainConfig) -> dict:
    """Held-out KL, CE and top-1 agreement with the target's token (greedy per-token acceptance),
    teacher-forced on the target's replies."""
    if not examples:
        return {}
    tot = {"kl": 0.0, "ce": 0.0, "agree": 0.0}
    n = 0
    for i in range(0, len(examples), 8):
        b = collate(examples[i:i + 8])
        k = len(b[5])
        _, kl, ce, agree = losses(model, b, cfg)
        for name, v in (("kl", kl), ("ce", ce), ("agree", agree)):
            tot[name] += float(v) * k
        n += k
    return {f"eval_{k}": v / n for k, v in tot.items()} | {"eval_positions": n}


# ---- training ----

def retrain_command(profile, data: list[Path], out: Path, shape: DraftShape, cfg: DraftTrainConfig) -> str:
    """The one shell command that makes this drafter again from scratch: data, then training."""
    layers = (f"--linear-heads {shape.linear_heads} --linear-head-dim {shape.linear_head_dim}" if shape.recurrent
              else f"--heads {shape.heads} --kv-heads {shape.kv_heads}")
    return full_command(profile, data, f"specchat train {shape.command} "
                        f"--data {' '.join(map(str, data))} "
                        f"--target {profile.name} --out {out} --layers {shape.layers} --hidden {shape.hidden} "
                        f"{layers} --ffn {shape.ffn} {flags_of(cfg)}"
                        + (" --freeze-embedding" if cfg.freeze_embedding else ""))


def train_draft(profile, data: list[Path], out: Path, shape: DraftShape, cfg: DraftTrainConfig, say=print) -> dict:
    from transformers import AutoModelForCausalLM

    loop.start(cfg)
    data = [Path(d) for d in data]
    data_info = data_info_of(data)
    examples = load_examples(data, cfg.max_prompt_tokens)
    train_set, eval_set = split(examples, cfg.holdout, cfg.seed)
    if not train_set:
        raise BackendError(f"{data[0]}: too few samples to train on ({len(examples)})")
    embed, tcfg, tokenizer = target_parts(profile)
    if max(int(e.tokens.max()) for e in examples) >= embed.shape[0]:
        raise BackendError(f"{data[0]}: token ids beyond the target's vocabulary; was it made with another target?")
    settings = {"shape": asdict(shape), "train": cfg.settings(), "data": [str(d) for d in data],
                "target": profile.name, "samples": len(examples)}

    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(draft_config(shape, tcfg, tokenizer)).float()
    with torch.no_grad():
        emb = project_embedding(embed, shape.hidden, gen)
        model.get_input_embeddings().weight.copy_(emb)
        # logits of the target's order of magnitude (a unit norm gives huge ones; a near-uniform start
        # makes Adam spend hundreds of steps growing the norm); Qwen3.5's norms scale by 1 + w
        model.model.norm.weight.fill_(2.0 / (emb.std().item() * shape.hidden ** 0.5) - float(shape.recurrent))
    del embed
    model.get_input_embeddings().weight.requires_grad_(not cfg.freeze_embedding)
    state = loop.TrainState(out, settings)
    plan = schedule(len(train_set), [len(e.tokens) for e in train_set], cfg.batch_tokens, cfg.seed, cfg.steps)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"draft model ({shape.kind}): {shape.layers} layers, hidden {shape.hidden}, {n_params / 1e6:.1f}M parameters; "
        f"{len(train_set)} training / {len(eval_set)} held-out samples")

    def step_loss(step: int) -> dict:
        loss, kl, ce, agree = losses(model, collate([train_set[i] for i in plan[step]]), cfg)
        return {"loss": loss, "kl": kl, "ce": ce, "agree": agree}

    last, wall, finished = loop.run(model, cfg, state, step_loss, lambda: evaluate(model, eval_set, cfg),
                                    "training drafter", say)
    if not finished:
        return last
    export(model, tokenizer, out)
    write_card(out, profile, data_info, settings, shape, cfg, last, n_params, wall, len(train_set), len(eval_set),
               retrain_command(profile, data, out, shape, cfg))
    say(f"wrote {out} ({wall:.0f}s of training; held-out top-1 agreement {last.get('eval_agree', float('nan')):.3f})")
    return last


def export(model, tokenizer, out: Path) -> None:
    """config.json, bfloat16 model.safetensors, tokenizer files, generation_config.json."""
    from safetensors.torch import save_file

    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
          if k != "lm_head.weight"}  # tied: the head is the embedding
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg["dtype"] = "bfloat16"
    cfg["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    tokenizer.hf.save_pretrained(str(out))
    eos = sorted(tokenizer.eos_ids)
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tokenizer.hf.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos}, indent=2))


RECURRENT_NOTE = """ Every layer is a Gated DeltaNet (Qwen3.5's linear attention) with a fixed-size
state: its cost per drafted token does not grow with the context. In a speculative run
(`method: replayssm`) its state is rolled back to the accepted prefix by replay."""


def layer_shape(shape: DraftShape) -> str:
    if shape.recurrent:
        return (f"{shape.linear_heads} key / {2 * shape.linear_heads} value heads of {shape.linear_head_dim}, "
                "4-tap convolution")
    return f"{shape.heads} heads ({shape.kv_heads} KV)"


def write_card(out: Path, profile, data_info: dict, settings: dict, shape: DraftShape, cfg: DraftTrainConfig,
               last: dict, n_params: int, wall: float, n_train: int, n_eval: int, command: str) -> None:
    size_mb = (out / "model.safetensors").stat().st_size / 1e6
    text = f"""# Draft model for `{profile.name}` ({profile.model})

A small {shape.kind} draft model for lossless speculative decoding in specchat, with the
target's own tokenizer. Trained by `specchat train {shape.command}` (distillation) on replies the
target itself wrote with `specchat train data`.{RECURRENT_NOTE if shape.recurrent else ""}

| | |
|---|---|
| shape | {shape.layers} layer(s), hidden {shape.hidden}, {layer_shape(shape)}, FFN {shape.ffn}, tied embedding |
| parameters | {n_params / 1e6:.2f} M ({size_mb:.1f} MB as bfloat16 safetensors) |
| embedding | {"frozen: " if cfg.freeze_embedding else "trained, initialised from "}the target's embedding, dequantized by the engine's loader{", projected onto its top " + str(shape.hidden) + " principal directions" if shape.hidden < 576 else ""} |
| data | {n_train} training + {n_eval} held-out replies by the target to prompts from {prompt_sources(data_info)}; greedy={data_info.get('temperature', 0) == 0}, max {data_info.get('max_tokens', '?')} tokens, top-{data_info.get('top_k', '?')} log-probs kept |
| loss | {cfg.kl_weight} x KL(target top-k || draft) + {cfg.ce_weight} x CE on the target's tokens |
| optimiser | AdamW (0.9, 0.95), lr {cfg.lr} warmup {cfg.warmup:.0%} then cosine to 10%, grad-clip 1.0, ~{cfg.batch_tokens} tokens/step |
| steps | {last.get('step', cfg.steps)} |
| seed | {cfg.seed} (deterministic on CPU: `torch.use_deterministic_algorithms(True)`, fixed data order) |
| training wall time | {wall:.0f} s on {platform.machine()} CPU, {torch.get_num_threads()} thread(s) (data generation not included) |
| held-out (teacher-forced) | top-1 agreement with the target {last.get('eval_agree', float('nan')):.3f}, KL {last.get('eval_kl', float('nan')):.3f}, CE {last.get('eval_ce', float('nan')):.3f} |

Spec-Bench was never used for training (it is refused by `specchat train data`); it is evaluation only.

## Re-train

```
{command}
```

The training log (loss, agreement, held-out figures per step) is in `{loop.LOG}`.
"""
    (out / "README.md").write_text(text)
    (out / "training.json").write_text(json.dumps(settings | {"wall_s": round(wall, 1), "final": last}, indent=1))
