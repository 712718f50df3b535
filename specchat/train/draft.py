"""`specchat train draft`: a small Llama draft model distilled from the target's replies.

- Shape: `DraftShape` (layers, hidden, heads, ffn); the tied embedding is the target's,
  dequantized by the engine's own loader and, when the hidden size is smaller, projected onto
  its top principal directions (a low-rank init that keeps the head close to the target's).
- Loss at every reply position: KL from the target's top-k distribution (renormalised over
  those k) to the drafter's, plus cross-entropy on the token the target chose.
- Deterministic on CPU for a given seed: seeded init, a batch schedule that is a pure function
  of (seed, step), deterministic algorithms. Resumable: OUT/.train/checkpoint.pt every N steps.
- Output: a Hugging Face directory (config, bfloat16 safetensors, the target's tokenizer,
  generation_config, model card, training log) that `TorchBackend` loads like any model.
"""
from __future__ import annotations

import json
import math
import platform
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specchat import paths
from specchat.backends.base import BackendError
from specchat.backends.cpu import thread_count
from specchat.loading import target_path
from specchat.train.data import INFO, read_manifest
from specchat.train.progress import bar

STATE_DIR = ".train"
LOG = "train-log.jsonl"


@dataclass
class DraftShape:
    layers: int = 1
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 768


@dataclass
class TrainConfig:
    steps: int = 600
    batch_tokens: int = 2048
    lr: float = 2e-3
    seed: int = 0
    kl_weight: float = 1.0
    ce_weight: float = 0.5
    checkpoint_every: int = 100
    eval_every: int = 100
    holdout: float = 0.05
    threads: int = 0
    warmup: float = 0.05
    freeze_embedding: bool = False  # keep the (projected) target embedding and tied head fixed
    stop_at: int | None = None  # stop (as if interrupted) after this step; for resume tests


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

    if shape.hidden % shape.heads or shape.heads % shape.kv_heads:
        raise BackendError(f"hidden {shape.hidden} must divide by heads {shape.heads}, and heads by kv-heads "
                           f"{shape.kv_heads}")
    eos = sorted(tokenizer.eos_ids)
    return LlamaConfig(vocab_size=tcfg.vocab_size, hidden_size=shape.hidden, intermediate_size=shape.ffn,
                       num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                       num_key_value_heads=shape.kv_heads, head_dim=shape.hidden // shape.heads,
                       max_position_embeddings=tcfg.max_position, rms_norm_eps=tcfg.norm_eps,
                       rope_theta=tcfg.rope_theta, tie_word_embeddings=True,
                       bos_token_id=tokenizer.hf.bos_token_id, eos_token_id=eos[0] if len(eos) == 1 else eos)


# ---- data ----

@dataclass
class Example:
    id: str
    tokens: torch.Tensor  # int64 prompt + reply
    prompt_len: int
    topk_ids: torch.Tensor  # int64 [reply, k]
    topk_logp: torch.Tensor  # float32 [reply, k]


def load_examples(dirs: list[Path], max_prompt_tokens: int | None = None) -> list[Example]:
    """Every sample of the data directories (a prompt id seen twice is kept once), sorted by id;
    with `max_prompt_tokens`, only samples whose prompt is at most that long (long documents cost
    the target's feature pass far more than their replies add)."""
    from safetensors.torch import load_file

    seen: dict[str, Example] = {}
    for data in dirs:
        manifest = read_manifest(data)
        if not manifest:
            raise BackendError(f"{data}: no training samples (manifest.jsonl); run `specchat train data` first")
        shards: dict[str, dict] = {}
        for m in manifest:
            if m["reply_len"] == 0 or m["id"] in seen or (max_prompt_tokens and m["prompt_len"] > max_prompt_tokens):
                continue
            sh = shards.setdefault(m["shard"], load_file(str(data / m["shard"])))
            n = m["prompt_len"] + m["reply_len"]
            lo = m["topk_offset"]
            seen[m["id"]] = Example(m["id"], sh["tokens"][m["offset"]:m["offset"] + n].long(), m["prompt_len"],
                                    sh["topk_ids"][lo:lo + m["reply_len"]].long(),
                                    sh["topk_logp"][lo:lo + m["reply_len"]].float())
    return [seen[k] for k in sorted(seen)]


