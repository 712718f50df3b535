"""`specchat train mtp`: an MTP head for a target that ships none, trained on the target's own states.

- Features: one teacher-forced pass of the target (the engine, at the profile's precision, i.e.
  exactly the states the head will see when drafting) over every training sequence (prompt +
  the target's reply, from `specchat train data`). Entry t of a sequence is (h[t], x[t+1]); its
  label is the target's distribution for x[t+2], from the same pass. Cached in OUT/.train.
- Head: one decoder layer of the target's shape, initialised from the target's last layer;
  `u = eh_proj([enorm(embed(x[t+1])), hnorm(h[t])])`, `g = norm(layer(u))`, logits = target head.
  The embedding and head are the target's, frozen.
- Draft vocabulary: the head may propose only the N tokens the target emits most often in the
  training data (a smaller head matmul per drafted token; lossless, since the target verifies).
- Loss: KL from the target's top-k distribution (restricted to the draft vocabulary) plus
  cross-entropy on the target's own choice. Deterministic and resumable like `train draft`.
- Output: the DeepSeek-V3 layout (`model.layers.{N}.{enorm,hnorm,eh_proj,shared_head.norm}` plus the
  decoder layer), so `read_mtp` loads it like a public checkpoint's head.
"""
from __future__ import annotations

import hashlib
import json
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specchat import paths
from specchat.backends.base import BackendError
from specchat.backends.weight_files import BrokenWeightFile, load_safetensors
from specchat.backends.native.config import ModelConfig
from specchat.backends.native.layers import RMSNorm, decoder_layer, rope_inv_freq, rope_tables
from specchat.backends.native.linear import Linear
from specchat.backends.native.model import FINAL
from specchat.backends.native.mtp import DRAFT_VOCAB
from specchat.backends.native.weights import build_layer, hf_layer, hf_names, layer_tensors
from specchat.loading import target_path
from specchat.train import loop
from specchat.train.settings import MtpTrainConfig, flags_of
from specchat.train.card import data_info_of, full_command, prompt_sources
from specchat.train.examples import load_examples, schedule, split
from specchat.train.progress import bar


@dataclass
class Entries:
    tokens: torch.Tensor  # [T] long
    hidden: torch.Tensor  # [T-1, D * layers] float16: h[t] for entries t = 0..T-2
    top_ids: torch.Tensor  # [T-1, k] long: the target's top-k for x[t+2]
    top_logp: torch.Tensor  # [T-1, k] float16


# ---- features ----

def compute_features(profile, examples, layers: tuple[int, ...], top_k: int, cache: Path,
                     say=print, threads: int = 0) -> list[Entries]:
    """The target's states at `layers` (model.forward's keys, concatenated in that order) and its
    next-token distributions over every sequence (cached on disk), on the run's `threads` (0: every
    core), so that a run given fewer threads leaves the other cores alone throughout."""
    from safetensors.torch import save_file

    from specchat.loading import load_target

    key = hashlib.sha256(json.dumps([profile.model, profile.dtype, list(layers), top_k,
                                     [e.id for e in examples], [int(e.tokens.sum()) for e in examples]]).encode())
    path = cache / f"features-{key.hexdigest()[:16]}.safetensors"
    try:
        st = load_safetensors(path) if path.exists() else None
    except BrokenWeightFile:  # cut short (a disk that filled up): made again
        st = None
    if st is not None:
        return [Entries(e.tokens, st[f"{i}.h"], st[f"{i}.ids"].long(), st[f"{i}.logp"])
                for i, e in enumerate(examples)]
    engine = load_target(profile, threads=threads, context=max(len(e.tokens) for e in examples) + 1)
    head = engine.model.head.weight if engine.model.head.weight is not None else engine.model.embed
    out, tensors = [], {}
    started = time.perf_counter()
    try:
        with bar("target states", len(examples)) as update:
            for i, e in enumerate(examples):
                _, hidden = engine.forward(e.tokens.tolist(), 0, tuple(layers) + (FINAL,), all_logits=False)
                logits = F.linear(hidden[FINAL][1:].to(head.dtype), head)  # one GEMM for every row
                logp = torch.log_softmax(logits.float(), dim=-1)
                v, ids = logp.topk(top_k, dim=-1)
                h = torch.cat([hidden[j][:-1] for j in layers], -1)
                s = Entries(e.tokens, h.to(torch.float16), ids, v.to(torch.float16))
                out.append(s)
                tensors |= {f"{i}.h": s.hidden.contiguous(), f"{i}.ids": ids.to(torch.int32).contiguous(),
                            f"{i}.logp": s.top_logp.contiguous()}
                update()
    finally:
        engine.close()
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(path)
    say(f"target states for {len(examples)} sequences in {time.perf_counter() - started:.0f}s")
    return out


