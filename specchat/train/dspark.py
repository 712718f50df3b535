"""`specchat train dspark`: a DSpark drafter (backends/speculative/dspark.py) made from a DFlash
drafter (`--init`, e.g. the shipped profiles/drafters/smollm2-dflash) by training a low-rank
Markov head on top of it, with DFlash's trainer (train/dflash.py): the same data, target
features, anchors, blocks and training loop.

- Logits of block slot k: the DFlash drafter's + W2 . W1[x_{k-1}], where x_{k-1} is the target's
  token before position k (the anchor for k = 1). Teacher-forced, which is exactly what the drafter
  sees at inference whenever the drafts before k were right, the only case acceptance at k counts.
- Loss: DeepSpec's 0.1 cross-entropy + 0.9 total variation to the target's distribution (its
  stored top-k, renormalised: TV = 1/2 (sum over the top-k |p - q| + the draft mass outside it)),
  weighted by block position as DFlash's (exp(-(k-1)/gamma)); KL optional (--kl-weight).
- The DFlash drafter stays frozen by default, so the held-out figures compare the two on the
  very same block drafter: `eval_acceptance` with the Markov head, `eval_acceptance_dflash`
  without. `--train-backbone` trains both (DeepSpec trains them jointly from scratch).
- No confidence head is trained (the loop here does not use one: dspark.py says why).
- Output: config.json (DFlash's layout marked DSpark, `sample_from_anchor: false`: drafts start at
  slot 1 as in the DFlash drafter it came from), bfloat16 model.safetensors, card and log.
"""
from __future__ import annotations

import math
import platform
import random
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specchat.backends.base import BackendError
from specchat.backends.speculative.dflash import FULL, DFlashModel, load_dflash
from specchat.backends.speculative.dspark import MarkovHead, config_json, fresh_markov
from specchat.train import loop
from specchat.train.card import data_info_of, full_command
from specchat.train.dflash import Batch, anchors_of, check_target, frozen_target, make_batch
from specchat.train.examples import load_examples, schedule, split
from specchat.train.settings import DSparkTrainConfig, flags_of


@dataclass
class DSparkShape:
    init: Path  # the DFlash drafter to build on
    rank: int = 64  # of the Markov head (DeepSpec: 256 at a 152k vocabulary)
    train_backbone: bool = False


class DSparkModel(nn.Module):
    def __init__(self, backbone: DFlashModel, markov: MarkovHead):
        super().__init__()
        self.backbone, self.markov = backbone, markov


def previous_tokens(b: Batch, block: int) -> torch.Tensor:
    """[Q] the token before each block slot's target token: the anchor for slot 1, the target's
    token at slot k-1 after that (slot 0 and slots past the sample's end: any valid id)."""
    x, lab = b.x_ids.view(-1, block), b.labels.view(-1, block)
    prev = torch.cat([x[:, :1], x[:, :1], lab[:, 1:-1]], dim=1)
    return prev.clamp_min(0).reshape(-1)


def losses(model: DSparkModel, embed, head, b: Batch, cfg: DSparkTrainConfig, train_backbone: bool) -> dict:
    bb = model.backbone
    rows = b.labels >= 0
    with torch.set_grad_enabled(train_backbone and torch.is_grad_enabled()):
        h = bb(embed[b.x_ids], bb.fuse(b.ctx), b.positions, {FULL: b.mask})
        base = F.linear(h[rows], head)
    logits = base + model.markov.bias(previous_tokens(b, bb.cfg.block_size)[rows])
    logq = torch.log_softmax(logits, dim=-1)
    w = b.weight[rows]
    labels = b.labels[rows]
    ce = -(logq.gather(1, labels[:, None])[:, 0] * w).sum() / w.sum()
    p = torch.softmax(b.top_logp[rows], dim=-1)  # the target's top-k, renormalised
    q_top = logq.gather(1, b.top_ids[rows]).exp()
    tv = 0.5 * ((p - q_top).abs().sum(-1) + (1 - q_top.sum(-1)).clamp_min(0))
    tv = (tv * w).sum() / w.sum()
    kl = ((p * (torch.log(p.clamp_min(1e-12)) - logq.gather(1, b.top_ids[rows]))).sum(-1) * w).sum() / w.sum()
    right = torch.zeros_like(b.labels, dtype=torch.bool)
    right[rows] = logits.argmax(-1) == labels
    base_right = torch.zeros_like(right)
    base_right[rows] = base.argmax(-1) == labels
    return {"loss": cfg.ce_weight * ce + cfg.tv_weight * tv + cfg.kl_weight * kl, "ce": ce, "tv": tv,
            "agree": right[rows].float().mean(), "right": right, "base_right": base_right}


