"""`specchat train dflash`: a DFlash drafter (backends/speculative/dflash.py) trained on
`specchat train data` output, with the published recipe:

- Features: the target's hidden states at `target_layer_ids` for every sample, computed once by the
  engine's own forward (the arithmetic the drafter sees at inference) and kept in OUT/.train.
- Blocks: random anchor positions in each reply; an anchor a makes the block [token a, mask x (B-1)]
  at positions a .. a+B-1, and block position k learns the target's token at a+k.
- Attention: a block sees the context features strictly before its anchor and its own whole block,
  never another block, so all the blocks of a batch go through the layers in one pass.
- Loss: cross-entropy weighted w_k = exp(-(k-1)/gamma), plus (by default) KL to the target's top-k
  with the same weights.
- The target's embedding and LM head are used as they are (frozen); fc, hidden_norm, the layers and
  norm train. Deterministic on CPU for a seed; resumable from OUT/.train/checkpoint.pt.
- Output: the released layout (config.json, bfloat16 model.safetensors), a model card and the log.
"""
from __future__ import annotations

import json
import math
import platform
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from specchat.backends.base import BackendError
from specchat.backends.weight_files import BrokenWeightFile, load_safetensors, safetensors_header
from specchat.backends.native.config import ModelConfig
from specchat.backends.native.model import FINAL
from specchat.backends.speculative.dflash import (FULL, DFlashConfig, DFlashModel, build_target_layer_ids, check_fits,
                                                  fresh_tensors)
from specchat.train import loop
from specchat.train.settings import DFlashTrainConfig, flags_of
from specchat.train.card import data_info_of, full_command
from specchat.train.examples import Example, load_examples, schedule, split
from specchat.train.progress import bar


@dataclass
class DFlashShape:
    layers: int = 1
    ffn: int = 0  # 0: the target's
    # SmolLM2 on CPU: drafts past block position 3 were almost never right (held-out), so the
    # head rows go to more anchors instead; block 4 + 16 anchors beat block 8 + 8 at position 1.
    block_size: int = 4
    target_layers: list[int] = field(default_factory=list)  # empty: the published default for `layers`
    mask_token_id: int | None = None  # None: see default_mask_token


def default_mask_token(tokenizer, vocab_size: int) -> int:
    """The tokenizer's mask token; else its highest added token that does not end a reply (a real,
    trained embedding row that chat text never contains); else a spare embedding row."""
    hf = tokenizer.hf
    if hf.mask_token_id is not None:
        return hf.mask_token_id
    added = [i for i in hf.added_tokens_decoder if i not in tokenizer.eos_ids and i < vocab_size]
    return max(added) if added else vocab_size - 1


def drafter_config(shape: DFlashShape, t: ModelConfig, mask_token_id: int) -> DFlashConfig:
    layer = ModelConfig(vocab_size=t.vocab_size, dim=t.dim, n_layers=shape.layers, n_heads=t.n_heads,
                        n_kv_heads=t.n_kv_heads, head_dim=t.head_dim, ffn_dim=shape.ffn or t.ffn_dim,
                        norm_eps=t.norm_eps, rope_theta=t.rope_theta, rope_scaling=t.rope_scaling,
                        max_position=t.max_position, arch="qwen3", qk_norm=True)
    ids = list(shape.target_layers) or build_target_layer_ids(t.n_layers, shape.layers)
    return DFlashConfig(layer, shape.block_size, mask_token_id, ids, t.n_layers, [FULL] * shape.layers)


# ---- the target's side: features, embedding, head ----