def prompt_sources(data_info: dict) -> str:
    """The card's account of where the training prompts came from."""
    names = data_info.get("prompt_files", [])
    if not names:
        return "?"
    notes = ["self-instruct, Apache-2.0" if n.startswith("self-instruct") else f"{n}: see its data directory"
             for n in names]
    return ", ".join(names) + " (" + "; ".join(dict.fromkeys(notes)) + ")"


def data_info_of(dirs: list[Path]) -> dict:
    """The first directory's settings, with the prompt files of all of them."""
    infos = [json.loads((d / INFO).read_text()) for d in dirs if (d / INFO).exists()]
    if not infos:
        return {}
    files = list(dict.fromkeys(Path(f).name for i in infos for f in i.get("prompt_files", [])))
    return infos[0] | {"prompt_files": files}


def source_task(example_id: str) -> str:
    """The prompt an example derives from: `--variants` ids are `<task id>~<kind>`."""
    return example_id.split("~", 1)[0]


def split(examples: list[Example], holdout: float, seed: int) -> tuple[list[Example], list[Example]]:
    """Held-out examples for about `holdout` of the data, whole source tasks at a time: a reply
    to "summarise X" in training and one to "explain X" held out would measure memory of X."""
    groups: dict[str, list[int]] = {}
    for i, e in enumerate(examples):
        groups.setdefault(source_task(e.id), []).append(i)
    keys = sorted(groups)
    random.Random(seed).shuffle(keys)
    n_eval = max(1, round(len(examples) * holdout)) if len(keys) > 1 and holdout > 0 else 0
    ev: list[int] = []
    for key in keys:
        if len(ev) >= n_eval:
            break
        ev += groups[key]
    held = set(ev)
    return ([e for i, e in enumerate(examples) if i not in held], [e for i, e in enumerate(examples) if i in held])


def schedule(n: int, lengths: list[int], batch_tokens: int, seed: int, steps: int) -> list[list[int]]:
    """Batches of example indices for every step: seeded epoch permutations, cut into batches of
    about `batch_tokens` tokens. A pure function of its arguments, so a resumed run sees the same data."""
    batches: list[list[int]] = []
    epoch = 0
    while len(batches) < steps:
        order = list(range(n))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        cur, size = [], 0
        for i in order:
            cur.append(i)
            size += lengths[i]
            if size >= batch_tokens:
                batches.append(cur)
                cur, size = [], 0
        if cur:
            batches.append(cur)
        epoch += 1
    return batches[:steps]


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

def losses(model, batch, cfg: TrainConfig):
    ids, rows, cols, top_ids, top_logp, targets = batch
    hidden = model.model(input_ids=ids).last_hidden_state[rows, cols]  # [N, H] at reply positions
    logq = torch.log_softmax(F.linear(hidden, model.get_input_embeddings().weight).float(), dim=-1)
    p = torch.softmax(top_logp, dim=-1)  # the target's top-k, renormalised
    kl = (p * (torch.log(p.clamp_min(1e-12)) - logq.gather(1, top_ids))).sum(-1).mean()
    ce = F.nll_loss(logq, targets)
    agree = (logq.argmax(-1) == targets).float().mean()
    return cfg.kl_weight * kl + cfg.ce_weight * ce, kl, ce, agree


@torch.no_grad()
def evaluate(model, examples: list[Example], cfg: TrainConfig) -> dict:
    """Held-out KL, CE and top-1 agreement with the target's token (greedy per-token acceptance),
    teacher-forced on the target's replies."""
    if not examples:
        return {}
    model.eval()
    tot = {"kl": 0.0, "ce": 0.0, "agree": 0.0}
    n = 0
    for i in range(0, len(examples), 8):
        b = collate(examples[i:i + 8])
        k = len(b[5])
        _, kl, ce, agree = losses(model, b, cfg)
        for name, v in (("kl", kl), ("ce", ce), ("agree", agree)):
            tot[name] += float(v) * k
        n += k
    model.train()
    return {f"eval_{k}": v / n for k, v in tot.items()} | {"eval_positions": n}


# ---- training ----