def evaluate(model: DSparkModel, embed, head, examples, feats, cfg: DSparkTrainConfig, train_backbone: bool) -> dict:
    """Held-out acceptance by position on fixed whole-block anchors, teacher-forced, with the
    Markov head and without it (the DFlash drafter alone): the share of blocks whose first k drafts
    all equal the target's greedy tokens."""
    if not examples:
        return {}
    B = model.backbone.cfg.block_size
    rng = random.Random(cfg.seed + 1)
    hits, base_hits, blocks = torch.zeros(B - 1), torch.zeros(B - 1), 0
    for i in range(0, len(examples), 8):
        ex, fs = examples[i:i + 8], feats[i:i + 8]
        anchors = [anchors_of(e, cfg.anchors, rng, whole_blocks=B) for e in ex]
        if not any(anchors):
            continue
        r = losses(model, embed, head, make_batch(ex, fs, anchors, model.backbone.cfg, cfg.gamma), cfg,
                   train_backbone)
        right, base = r["right"].view(-1, B)[:, 1:], r["base_right"].view(-1, B)[:, 1:]
        hits += right.long().cumprod(dim=1).sum(0).float()
        base_hits += base.long().cumprod(dim=1).sum(0).float()
        blocks += right.shape[0]
    if not blocks:
        return {}
    acc, base_acc = (hits / blocks).tolist(), (base_hits / blocks).tolist()
    return {"eval_acceptance": [round(a, 4) for a in acc], "eval_tokens_per_pass": 1 + sum(acc),
            "eval_acceptance_dflash": [round(a, 4) for a in base_acc],
            "eval_tokens_per_pass_dflash": 1 + sum(base_acc), "eval_blocks": blocks}


def retrain_command(profile, data: list[Path], out: Path, shape: DSparkShape, cfg: DSparkTrainConfig) -> str:
    return full_command(profile, data, f"specchat train dspark --data {' '.join(map(str, data))} "
                        f"--target {profile.name} --init {shape.init} --out {out} --rank {shape.rank}"
                        f"{' --train-backbone' if shape.train_backbone else ''} --anchors {cfg.anchors} "
                        f"--gamma {cfg.gamma} --tv-weight {cfg.tv_weight} {flags_of(cfg)}")


def train_dspark(profile, data: list[Path], out: Path, shape: DSparkShape, cfg: DSparkTrainConfig,
                 say=print) -> dict:
    from specchat.loading import load_target

    loop.start(cfg)
    data = [Path(d) for d in data]
    examples = load_examples(data, cfg.max_prompt_tokens)
    train_set, eval_set = split(examples, cfg.holdout, cfg.seed)
    if not train_set:
        raise BackendError(f"{data[0]}: too few samples to train on ({len(examples)})")
    if shape.rank < 1:
        raise BackendError(f"--rank {shape.rank}: the Markov head needs a rank of at least 1")
    engine = load_target(profile, threads=cfg.threads, context=max(len(e.tokens) for e in examples))
    t = engine.model.cfg
    check_target(engine, profile, examples, data)
    backbone = load_dflash(shape.init, t)  # one clear line for a drafter made for another target
    dcfg = backbone.cfg
    settings = {"shape": {"init": str(shape.init), "rank": shape.rank, "train_backbone": shape.train_backbone},
                "train": cfg.settings(), "data": [str(d) for d in data], "target": profile.name,
                "samples": len(examples)}
    state = loop.TrainState(out, settings)  # refuses a run with other settings before the costly features
    train_feats, eval_feats, embed, head = frozen_target(engine, examples, train_set, eval_set, dcfg.target_layer_ids,
                                                         state.dir / "features.safetensors", say)

    torch.manual_seed(cfg.seed)
    model = DSparkModel(backbone.requires_grad_(shape.train_backbone),
                        fresh_markov(t.vocab_size, shape.rank, torch.Generator().manual_seed(cfg.seed)))
    plan = schedule(len(train_set), [len(e.tokens) for e in train_set], cfg.batch_tokens, cfg.seed, cfg.steps)
    n_markov = sum(p.numel() for p in model.markov.parameters())
    say(f"DSpark drafter: the DFlash drafter {shape.init} (block {dcfg.block_size}, "
        f"{'trained' if shape.train_backbone else 'frozen'}) + a rank-{shape.rank} Markov head "
        f"({n_markov / 1e6:.1f}M parameters); {len(train_set)} training / {len(eval_set)} held-out samples")

    def held_out() -> dict:
        return evaluate(model, embed, head, eval_set, eval_feats, cfg, shape.train_backbone)

    def step_loss(step: int) -> dict | None:
        rng = random.Random(cfg.seed * 1_000_003 + step)
        idx = plan[step]
        anchors = [anchors_of(train_set[i], cfg.anchors, rng) for i in idx]
        keep = [j for j, a in enumerate(anchors) if a]
        if not keep:
            return None
        b = make_batch([train_set[idx[j]] for j in keep], [train_feats[idx[j]] for j in keep],
                       [anchors[j] for j in keep], dcfg, cfg.gamma)
        return losses(model, embed, head, b, cfg, shape.train_backbone)

    last, wall, finished = loop.run(model, cfg, state, step_loss, held_out, "training DSpark drafter", say)
    if not finished:
        return last
    export(model, out)
    write_card(out, profile, data_info_of(data), settings, shape, cfg, last, n_markov, wall, len(train_set),
               len(eval_set), retrain_command(profile, data, out, shape, cfg))
    say(f"wrote {out} ({wall:.0f}s of training; held-out {last.get('eval_tokens_per_pass', math.nan):.2f} tokens "
        f"per pass at depth {dcfg.block_size - 1}, the DFlash drafter alone "
        f"{last.get('eval_tokens_per_pass_dflash', math.nan):.2f})")
    return last