def target_features(engine, examples: list[Example], keys: tuple[int, ...], cache: Path, say) -> list[torch.Tensor]:
    """Per sample, the concatenated hidden states [T, len(keys) * D] (bfloat16), cached in `cache`
    (kept only for the same target layers, precision and samples)."""
    from safetensors.torch import save_file

    made_by = json.dumps({"layers": keys, "precision": engine.precision, "samples": [e.id for e in examples]})
    if cache.exists():
        try:
            same = safetensors_header(cache).metadata.get("made_by") == made_by
        except BrokenWeightFile:  # cut short (a disk that filled up): made again
            same = False
        if same:
            stored = load_safetensors(cache)
            return [stored[e.id] for e in examples]
    out = []
    started = time.perf_counter()
    with bar("target hidden states", len(examples)) as update:
        for e in examples:
            _, hidden = engine.forward(e.tokens.tolist(), 0, keys, all_logits=False)
            out.append(torch.cat([hidden[k] for k in keys], dim=-1).to(torch.bfloat16))
            update()
    save_file({e.id: f.contiguous() for e, f in zip(examples, out)}, str(cache), metadata={"made_by": made_by})
    say(f"target hidden states of {len(examples)} samples: {time.perf_counter() - started:.0f}s")
    return out


# ---- batches ----

@dataclass
class Batch:
    ctx: torch.Tensor  # [C, F] target features of the samples, concatenated
    x_ids: torch.Tensor  # [Q] block token ids (Q = blocks x B)
    positions: torch.Tensor  # [C + Q] absolute positions, context rows first
    mask: torch.Tensor  # [Q, C + Q] True where a block row may attend
    labels: torch.Tensor  # [Q] the target's token at each block position (-1: none: position 0, past the end)
    weight: torch.Tensor  # [Q] loss weight (0 where there is no label)
    top_ids: torch.Tensor  # [Q, k] the target's top-k at each block position (zeros where no label)
    top_logp: torch.Tensor  # [Q, k]


def anchors_of(e: Example, count: int, rng: random.Random, whole_blocks: int = 0) -> list[int]:
    """Random anchor positions in the reply: the first reply token .. the last that has a next token
    (with `whole_blocks` = B, only anchors whose whole block lies inside the sample)."""
    last = len(e.tokens) - (whole_blocks or 2)
    pool = range(e.prompt_len, last + 1)
    return sorted(rng.sample(pool, min(count, len(pool)))) if len(pool) > 0 else []