class TrainState:
    """A run's state in OUT/.train/checkpoint.pt (model, optimiser, step, wall time) and its log.

    A checkpoint made with other settings is refused as soon as the run is set up; a fresh run
    starts a fresh log."""

    def __init__(self, out: Path, settings: dict):
        self.settings = settings
        self.dir = out / STATE_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "checkpoint.pt"
        self.log_path = out / LOG
        self.saved = torch.load(self.path, weights_only=False) if self.path.exists() else None
        if self.saved is not None and self.saved["settings"] != settings:
            raise BackendError(f"{out}: holds a training run with other settings; use another --out or delete "
                               f"{self.dir}")

    def restore(self, model, opt, say) -> tuple[int, float]:
        """(step, wall seconds) to continue from, with model and optimiser loaded."""
        if self.saved is None:
            self.log_path.unlink(missing_ok=True)
            return 0, 0.0
        model.load_state_dict(self.saved["model"])
        opt.load_state_dict(self.saved["opt"])
        say(f"resuming from step {self.saved['step']} ({self.saved['wall_s']:.0f}s trained so far)")
        return self.saved["step"], self.saved["wall_s"]

    def save(self, model, opt, step: int, wall: float) -> None:
        tmp = self.path.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "wall_s": wall,
                    "settings": self.settings}, tmp)
        tmp.replace(self.path)

    def log(self, rec: dict) -> None:
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")

    def end_of_step(self, model, opt, step: int, wall: float, cfg, say) -> bool:
        """Checkpoint when due; True when the run stops here as if interrupted (cfg.stop_at, for
        resume tests), after saving."""
        stop = cfg.stop_at is not None and cfg.stop_at <= step < cfg.steps
        if stop or step % cfg.checkpoint_every == 0 or step == cfg.steps:
            self.save(model, opt, step, wall)
        if stop:
            say(f"stopped at step {step} (resume by running the same command)")
        return stop


def lr_at(step: int, cfg: TrainConfig) -> float:
    warm = max(1, int(cfg.steps * cfg.warmup))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    t = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def data_commands(profile, data: list[Path]) -> list[str]:
    """The `specchat train data` commands that make each data directory again, from its info.json
    (a directory without one is left out), after the `specchat train prompts` command of any
    prompt file the target wrote itself."""
    from specchat.train.self_prompts import remake_command

    commands = []
    for d in data:
        if not (d / INFO).exists():
            continue
        info = json.loads((d / INFO).read_text())
        for f in info["prompt_files"]:  # prompts the target wrote itself come first
            prompts = remake_command(Path(f))
            if prompts and prompts not in commands:
                commands.append(prompts)
        gen = (f"specchat train data --target {info.get('target', profile.name)} --prompts "
               f"{' '.join(info['prompt_files'])} --out {d} --max-tokens {info['max_tokens']} --top-k {info['top_k']}")
        if info.get("temperature"):
            gen += f" --temperature {info['temperature']} --seed {info['seed']}"
        for flag in ("instances", "variants"):
            gen += f" --{flag}" if info.get(flag) else ""
        if info.get("limit"):
            gen += f" --limit {info['limit']}"
        generator = str(info.get("generator", ""))
        if generator.startswith("transformers"):  # "transformers DTYPE, batched"
            gen += f" --batch {info.get('batch') or 48} --dtype {generator.split()[1].rstrip(',')}"
        commands.append(gen)
    return commands


def retrain_command(profile, data: list[Path], out: Path, shape: DraftShape, cfg: TrainConfig) -> str:
    """The one shell command that makes this drafter again from scratch: data, then training."""
    parts = data_commands(profile, data)
    parts.append(f"specchat train draft --data {' '.join(map(str, data))} --target {profile.name} --out {out} "
                 f"--layers {shape.layers} --hidden {shape.hidden} --heads {shape.heads} --kv-heads {shape.kv_heads} "
                 f"--ffn {shape.ffn} --steps {cfg.steps} --batch-tokens {cfg.batch_tokens} --lr {cfg.lr} "
                 f"--kl-weight {cfg.kl_weight} --ce-weight {cfg.ce_weight} --holdout {cfg.holdout} --seed {cfg.seed}"
                 + (" --freeze-embedding" if cfg.freeze_embedding else ""))
    return " && \\\n  ".join(parts)


