"""`specchat train eagle3`: an EAGLE-3 head trained on the target's own states, with the
training-time test of the EAGLE-3 paper, exported in SpecForge's layout (LlamaForCausalLMEagle3),
which vLLM and SGLang load as it is and specchat reads like any public head.

- Features: one teacher-forced pass of the target over every training sequence (prompt + the
  target's reply, from `specchat train data`) at the profile's precision: the inputs of the tapped
  layers (the published low / middle / high by default) and the target's distribution for every
  next token. Cached in OUT/.train; never stored in the repository.
- Head: backends/native/eagle3.py's math (tested equal), batched and trainable: `fc` fuses the taps,
  one decoder layer (attention over [input_layernorm(embedding), hidden_norm(features)], residual
  from the features) initialised from the target's last layer, `norm`, and an `lm_head` over a
  draft vocabulary of the target's most frequent choices (rows of the target's head to start).
  The embedding is the target's, frozen and not exported (servers share the target's).
- Training-time test: `ttt_steps` unrolled drafting steps; step s feeds step s-1's outputs back
  with the token s places further, attending to the real entries up to its anchor and to its own
  chain (as when drafting). The loss of step s is weighted `ttt_decay`**s: KL from the target's
  top-k (restricted to the draft vocabulary) plus cross-entropy on its choice.
"""
from __future__ import annotations

import json
import platform
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from specchat import paths
from specchat.backends.base import BackendError
from specchat.backends.native.config import ModelConfig
from specchat.backends.native.eagle3 import default_taps
from specchat.backends.native.layers import RMSNorm, decoder_layer, rope_inv_freq, rope_tables
from specchat.backends.native.linear import Linear
from specchat.backends.native.weights import build_layer, hf_layer, hf_names, layer_tensors
from specchat.loading import target_path
from specchat.train import loop
from specchat.train.card import data_info_of, full_command, prompt_sources
from specchat.train.examples import load_examples, schedule, split
from specchat.train.mtp import batched_attention, choose_draft_vocab, compute_features, kl_ce_agree
from specchat.train.settings import Eagle3TrainConfig, flags_of