def choose_draft_vocab(seqs: list[Entries], size: int, vocab_size: int) -> torch.Tensor | None:
    """The `size` tokens the target picks most often (its top-1 over the training entries)."""
    if not size or size >= vocab_size:
        return None
    counts = torch.bincount(torch.cat([s.top_ids[:, 0] for s in seqs]), minlength=vocab_size)
    return counts.argsort(descending=True, stable=True)[:size].sort().values


# ---- the head, in training form ----

class MtpTrainHead(nn.Module):
    """The math of backends.native.mtp.MtpHead (tested equal) on the same layers, batched and
    trainable: u = eh_proj([enorm(e), hnorm(h)]), g = norm(layer(u))."""

    def __init__(self, cfg: ModelConfig, layer: dict[str, torch.Tensor], final_norm: torch.Tensor,
                 exported: dict[str, torch.Tensor] | None = None):
        """`layer`: the decoder layer to start from (short names, e.g. the target's last layer);
        `exported`: enorm, hnorm, eh_proj as `state_for_export` names them (default: e + h)."""
        super().__init__()
        d, eps = cfg.dim, cfg.norm_eps
        self.cfg = cfg
        ex = exported or {}
        self.enorm = RMSNorm(ex.get("enorm", torch.ones(d)).float().clone(), eps)
        self.hnorm = RMSNorm(ex.get("hnorm", torch.ones(d)).float().clone(), eps)
        self.eh_proj = Linear(ex.get("eh_proj", torch.cat([torch.eye(d), torch.eye(d)], dim=1)).float().clone())
        self.layer = decoder_layer(cfg, build_layer({k: v.detach().float().clone() for k, v in layer.items()},
                                                    torch.float32, False, torch.device("cpu")))
        self.norm = RMSNorm(final_norm.detach().float().clone(), eps)
        self.inv_freq = rope_inv_freq(cfg)
        self.requires_grad_(True)

    @classmethod
    def from_export(cls, cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> "MtpTrainHead":
        """The head `state_for_export` wrote (a DeepSeek-layout head for a target of cfg.n_layers layers)."""
        p = f"model.layers.{cfg.n_layers}."
        return cls(cfg, hf_layer(tensors, p), tensors[p + "shared_head.norm.weight"],
                   {k: tensors[p + f"{k}.weight"] for k in ("enorm", "hnorm", "eh_proj")})

    def forward(self, hidden: torch.Tensor, next_embed: torch.Tensor,
                deeper_embed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden, next_embed [B, T, D] -> g [B, T, D]; entry t attends to entries 0..t.

        With deeper_embed [B, T-1, D] (the embeddings of x[t+2]) also the second drafting step:
        the head's own g[t] fed back with x[t+2] at entry t+1, attending to the real entries 0..t
        and itself, exactly as when drafting at depth 2. Returns (g, g2 [B, T-1, D] or None)."""
        B, T, _ = hidden.shape
        cos, sin = rope_tables(self.inv_freq, T)
        real: dict[str, torch.Tensor] = {}

        def causal(q, k, v):  # [B, T, heads, hd]
            real["k"], real["v"] = k, v
            return batched_attention(q, k, v, None)

        g = self.norm(self.layer(self._project(hidden, next_embed), causal, cos, sin, torch.float32))
        if deeper_embed is None:
            return g, None
        sees_real = torch.arange(T)[None, :] <= torch.arange(T - 1)[:, None]  # entry t+1 sees real entries 0..t
        mask = torch.cat([sees_real, torch.eye(T - 1, dtype=torch.bool)], 1)  # ... and itself

        def after_real(q, k, v):
            return batched_attention(q, torch.cat([real["k"], k], 1), torch.cat([real["v"], v], 1), mask)

        g2 = self.norm(self.layer(self._project(g[:, :-1], deeper_embed), after_real, cos[1:], sin[1:], torch.float32))
        return g, g2

    def _project(self, hidden: torch.Tensor, next_embed: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.enorm(next_embed), self.hnorm(hidden)], -1))

    def state_for_export(self, n_layers: int) -> dict[str, torch.Tensor]:
        """Tensors in the DeepSeek-V3 MTP layout for a target of `n_layers` layers."""
        p = f"model.layers.{n_layers}."
        out = hf_names(layer_tensors(self.layer), p)
        out |= {p + "enorm.weight": self.enorm.weight, p + "hnorm.weight": self.hnorm.weight,
                p + "eh_proj.weight": self.eh_proj.weight, p + "shared_head.norm.weight": self.norm.weight}
        return {k: v.detach() for k, v in out.items()}


def batched_attention(q, k, v, mask):
    """q [B, T, H, hd] over k, v [B, S, Hkv, hd] (mask None: causal) -> [B, T, H * hd]."""
    B, T, H, hd = q.shape
    a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                       is_causal=mask is None, enable_gqa=H != k.shape[2])
    return a.transpose(1, 2).reshape(B, T, H * hd)


# ---- batches and loss ----

def collate(seqs: list[Entries], embed: torch.Tensor, to_sub: torch.Tensor):
    """Right-padded [B, T] batches of entries; padding sits after each sequence, so causal
    attention never lets a real entry see it. Returns hidden, next-token embeddings, a validity
    mask, top-k ids mapped into the draft vocabulary (-1: outside) and their log-probs."""
    T = max(len(s.hidden) for s in seqs)
    B, D, k = len(seqs), embed.shape[1], seqs[0].top_ids.shape[1]
    hidden = torch.zeros(B, T, D)
    nxt = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    ids = torch.full((B, T, k), -1, dtype=torch.long)
    logp = torch.zeros(B, T, k)
    for b, s in enumerate(seqs):
        n = len(s.hidden)
        hidden[b, :n] = s.hidden.float()
        nxt[b, :n] = s.tokens[1:n + 1]
        mask[b, :n] = True
        ids[b, :n] = to_sub[s.top_ids]
        logp[b, :n] = s.top_logp.float()
    return hidden, embed[nxt], mask, ids, logp


def kl_ce_agree(g, head_w, ids, logp):
    logq = torch.log_softmax(g @ head_w.T, dim=-1)  # over the draft vocabulary
    valid = ids >= 0
    p = torch.softmax(logp.masked_fill(~valid, float("-inf")), dim=-1)
    has = valid.any(-1)  # entries whose target top-k meets the draft vocabulary at all
    lq = logq.gather(1, ids.clamp_min(0))
    kl = torch.where(valid, p * (torch.log(p.clamp_min(1e-12)) - lq), 0.0).sum(-1)[has].mean()
    ce = -lq[:, 0][valid[:, 0]].mean()
    agree = (logq.argmax(-1) == ids[:, 0]).float().mean()  # top-1 equals the target's (greedy acceptance)
    return kl, ce, agree


def losses(model: MtpTrainHead, head_w: torch.Tensor, batch, cfg: MtpTrainConfig):
    """(loss, kl, ce, agreement at depth 1, agreement at depth 2 or None)."""
    hidden, nxt, mask, ids, logp = batch
    deeper = nxt[:, 1:] if cfg.depth2_weight else None
    g, g2 = model(hidden, nxt, deeper)
    kl, ce, agree = kl_ce_agree(g[mask], head_w, ids[mask], logp[mask])
    loss = cfg.kl_weight * kl + cfg.ce_weight * ce
    agree2 = None
    if g2 is not None:
        m2 = mask[:, 1:]  # entry t at depth 2 is labelled like entry t+1 at depth 1
        kl2, ce2, agree2 = kl_ce_agree(g2[m2], head_w, ids[:, 1:][m2], logp[:, 1:][m2])
        loss = loss + cfg.depth2_weight * (cfg.kl_weight * kl2 + cfg.ce_weight * ce2)
    return loss, kl, ce, agree, agree2


def evaluate(model, head_w, seqs, embed, to_sub, cfg) -> dict:
    if not seqs:
        return {}
    tot, n = {"kl": 0.0, "ce": 0.0, "agree": 0.0, "agree2": 0.0}, 0
    for i in range(0, len(seqs), 8):
        b = collate(seqs[i:i + 8], embed, to_sub)
        k = int(b[2].sum())
        _, kl, ce, agree, agree2 = losses(model, head_w, b, cfg)
        for name, v in (("kl", kl), ("ce", ce), ("agree", agree), ("agree2", agree2)):
            tot[name] += float(v if v is not None else float("nan")) * k
        n += k
    return {f"eval_{k}": v / n for k, v in tot.items()} | {"eval_entries": n}


# ---- training ----

def train_mtp(profile, data: list[Path], out: Path, cfg: MtpTrainConfig, say=print) -> dict:
    from specchat.backends.native.engine import load_checkpoint
    from specchat.backends.native.int4 import Int4Rows

    if profile.backend != "torch":
        raise BackendError(f"profile '{profile.name}' uses backend '{profile.backend}'; MTP training needs the "
                           "torch engine (backend: torch)")
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
    if max(int(e.tokens.max()) for e in examples) >= tcfg.vocab_size:
        raise BackendError(f"{data[0]}: token ids beyond the target's vocabulary; was it made with another target?")
    dense = lambda m: m.dequantize() if isinstance(m, Int4Rows) else m.float()  # noqa: E731
    last = {k: dense(v) for k, v in ck.layers[-1].items()
            if k in ("q", "k", "v", "o", "gate", "up", "down", "attn_norm", "mlp_norm")}
    if "experts" in ck.layers[-1]:
        raise BackendError("train mtp starts its head from the target's last layer, and this target's is routed "
                           "experts; use the checkpoint's own MTP head (method: mtp with no drafter) or an EAGLE-3 head")
    if any(k in ck.layers[-1] for k in ("q_bias", "q_norm")):
        raise BackendError("train mtp supports Llama-style targets (no q/k/v biases or q/k norms) for now")
    embed = ck.embed.float()
    head_full = dense(ck.head) if ck.head is not None else embed
    final_norm = ck.norm.float()
    del ck

    # computed (and cached) in load order, so another hold-out split reuses them
    layer = FINAL if cfg.hidden_source == "post_norm" else tcfg.n_layers - 1
    by_id = dict(zip((e.id for e in examples), compute_features(profile, examples, (layer,), cfg.top_k, state_dir,
                                                                say, cfg.threads)))
    train_seqs, eval_seqs = [by_id[e.id] for e in train_ex], [by_id[e.id] for e in eval_ex]
    vocab = choose_draft_vocab(train_seqs, cfg.draft_vocab, tcfg.vocab_size)
    to_sub = torch.arange(tcfg.vocab_size) if vocab is None else torch.full((tcfg.vocab_size,), -1, dtype=torch.long)
    if vocab is not None:
        to_sub[vocab] = torch.arange(len(vocab))
    head_w = head_full if vocab is None else head_full[vocab].contiguous()
    coverage = float((to_sub[torch.cat([s.top_ids[:, 0] for s in eval_seqs or train_seqs])] >= 0).float().mean())
    say(f"draft vocabulary: {len(head_w)} tokens, covering {coverage:.1%} of the target's held-out choices")

    torch.manual_seed(cfg.seed)
    model = MtpTrainHead(tcfg, last, final_norm)
    settings = {"train": cfg.settings(), "data": [str(d) for d in data], "target": profile.name,
                "samples": len(examples)}
    state = loop.TrainState(out, settings)
    plan = schedule(len(train_seqs), [len(s.hidden) for s in train_seqs], cfg.batch_tokens, cfg.seed, cfg.steps)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"MTP head: {n_params / 1e6:.1f}M parameters; {len(train_seqs)} training / {len(eval_seqs)} held-out "
        f"sequences ({sum(len(s.hidden) for s in train_seqs)} training entries)")

    def held_out() -> dict:
        return evaluate(model, head_w, eval_seqs, embed, to_sub, cfg)

    if state.saved is None and eval_seqs:
        say(f"before training: held-out top-1 agreement {loop.evaluated(model, held_out)['eval_agree']:.3f}")

    def step_loss(step: int) -> dict:
        batch = collate([train_seqs[i] for i in plan[step]], embed, to_sub)
        loss, kl, ce, agree, _ = losses(model, head_w, batch, cfg)
        return {"loss": loss, "kl": kl, "ce": ce, "agree": agree}

    rec, wall, finished = loop.run(model, cfg, state, step_loss, held_out, "training MTP head", say)
    if not finished:
        return rec
    export(model, tcfg, vocab, cfg, out, profile)
    write_card(out, profile, data, data_info_of(data), cfg, rec, n_params, wall, len(train_seqs), len(eval_seqs),
               coverage, len(head_w))
    say(f"wrote {out} ({wall:.0f}s of training; held-out top-1 agreement {rec.get('eval_agree', float('nan')):.3f})")
    return rec


def export(model: MtpTrainHead, tcfg: ModelConfig, vocab, cfg: MtpTrainConfig, out: Path, profile) -> None:
    from safetensors.torch import save_file

    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_for_export(tcfg.n_layers).items()}
    if vocab is not None:
        sd[DRAFT_VOCAB] = vocab.to(torch.int32).contiguous()
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["SpecchatMTPHead"], "model_type": "specchat_mtp", "hidden_size": tcfg.dim,
              "num_hidden_layers": tcfg.n_layers, "num_attention_heads": tcfg.n_heads,
              "num_key_value_heads": tcfg.n_kv_heads, "head_dim": tcfg.head_dim, "intermediate_size": tcfg.ffn_dim,
              "rms_norm_eps": tcfg.norm_eps, "rope_theta": tcfg.rope_theta, "vocab_size": tcfg.vocab_size,
              "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16",
              "specchat_mtp": {"hidden_source": cfg.hidden_source, "target": profile.model,
                               "draft_vocab": None if vocab is None else len(vocab)}}
    (out / "config.json").write_text(json.dumps(config, indent=2))


def retrain_command(profile, data: list[Path], out: Path, cfg: MtpTrainConfig) -> str:
    return full_command(profile, data, f"specchat train mtp --data {' '.join(map(str, data))} --target {profile.name} "
                        f"--out {out} --top-k {cfg.top_k} --draft-vocab {cfg.draft_vocab} --hidden-source "
                        f"{cfg.hidden_source} --depth2-weight {cfg.depth2_weight} {flags_of(cfg)}")


def write_card(out: Path, profile, data, info, cfg, rec, n_params, wall, n_train, n_eval, coverage, n_vocab) -> None:
    size_mb = (out / "model.safetensors").stat().st_size / 1e6
    text = f"""# MTP head for `{profile.name}` ({profile.model})

A multi-token-prediction head (one decoder layer of the target's shape, DeepSeek-V3 layout) for
lossless speculative decoding in specchat: from the target's {cfg.hidden_source.replace('_', '-')} final
hidden state at position t and the embedding of token t+1 it guesses token t+2, using the target's
own embedding and LM head. Trained by `specchat train mtp` on the target's own states.

| | |
|---|---|
| shape | eh_proj (2H -> H) + 1 Llama decoder layer, initialised from the target's last layer |
| parameters | {n_params / 1e6:.2f} M ({size_mb:.1f} MB as bfloat16 safetensors, with the draft vocabulary) |
| draft vocabulary | {n_vocab} tokens (the target's most frequent choices), covering {coverage:.1%} of its held-out choices |
| data | {n_train} training + {n_eval} held-out sequences (prompt + the target's reply) to prompts from {prompt_sources(info)}; greedy={info.get('temperature', 0) == 0}, max {info.get('max_tokens', '?')} reply tokens |
| labels | the target's distribution for token t+2 (top-{cfg.top_k}), from the same teacher-forced pass that gives the hidden states |
| loss | {cfg.kl_weight} x KL(target top-k || head) + {cfg.ce_weight} x CE on the target's choice, at depth 1 and (weight {cfg.depth2_weight}) at depth 2, where the head is fed its own output as when drafting |
| optimiser | AdamW (0.9, 0.95), lr {cfg.lr} warmup {cfg.warmup:.0%} then cosine to 10%, grad-clip 1.0, ~{cfg.batch_tokens} entries/step |
| steps | {rec.get('step', cfg.steps)} |
| seed | {cfg.seed} (deterministic on CPU) |
| training wall time | {wall:.0f} s on {platform.machine()} CPU, {torch.get_num_threads()} thread(s) (data and target states not included) |
| held-out (teacher-forced) | top-1 agreement with the target {rec.get('eval_agree', float('nan')):.3f} at depth 1 (the expected first-position acceptance under greedy decoding), {rec.get('eval_agree2', float('nan')):.3f} at depth 2; KL {rec.get('eval_kl', float('nan')):.3f} |

Spec-Bench was never used for training; it is evaluation only.

## Re-train

```
{retrain_command(profile, data, out, cfg)}
```

The training log is in `{loop.LOG}`.
"""
    (out / "README.md").write_text(text)
    (out / "training.json").write_text(json.dumps(
        {"settings": asdict(cfg), "data": [str(d) for d in data], "wall_s": round(wall, 1), "final": rec,
         "draft_vocab": n_vocab, "coverage": coverage}, indent=1, default=str))