def train_draft(profile, data: list[Path], out: Path, shape: DraftShape, cfg: TrainConfig, say=print) -> dict:
    from transformers import LlamaForCausalLM

    torch.set_num_threads(thread_count(cfg.threads))
    torch.use_deterministic_algorithms(True)
    data = [Path(d) for d in data]
    data_info = data_info_of(data)
    examples = load_examples(data)
    train_set, eval_set = split(examples, cfg.holdout, cfg.seed)
    if not train_set:
        raise BackendError(f"{data[0]}: too few samples to train on ({len(examples)})")
    embed, tcfg, tokenizer = target_parts(profile)
    if max(int(e.tokens.max()) for e in examples) >= embed.shape[0]:
        raise BackendError(f"{data[0]}: token ids beyond the target's vocabulary; was it made with another target?")
    settings = {"shape": asdict(shape), "train": {k: v for k, v in asdict(cfg).items() if k not in
                                                   ("stop_at", "checkpoint_every", "eval_every", "threads")},
                "data": [str(d) for d in data], "target": profile.name, "samples": len(examples)}

    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    model = LlamaForCausalLM(draft_config(shape, tcfg, tokenizer)).float()
    with torch.no_grad():
        emb = project_embedding(embed, shape.hidden, gen)
        model.get_input_embeddings().weight.copy_(emb)
        # logits of the target's order of magnitude (a unit norm gives huge ones; a near-uniform start
        # makes Adam spend hundreds of steps growing the norm)
        model.model.norm.weight.fill_(2.0 / (emb.std().item() * shape.hidden ** 0.5))
    del embed
    model.get_input_embeddings().weight.requires_grad_(not cfg.freeze_embedding)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    state = TrainState(out, settings)
    step, wall = state.restore(model, opt, say)
    plan = schedule(len(train_set), [len(e.tokens) for e in train_set], cfg.batch_tokens, cfg.seed, cfg.steps)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"draft model: {shape.layers} layers, hidden {shape.hidden}, {n_params / 1e6:.1f}M parameters; "
        f"{len(train_set)} training / {len(eval_set)} held-out samples")

    model.train()
    started = time.perf_counter()
    last = {}
    with bar("training drafter", cfg.steps, step) as update:
        while step < cfg.steps:
            for g in opt.param_groups:
                g["lr"] = lr_at(step, cfg)
            loss, kl, ce, agree = losses(model, collate([train_set[i] for i in plan[step]]), cfg)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
            opt.step()
            step += 1
            now = time.perf_counter()
            wall += now - started
            started = now
            last = {"step": step, "loss": loss.item(), "kl": kl.item(), "ce": ce.item(), "agree": agree.item(),
                    "lr": lr_at(step - 1, cfg), "wall_s": round(wall, 1)}
            if step % cfg.eval_every == 0 or step == cfg.steps:
                last |= evaluate(model, eval_set, cfg)
            state.log(last)
            update(status=f"loss {last['loss']:.3f} agree {last['agree']:.2f}"
                   + (f" held-out {last['eval_agree']:.2f}" if "eval_agree" in last else ""))
            if state.end_of_step(model, opt, step, wall, cfg, say):
                return last
            started = time.perf_counter()
    if "eval_agree" not in last and eval_set:
        last |= evaluate(model, eval_set, cfg)
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
    cfg["architectures"] = ["LlamaForCausalLM"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    tokenizer.hf.save_pretrained(str(out))
    eos = sorted(tokenizer.eos_ids)
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tokenizer.hf.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos}, indent=2))


def write_card(out: Path, profile, data_info: dict, settings: dict, shape: DraftShape, cfg: TrainConfig,
               last: dict, n_params: int, wall: float, n_train: int, n_eval: int, command: str) -> None:
    size_mb = (out / "model.safetensors").stat().st_size / 1e6
    text = f"""# Draft model for `{profile.name}` ({profile.model})

A small Llama-architecture draft model for lossless speculative decoding in specchat, with the
target's own tokenizer. Trained by `specchat train draft` (distillation) on replies the target itself
wrote with `specchat train data`.

| | |
|---|---|
| shape | {shape.layers} layer(s), hidden {shape.hidden}, {shape.heads} heads ({shape.kv_heads} KV), FFN {shape.ffn}, tied embedding |
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

The training log (loss, agreement, held-out figures per step) is in `{LOG}`.
"""
    (out / "README.md").write_text(text)
    (out / "training.json").write_text(json.dumps(settings | {"wall_s": round(wall, 1), "final": last}, indent=1))


def clean_state(out: Path) -> None:
    shutil.rmtree(out / STATE_DIR, ignore_errors=True)