class Eagle3TrainHead(nn.Module):
    """The head, batched: entries [B, T] with features f [B, T, H] and the embeddings of their
    next tokens; `unroll` runs the training-time test's steps."""

    def __init__(self, cfg: ModelConfig, layer: dict[str, torch.Tensor], hidden_norm: torch.Tensor, fc: torch.Tensor,
                 final_norm: torch.Tensor, lm_head: torch.Tensor):
        """`layer`: the decoder layer (short names; q, k, v take 2H inputs)."""
        super().__init__()
        eps = cfg.norm_eps
        self.cfg = cfg

        def own(t: torch.Tensor) -> torch.Tensor:
            return t.detach().float().clone()

        self.fc = Linear(own(fc))
        self.hidden_norm = RMSNorm(own(hidden_norm), eps)
        self.layer = decoder_layer(cfg, build_layer({k: own(v) for k, v in layer.items()}, torch.float32, False,
                                                    torch.device("cpu")))
        self.norm = RMSNorm(own(final_norm), eps)
        self.lm_head = Linear(own(lm_head))
        self.inv_freq = rope_inv_freq(cfg)
        self.requires_grad_(True)

    @classmethod
    def initial(cls, cfg: ModelConfig, last: dict[str, torch.Tensor], final_norm: torch.Tensor,
                lm_head: torch.Tensor, n_taps: int) -> "Eagle3TrainHead":
        """Where training starts: f is the mean of the taps; q, k and v read the sum of the two
        normalised halves through the target's last layer `last`; the head rows are the target's."""
        d = cfg.dim
        wide = {k: torch.cat([v, v], dim=1) if k in ("q", "k", "v") else v for k, v in last.items()}
        return cls(cfg, wide, last["attn_norm"], torch.cat([torch.eye(d)] * n_taps, dim=1) / n_taps, final_norm,
                   lm_head)

    @classmethod
    def from_export(cls, cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> "Eagle3TrainHead":
        """The head `state_for_export` wrote."""
        return cls(cfg, hf_layer(tensors, "midlayer."), tensors["midlayer.hidden_norm.weight"], tensors["fc.weight"],
                   tensors["norm.weight"], tensors["lm_head.weight"])

    def step(self, f: torch.Tensor, embeds: torch.Tensor, attend, cos, sin) -> torch.Tensor:
        h = self.hidden_norm(f)
        x = torch.cat([self.layer.attn_norm(embeds), h], -1)
        return self.layer.feed_forward(f + self.layer.attention(x, attend, cos, sin, torch.float32), torch.float32)

    def unroll(self, taps: torch.Tensor, embeds: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """taps [B, T, n*H]: the tapped states at entries 0..T-1; embeds [B, T + steps - 1, H]: the
        embeddings of x[1..]. Returns each step's outputs o_s [B, T, H] (before `norm`): step s at
        entry t guesses x[t+2+s], at rope position t+s."""
        B, T, _ = taps.shape
        cos, sin = rope_tables(self.inv_freq, T + steps)
        ks, vs, outs = [], [], []
        f = self.fc(taps)
        for s in range(steps):
            # the real entries t' <= t (step 0's keys), then each later step's own entry for anchor t
            mask = torch.cat([torch.ones(T, T).tril().bool()] + [torch.eye(T, dtype=torch.bool)] * s, 1)

            def attend(q, k, v):
                ks.append(k)
                vs.append(v)
                return batched_attention(q, torch.cat(ks, 1), torch.cat(vs, 1), mask)

            f = self.step(f, embeds[:, s:s + T], attend, cos[s:s + T], sin[s:s + T])
            outs.append(f)
        return outs

    def state_for_export(self) -> dict[str, torch.Tensor]:
        """SpecForge's names: midlayer.* (with hidden_norm), fc, norm, lm_head."""
        out = hf_names(layer_tensors(self.layer), "midlayer.")
        out |= {"midlayer.hidden_norm.weight": self.hidden_norm.weight, "fc.weight": self.fc.weight,
                "norm.weight": self.norm.weight, "lm_head.weight": self.lm_head.weight}
        return {k: v.detach() for k, v in out.items()}


def collate(seqs, embed: torch.Tensor, to_sub: torch.Tensor, taps: tuple[int, ...], steps: int):
    """Right-padded batches: the taps at every entry (tap 0 is the token's embedding), the
    embeddings of the next tokens (steps - 1 more at the end), a validity mask, top-k ids mapped
    into the draft vocabulary (-1: outside) and their log-probs."""
    T = max(len(s.hidden) for s in seqs)
    B, D, k = len(seqs), embed.shape[1], seqs[0].top_ids.shape[1]
    n = len(taps)
    feats = torch.zeros(B, T, n * D)
    nxt = torch.zeros(B, T + steps - 1, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    ids = torch.full((B, T, k), -1, dtype=torch.long)
    logp = torch.zeros(B, T, k)
    for b, s in enumerate(seqs):
        m = len(s.hidden)
        stored = s.hidden.float().view(m, -1, D)  # the taps past 0, in order
        parts, i = [], 0
        for j in taps:
            if j == 0:
                parts.append(embed[s.tokens[:m]])
            else:
                parts.append(stored[:, i])
                i += 1
        feats[b, :m] = torch.cat(parts, -1)
        nxt[b, :m] = s.tokens[1:m + 1]
        mask[b, :m] = True
        ids[b, :m] = to_sub[s.top_ids]
        logp[b, :m] = s.top_logp.float()
    return feats, embed[nxt], mask, ids, logp


def losses(model: Eagle3TrainHead, batch, cfg: Eagle3TrainConfig):
    """(loss, kl, ce, agreement at each step)."""
    feats, embeds, mask, ids, logp = batch
    T = mask.shape[1]
    total, kl0, ce0, agree = 0.0, None, None, []
    for s, o in enumerate(model.unroll(feats, embeds, cfg.ttt_steps)):
        # step s at entry t is labelled like entry t+s at step 0; valid while t+s is
        m = mask[:, s:] & mask[:, :T - s]
        kl, ce, a = kl_ce_agree(model.norm(o[:, :T - s][m]), model.lm_head.weight, ids[:, s:][m], logp[:, s:][m])
        total = total + cfg.ttt_decay ** s * (cfg.kl_weight * kl + cfg.ce_weight * ce)
        kl0, ce0 = (kl, ce) if s == 0 else (kl0, ce0)
        agree.append(a)
    return total, kl0, ce0, agree


def evaluate(model, seqs, embed, to_sub, taps, cfg) -> dict:
    if not seqs:
        return {}
    tot: dict[str, float] = {}
    n = 0
    for i in range(0, len(seqs), 8):
        b = collate(seqs[i:i + 8], embed, to_sub, taps, cfg.ttt_steps)
        k = int(b[2].sum())
        _, kl, ce, agree = losses(model, b, cfg)
        figures = {"kl": kl, "ce": ce} | {("agree" if s == 0 else f"agree{s + 1}"): a for s, a in enumerate(agree)}
        for name, v in figures.items():
            tot[name] = tot.get(name, 0.0) + float(v) * k
        n += k
    return {f"eval_{k}": v / n for k, v in tot.items()} | {"eval_entries": n}


def train_eagle3(profile, data: list[Path], out: Path, cfg: Eagle3TrainConfig, say=print) -> dict:
    from specchat.backends.native.engine import load_checkpoint
    from specchat.backends.native.int4 import Int4Rows

    if profile.backend != "torch":
        raise BackendError(f"profile '{profile.name}' uses backend '{profile.backend}'; EAGLE-3 training needs "
                           "the torch engine (backend: torch)")
    loop.start(cfg)
    data = [Path(d) for d in data]
    examples = load_examples(data, cfg.max_prompt_tokens)
    train_ex, eval_ex = split(examples, cfg.holdout, cfg.seed)
    if not train_ex:
        raise BackendError(f"{data[0]}: too few samples to train on ({len(examples)})")
    state_dir = out / loop.STATE_DIR
    state_dir.mkdir(parents=True, exist_ok=True)

    path, kind = target_path(profile)
    ck = load_checkpoint(path, kind, keep_int4=False, cache_dir=paths.cache_dir())
    tcfg: ModelConfig = ck.cfg
    if tcfg.hybrid or any(k in ck.layers[-1] for k in ("q_bias", "q_norm")):
        raise BackendError("train eagle3 supports Llama-style targets (no q/k/v biases, q/k norms or recurrent "
                           "layers) for now")
    if max(int(e.tokens.max()) for e in examples) >= tcfg.vocab_size:
        raise BackendError(f"{data[0]}: token ids beyond the target's vocabulary; was it made with another target?")
    taps = tuple(cfg.taps or default_taps(tcfg.n_layers))
    if not any(taps) or any(not 0 <= j < tcfg.n_layers for j in taps):
        raise BackendError(f"--taps {' '.join(map(str, taps))}: each must be 0..{tcfg.n_layers - 1} (the input of "
                           "that target layer), one past the embedding")
    dense = lambda m: m.dequantize() if isinstance(m, Int4Rows) else m.float()  # noqa: E731
    last = {k: dense(v) for k, v in ck.layers[-1].items()
            if k in ("q", "k", "v", "o", "gate", "up", "down", "attn_norm", "mlp_norm")}
    embed = ck.embed.float()
    head_full = dense(ck.head) if ck.head is not None else embed
    final_norm = ck.norm.float()
    del ck

    layers = tuple(j - 1 for j in taps if j > 0)
    features = compute_features(profile, examples, layers, cfg.top_k, state_dir, say, cfg.threads)
    by_id = dict(zip((e.id for e in examples), features))
    train_seqs, eval_seqs = [by_id[e.id] for e in train_ex], [by_id[e.id] for e in eval_ex]
    vocab = choose_draft_vocab(train_seqs, cfg.draft_vocab, tcfg.vocab_size)
    if vocab is None:
        vocab = torch.arange(tcfg.vocab_size)
    to_sub = torch.full((tcfg.vocab_size,), -1, dtype=torch.long)
    to_sub[vocab] = torch.arange(len(vocab))
    coverage = float((to_sub[torch.cat([s.top_ids[:, 0] for s in eval_seqs or train_seqs])] >= 0).float().mean())
    say(f"draft vocabulary: {len(vocab)} tokens, covering {coverage:.1%} of the target's held-out choices")

    torch.manual_seed(cfg.seed)
    model = Eagle3TrainHead.initial(tcfg, last, final_norm, head_full[vocab], len(taps))
    settings = {"train": cfg.settings(), "data": [str(d) for d in data], "target": profile.name,
                "samples": len(examples), "taps": list(taps)}
    state = loop.TrainState(out, settings)
    plan = schedule(len(train_seqs), [len(s.hidden) for s in train_seqs], cfg.batch_tokens, cfg.seed, cfg.steps)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"EAGLE-3 head: {n_params / 1e6:.1f}M parameters, taps {list(taps)}, {cfg.ttt_steps} training-time-test "
        f"steps; {len(train_seqs)} training / {len(eval_seqs)} held-out sequences")

    def held_out() -> dict:
        return evaluate(model, eval_seqs, embed, to_sub, taps, cfg)

    if state.saved is None and eval_seqs:
        say(f"before training: held-out top-1 agreement {loop.evaluated(model, held_out)['eval_agree']:.3f}")

    def step_loss(step: int) -> dict:
        batch = collate([train_seqs[i] for i in plan[step]], embed, to_sub, taps, cfg.ttt_steps)
        loss, kl, ce, agree = losses(model, batch, cfg)
        return {"loss": loss, "kl": kl, "ce": ce, "agree": agree[0]}

    rec, wall, finished = loop.run(model, cfg, state, step_loss, held_out, "training EAGLE-3 head", say)
    if not finished:
        return rec
    export(model, tcfg, vocab, taps, out)
    write_card(out, profile, data, cfg, rec, n_params, wall, len(train_seqs), len(eval_seqs), coverage, len(vocab),
               taps)
    say(f"wrote {out} ({wall:.0f}s of training; held-out top-1 agreement {rec.get('eval_agree', float('nan')):.3f})")
    return rec


def export(model: Eagle3TrainHead, tcfg: ModelConfig, vocab: torch.Tensor, taps: tuple[int, ...], out: Path) -> None:
    """SpecForge's LlamaForCausalLMEagle3 layout: d2t as offsets (target id = i + d2t[i]), t2d as
    the target vocabulary's mask."""
    from safetensors.torch import save_file

    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_for_export().items()}
    t2d = torch.zeros(tcfg.vocab_size, dtype=torch.bool)
    t2d[vocab] = True
    sd |= {"d2t": (vocab - torch.arange(len(vocab))).to(torch.int64).contiguous(), "t2d": t2d}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": tcfg.dim,
              "num_hidden_layers": 1, "num_attention_heads": tcfg.n_heads, "num_key_value_heads": tcfg.n_kv_heads,
              "head_dim": tcfg.head_dim, "intermediate_size": tcfg.ffn_dim, "rms_norm_eps": tcfg.norm_eps,
              "rope_theta": tcfg.rope_theta, "max_position_embeddings": tcfg.max_position,
              "vocab_size": tcfg.vocab_size, "draft_vocab_size": len(vocab), "hidden_act": "silu",
              "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              # vLLM reads the top-level ids as layer inputs; SpecForge / SGLang the nested ones as
              # layer outputs (one less, so a tap 0, the embedding, has none)
              "eagle_aux_hidden_state_layer_ids": list(taps)}
    if min(taps) > 0:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [j - 1 for j in taps]}
    (out / "config.json").write_text(json.dumps(config, indent=2))