def make_batch(examples: list[Example], feats: list[torch.Tensor], anchors: list[list[int]], cfg: DFlashConfig,
               gamma: float) -> Batch:
    B = cfg.block_size
    k = examples[0].topk_ids.shape[1]
    ctx_pos, ctx_owner, x_ids, q_pos, q_owner, q_anchor, labels, tids, tlogp = [], [], [], [], [], [], [], [], []
    for j, (e, anchor_list) in enumerate(zip(examples, anchors)):
        T = len(e.tokens)
        ctx_pos.append(torch.arange(T))
        ctx_owner.append(torch.full((T,), j))
        for a in anchor_list:
            x_ids.append(torch.tensor([int(e.tokens[a])] + [cfg.mask_token_id] * (B - 1)))
            q_pos.append(torch.arange(a, a + B))
            q_owner.append(torch.full((B,), j))
            q_anchor.append(torch.full((B,), a))
            lab = torch.full((B,), -1)
            ids, logp = torch.zeros(B, k, dtype=torch.long), torch.zeros(B, k)
            n = min(B, T - a)  # block positions 1 .. n-1 have a label
            lab[1:n] = e.tokens[a + 1:a + n]
            ids[1:n] = e.topk_ids[a + 1 - e.prompt_len:a + n - e.prompt_len]
            logp[1:n] = e.topk_logp[a + 1 - e.prompt_len:a + n - e.prompt_len]
            labels.append(lab)
            tids.append(ids)
            tlogp.append(logp)
    ctx_pos, ctx_owner = torch.cat(ctx_pos), torch.cat(ctx_owner)
    q_pos, q_owner, q_anchor = torch.cat(q_pos), torch.cat(q_owner), torch.cat(q_anchor)
    q_block = torch.arange(len(q_pos)) // B
    sees_ctx = (ctx_owner[None, :] == q_owner[:, None]) & (ctx_pos[None, :] < q_anchor[:, None])
    sees_block = q_block[None, :] == q_block[:, None]
    labels = torch.cat(labels)
    decay = torch.exp(-(torch.arange(B) - 1).clamp_min(0) / gamma).repeat(len(q_pos) // B)
    return Batch(torch.cat(feats).float(), torch.cat(x_ids), torch.cat([ctx_pos, q_pos]),
                 torch.cat([sees_ctx, sees_block], dim=1), labels, torch.where(labels >= 0, decay, 0.0),
                 torch.cat(tids), torch.cat(tlogp))


# ---- loss ----

def losses(model: DFlashModel, embed: torch.Tensor, head: torch.Tensor, b: Batch, cfg: DFlashTrainConfig) -> dict:
    x = embed[b.x_ids]
    h = model(x, model.fuse(b.ctx), b.positions, {FULL: b.mask})
    rows = b.labels >= 0
    logq = torch.log_softmax(F.linear(h[rows], head), dim=-1)
    w = b.weight[rows]
    ce = -(logq.gather(1, b.labels[rows, None])[:, 0] * w).sum() / w.sum()
    p = torch.softmax(b.top_logp[rows], dim=-1)  # the target's top-k, renormalised
    kl = ((p * (torch.log(p.clamp_min(1e-12)) - logq.gather(1, b.top_ids[rows]))).sum(-1) * w).sum() / w.sum()
    right = torch.zeros_like(b.labels, dtype=torch.bool)
    right[rows] = logq.argmax(-1) == b.labels[rows]
    return {"loss": cfg.ce_weight * ce + cfg.kl_weight * kl, "ce": ce, "kl": kl,
            "agree": right[rows].float().mean(), "right": right}


def evaluate(model, embed, head, examples: list[Example], feats: list[torch.Tensor], cfg: DFlashConfig,
             tc: DFlashTrainConfig) -> dict:
    """Held-out figures on fixed anchors whose whole block lies in the reply, teacher-forced:
    acceptance by position (the share of blocks whose first k drafts all equal the target's greedy
    tokens: what greedy verification keeps) and the mean tokens per pass at depth B-1."""
    if not examples:
        return {}
    model.eval()
    B = cfg.block_size
    rng = random.Random(tc.seed + 1)
    hits = torch.zeros(B - 1)
    blocks, ce_sum, ce_n = 0, 0.0, 0
    for i in range(0, len(examples), 8):
        ex, fs = examples[i:i + 8], feats[i:i + 8]
        anchors = [anchors_of(e, tc.anchors, rng, whole_blocks=B) for e in ex]
        if not any(anchors):
            continue
        b = make_batch(ex, fs, anchors, cfg, tc.gamma)
        r = losses(model, embed, head, b, tc)
        right = r["right"].view(-1, B)[:, 1:]
        hits += right.long().cumprod(dim=1).sum(0).float()
        blocks += right.shape[0]
        ce_sum += float(r["ce"]) * right.shape[0]
        ce_n += right.shape[0]
    if not blocks:
        return {}
    acc = (hits / blocks).tolist()
    return {"eval_acceptance": [round(a, 4) for a in acc], "eval_tokens_per_pass": 1 + sum(acc),
            "eval_ce": ce_sum / ce_n, "eval_blocks": blocks}


# ---- training ----

def retrain_command(profile, data: list[Path], out: Path, shape: DFlashShape,
                    cfg: DFlashTrainConfig, dcfg: DFlashConfig) -> str:
    return full_command(profile, data, f"specchat train dflash --data {' '.join(map(str, data))} "
                        f"--target {profile.name} --out {out} --layers {shape.layers} --ffn {dcfg.layer.ffn_dim} "
                        f"--block-size {dcfg.block_size} --target-layers {' '.join(map(str, dcfg.target_layer_ids))} "
                        f"--mask-token-id {dcfg.mask_token_id} --anchors {cfg.anchors} --gamma {cfg.gamma} "
                        f"{flags_of(cfg)}")


def check_target(engine, profile, examples, data: list[Path]) -> None:
    """The examples' ids within the target's vocabulary, and its LM head a float one (the trainers
    read it as the frozen head)."""
    if max(int(e.tokens.max()) for e in examples) >= engine.model.cfg.vocab_size:
        raise BackendError(f"{data[0]}: token ids beyond the target's vocabulary; was it made with another target?")
    if engine.model.head.weight is None:
        raise BackendError(f"profile '{profile.name}': the target's LM head is int4-packed; train with dtype float32")


def frozen_target(engine, examples, train_set, eval_set, layer_ids, features: Path, say) -> tuple:
    """(training features, held-out features, embedding, head) from the target, which is closed after:
    the tapped layers' features of every example (computed and cached in load order, so another
    hold-out split reuses them), and its float embedding and head, frozen."""
    last = engine.model.cfg.n_layers - 1
    keys = tuple(FINAL if i == last else i for i in layer_ids)
    by_id = dict(zip((e.id for e in examples), target_features(engine, examples, keys, features, say)))
    embed, head = engine.model.embed.float(), engine.model.head.weight.float()
    engine.close()
    return [by_id[e.id] for e in train_set], [by_id[e.id] for e in eval_set], embed, head


def train_dflash(profile, data: list[Path], out: Path, shape: DFlashShape, cfg: DFlashTrainConfig, say=print) -> dict:
    from specchat.loading import load_target

    loop.start(cfg)
    data = [Path(d) for d in data]
    data_info = data_info_of(data)
    examples = load_examples(data, cfg.max_prompt_tokens)
    train_set, eval_set = split(examples, cfg.holdout, cfg.seed)
    if not train_set:
        raise BackendError(f"{data[0]}: too few samples to train on ({len(examples)})")
    longest = max(len(e.tokens) for e in examples)
    engine = load_target(profile, threads=cfg.threads, context=longest)
    t = engine.model.cfg
    check_target(engine, profile, examples, data)
    mask_id = shape.mask_token_id if shape.mask_token_id is not None else default_mask_token(engine.tokenizer,
                                                                                             t.vocab_size)
    if shape.block_size < 2:
        raise BackendError(f"--block-size {shape.block_size}: a block needs at least 2 positions")
    dcfg = drafter_config(shape, t, mask_id)
    check_fits(dcfg, t, "--target-layers / --mask-token-id")
    settings = {"shape": asdict(shape) | {"target_layers": dcfg.target_layer_ids, "mask_token_id": mask_id},
                "train": cfg.settings(), "data": [str(d) for d in data], "target": profile.name, "samples": len(examples)}
    state = loop.TrainState(out, settings)  # refuses a run with other settings before the costly features
    train_feats, eval_feats, embed, head = frozen_target(engine, examples, train_set, eval_set, dcfg.target_layer_ids,
                                                         state.dir / "features.safetensors", say)

    torch.manual_seed(cfg.seed)
    model = DFlashModel(dcfg, fresh_tensors(dcfg, torch.Generator().manual_seed(cfg.seed))).requires_grad_(True)
    plan = schedule(len(train_set), [len(e.tokens) for e in train_set], cfg.batch_tokens, cfg.seed, cfg.steps)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"DFlash drafter: {shape.layers} layer(s), block {dcfg.block_size}, target layers {dcfg.target_layer_ids}, "
        f"mask token {mask_id}, {n_params / 1e6:.1f}M parameters; {len(train_set)} training / {len(eval_set)} "
        "held-out samples")

    def held_out() -> dict:
        return evaluate(model, embed, head, eval_set, eval_feats, dcfg, cfg)

    def step_loss(step: int) -> dict | None:
        rng = random.Random(cfg.seed * 1_000_003 + step)
        idx = plan[step]
        anchors = [anchors_of(train_set[i], cfg.anchors, rng) for i in idx]
        keep = [j for j, a in enumerate(anchors) if a]  # replies of one token have no block
        if not keep:
            return None
        b = make_batch([train_set[idx[j]] for j in keep], [train_feats[idx[j]] for j in keep],
                       [anchors[j] for j in keep], dcfg, cfg.gamma)
        return losses(model, embed, head, b, cfg)

    last, wall, finished = loop.run(model, cfg, state, step_loss, held_out, "training DFlash drafter", say)
    if not finished:
        return last
    export(model, out)
    write_card(out, profile, data_info, settings, dcfg, cfg, last, n_params, wall, len(train_set), len(eval_set),
               retrain_command(profile, data, out, shape, cfg, dcfg))
    say(f"wrote {out} ({wall:.0f}s of training; held-out {last.get('eval_tokens_per_pass', math.nan):.2f} tokens "
        f"per pass at depth {dcfg.block_size - 1})")
    return last