def export(model: DSparkModel, out: Path) -> None:
    """config.json and bfloat16 model.safetensors: DFlash's tensors and the Markov head's."""
    import json

    from safetensors.torch import save_file

    tensors = model.backbone.released_tensors() | model.markov.released_tensors()
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    cfg = config_json(model.backbone.cfg, model.markov.rank, anchor_first=False)
    (out / "config.json").write_text(json.dumps(cfg | {"torch_dtype": "bfloat16"}, indent=2))


def write_card(out: Path, profile, data_info: dict, settings: dict, shape: DSparkShape, cfg: DSparkTrainConfig,
               last: dict, n_markov: int, wall: float, n_train: int, n_eval: int, command: str) -> None:
    import json

    dcfg = json.loads((out / "config.json").read_text())
    B = dcfg["block_size"]
    size_mb = (out / "model.safetensors").stat().st_size / 1e6
    prompts = ", ".join(Path(p).name for p in data_info.get("prompt_files", [])) or "?"
    text = f"""# DSpark drafter for `{profile.name}` ({profile.model})

A DSpark drafter (arXiv 2607.05147): the DFlash block drafter `{shape.init}`
({'trained further' if shape.train_backbone else 'unchanged'}) plus a rank-{shape.rank} Markov head whose logit
correction W2 . W1[previous token] makes each of the block's {B - 1} drafts depend on the draft before it.
Trained by `specchat train dspark` on replies the target itself wrote. No confidence head.

| | |
|---|---|
| block | {B} (last verified token + {B - 1} masks; drafts from slot 1: `sample_from_anchor: false`) |
| Markov head | W1, W2 [{dcfg['vocab_size']}, {shape.rank}] ({n_markov / 1e6:.2f} M parameters); {size_mb:.1f} MB in all as bfloat16 safetensors |
| data | {n_train} training + {n_eval} held-out replies by the target to prompts from {prompts}; max {data_info.get('max_tokens', '?')} tokens |
| recipe | {cfg.anchors} random anchors per reply and step; teacher-forced previous tokens; {cfg.ce_weight} x cross-entropy + {cfg.tv_weight} x total variation to the target's top-k{f" + {cfg.kl_weight} x KL" if cfg.kl_weight else ""}, weighted exp(-(k-1)/{cfg.gamma}) by block position |
| optimiser | AdamW (0.9, 0.95), lr {cfg.lr} warmup {cfg.warmup:.0%} then cosine to 10%, grad-clip 1.0, ~{cfg.batch_tokens} tokens/step, {last.get('step', cfg.steps)} steps, seed {cfg.seed} |
| training wall time | {wall:.0f} s on {platform.machine()} CPU, {torch.get_num_threads()} thread(s) (the target's hidden states not included) |
| held-out estimate | {last.get('eval_tokens_per_pass', math.nan):.2f} tokens per pass at depth {B - 1} (acceptance by position {last.get('eval_acceptance')}); the DFlash drafter alone on the same {last.get('eval_blocks', 0)} teacher-forced blocks: {last.get('eval_tokens_per_pass_dflash', math.nan):.2f} ({last.get('eval_acceptance_dflash')}) |

Spec-Bench was never used for training; it is evaluation only.

## Re-train

```
{command}
```

The training log (loss, agreement, held-out figures) is in `{loop.LOG}`.
"""
    (out / "README.md").write_text(text)
    (out / "training.json").write_text(json.dumps(settings | {"wall_s": round(wall, 1), "final": last}, indent=1))