def retrain_command(profile, data: list[Path], out: Path, cfg: Eagle3TrainConfig, taps) -> str:
    return full_command(profile, data, f"specchat train eagle3 --data {' '.join(map(str, data))} --target "
                        f"{profile.name} --out {out} --top-k {cfg.top_k} --draft-vocab {cfg.draft_vocab} --taps "
                        f"{' '.join(map(str, taps))} --ttt-steps {cfg.ttt_steps} --ttt-decay {cfg.ttt_decay} "
                        f"{flags_of(cfg)}")


def write_card(out: Path, profile, data, cfg, rec, n_params, wall, n_train, n_eval, coverage, n_vocab, taps) -> None:
    info = data_info_of(data)
    size_mb = (out / "model.safetensors").stat().st_size / 1e6
    deeper = ", ".join(f"{rec.get(f'eval_agree{s + 1}', float('nan')):.3f} at step {s + 1}"
                       for s in range(1, cfg.ttt_steps))
    text = f"""# EAGLE-3 head for `{profile.name}` ({profile.model})

An EAGLE-3 draft head for lossless speculative decoding: it fuses the inputs of target layers
{list(taps)} with `fc`, runs one decoder layer over [the next token's embedding, the fused
features] and proposes from a draft vocabulary; deeper drafts feed its own output back. Trained by
`specchat train eagle3` on the target's own states, with the training-time test. Layout:
SpecForge's `LlamaForCausalLMEagle3` (vLLM and SGLang load it; the embedding is the target's).

| | |
|---|---|
| shape | fc ({len(taps)}H -> H) + 1 Llama decoder layer (attention input 2H), initialised from the target's last layer |
| parameters | {n_params / 1e6:.2f} M ({size_mb:.1f} MB as bfloat16 safetensors) |
| draft vocabulary | {n_vocab} tokens (the target's most frequent choices), covering {coverage:.1%} of its held-out choices |
| data | {n_train} training + {n_eval} held-out sequences (prompt + the target's reply) to prompts from {prompt_sources(info)}; greedy={info.get('temperature', 0) == 0}, max {info.get('max_tokens', '?')} reply tokens |
| labels | the target's distribution for each guessed token (top-{cfg.top_k}), from the teacher-forced pass that gives the taps |
| loss | per training-time-test step s (of {cfg.ttt_steps}), weight {cfg.ttt_decay}^s: {cfg.kl_weight} x KL(target top-k restricted to the draft vocabulary || head) + {cfg.ce_weight} x CE on the target's choice |
| optimiser | AdamW (0.9, 0.95), lr {cfg.lr} warmup {cfg.warmup:.0%} then cosine to 10%, grad-clip 1.0, ~{cfg.batch_tokens} entries/step |
| steps | {rec.get('step', cfg.steps)} |
| seed | {cfg.seed} (deterministic on CPU) |
| training wall time | {wall:.0f} s on {platform.machine()} CPU, {torch.get_num_threads()} thread(s) (data and target states not included) |
| held-out (teacher-forced) | top-1 agreement with the target {rec.get('eval_agree', float('nan')):.3f} at step 1 (the expected first-position acceptance under greedy decoding){', ' + deeper if deeper else ''}; KL {rec.get('eval_kl', float('nan')):.3f} |

Spec-Bench was never used for training; it is evaluation only.

## Re-train

```
{retrain_command(profile, data, out, cfg, taps)}
```

The training log is in `{loop.LOG}`.
"""
    (out / "README.md").write_text(text)
    (out / "training.json").write_text(json.dumps(
        {"settings": asdict(cfg), "data": [str(d) for d in data], "wall_s": round(wall, 1), "final": rec,
         "draft_vocab": n_vocab, "coverage": coverage, "taps": list(taps)}, indent=1, default=str))