def export(model: DFlashModel, out: Path) -> None:
    """config.json and bfloat16 model.safetensors in the released DFlash layout."""
    from safetensors.torch import save_file

    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in model.released_tensors().items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(model.cfg.to_hf() | {"torch_dtype": "bfloat16"}, indent=2))


def write_card(out: Path, profile, data_info: dict, settings: dict, dcfg: DFlashConfig, cfg: DFlashTrainConfig,
               last: dict, n_params: int, wall: float, n_train: int, n_eval: int, command: str) -> None:
    m = dcfg.layer
    size_mb = (out / "model.safetensors").stat().st_size / 1e6
    prompts = ", ".join(Path(p).name for p in data_info.get("prompt_files", [])) or "?"
    acc = last.get("eval_acceptance", [])
    text = f"""# DFlash drafter for `{profile.name}` ({profile.model})

A DFlash block drafter (the z-lab design, arXiv 2602.06036) for lossless speculative decoding in
specchat: one forward pass proposes up to {dcfg.block_size - 1} tokens, conditioned on the target's hidden
states. It has no embedding or LM head of its own: it uses the target's. Trained by
`specchat train dflash` on replies the target itself wrote with `specchat train data`.

| | |
|---|---|
| shape | {m.n_layers} layer(s), hidden {m.dim}, {m.n_heads} heads ({m.n_kv_heads} KV) x {m.head_dim}, FFN {m.ffn_dim} |
| block | {dcfg.block_size} (last verified token + {dcfg.block_size - 1} masks; mask token id {dcfg.mask_token_id}) |
| target features | outputs of target layers {dcfg.target_layer_ids} of {dcfg.num_target_layers} |
| parameters | {n_params / 1e6:.2f} M ({size_mb:.1f} MB as bfloat16 safetensors) |
| data | {n_train} training + {n_eval} held-out replies by the target to prompts from {prompts}; greedy={data_info.get('temperature', 0) == 0}, max {data_info.get('max_tokens', '?')} tokens |
| recipe | {cfg.anchors} random anchors per reply and step, blocks see the context before their anchor and their own block only; cross-entropy on the target's tokens weighted exp(-(k-1)/{cfg.gamma}){f" + {cfg.kl_weight} x KL(target top-k)" if cfg.kl_weight else ""}; the target's embedding and head frozen |
| optimiser | AdamW (0.9, 0.95), lr {cfg.lr} warmup {cfg.warmup:.0%} then cosine to 10%, grad-clip 1.0, ~{cfg.batch_tokens} tokens/step |
| steps | {last.get('step', cfg.steps)} |
| seed | {cfg.seed} (deterministic on CPU: `torch.use_deterministic_algorithms(True)`, fixed data order and anchors) |
| training wall time | {wall:.0f} s on {platform.machine()} CPU, {torch.get_num_threads()} thread(s) (data generation and the target's hidden states not included) |
| held-out estimate | {last.get('eval_tokens_per_pass', math.nan):.2f} tokens per pass at depth {dcfg.block_size - 1} under greedy verification; acceptance by position {acc} (share of {last.get('eval_blocks', 0)} teacher-forced blocks whose first k drafts all match the target) |

Spec-Bench was never used for training (it is refused by `specchat train data`); it is evaluation only.

## Re-train

```
{command}
```

The training log (loss, agreement, held-out figures) is in `{loop.LOG}`.
"""
    (out / "README.md").write_text(text)
    (out / "training.json").write_text(json.dumps(settings | {"wall_s": round(wall, 1), "final": last}, indent=1))
