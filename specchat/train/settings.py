"""The settings every trainer shares, each trainer's own, and their command-line flags (defined
once, here). No torch import: the CLI builds its parser from these on every start."""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields

# settings that do not change what a run computes (left out of the resume check)
_RUNTIME = ("stop_at", "checkpoint_every", "eval_every", "threads")


@dataclass
class TrainConfig:
    """What every trainer's run is made of; trainers subclass it for their own settings and defaults."""

    steps: int = 600
    batch_tokens: int = 2048
    lr: float = 2e-3
    seed: int = 0
    kl_weight: float = 1.0  # KL from the target's top-k distribution
    ce_weight: float = 0.5  # cross-entropy on the target's own token
    checkpoint_every: int = 100
    eval_every: int = 100
    holdout: float = 0.05
    threads: int = 0
    warmup: float = 0.05
    stop_at: int | None = None  # stop (as if interrupted) after this step; for resume tests
    max_prompt_tokens: int | None = None  # train only on samples whose prompt is at most this long

    def settings(self) -> dict:
        """The settings a resumed run must share (for the checkpoint and the card)."""
        return {k: v for k, v in asdict(self).items() if k not in _RUNTIME}


@dataclass
class DraftTrainConfig(TrainConfig):
    freeze_embedding: bool = False  # keep the (projected) target embedding and tied head fixed


@dataclass
class MtpTrainConfig(TrainConfig):
    lr: float = 1e-3
    depth2_weight: float = 0.5  # also train the second drafting step (the head fed its own output); 0: off
    top_k: int = 32
    draft_vocab: int = 8192  # 0: the whole vocabulary
    hidden_source: str = "post_norm"


@dataclass
class Eagle3TrainConfig(TrainConfig):
    lr: float = 1e-3
    top_k: int = 32
    draft_vocab: int = 8192  # 0: the whole vocabulary
    taps: list[int] | None = None  # target layers whose input is fused (None: the published 2, L // 2, L - 3)
    ttt_steps: int = 3  # drafting steps unrolled in training (the training-time test)
    ttt_decay: float = 0.8  # loss weight of step s: ttt_decay ** s


@dataclass
class DFlashTrainConfig(TrainConfig):
    batch_tokens: int = 1024
    anchors: int = 16  # blocks per sequence and step
    gamma: float = 4.0  # position decay of the loss
    lr: float = 3e-3
    ce_weight: float = 1.0
    # kl_weight (1.0) is not in the published recipe, which has far more data; on SmolLM2's few
    # hundred replies KL to the target's top-k raised held-out agreement at block position 1
    # (docs/results.md, the DFlash drafter)



@dataclass
class DSparkTrainConfig(DFlashTrainConfig):
    # DeepSpec's DSpark recipe: 0.1 cross-entropy + 0.9 total variation to the target's
    # distribution (1 - TV is the acceptance rate of rejection sampling); no KL
    ce_weight: float = 0.1
    kl_weight: float = 0.0
    tv_weight: float = 0.9
    lr: float = 3e-3
    steps: int = 400


# ---- the flags every trainer takes ----

def add_training_flags(p: argparse.ArgumentParser, defaults: TrainConfig, what: str) -> None:
    """--data, --target, --out and the TrainConfig flags, with the trainer's own defaults."""
    p.add_argument("--data", required=True, nargs="+", help="directories written by `specchat train data`")
    p.add_argument("--target", default="smollm2", help="target profile (torch backend)")
    p.add_argument("--out", required=True, help=f"output {what} directory (checkpoints go to OUT/.train)")
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--batch-tokens", type=int, default=defaults.batch_tokens,
                   help=f"tokens per step (default {defaults.batch_tokens})")
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--kl-weight", type=float, default=defaults.kl_weight,
                   help="weight of KL to the target's top-k distribution")
    p.add_argument("--ce-weight", type=float, default=defaults.ce_weight,
                   help="weight of cross-entropy on the target's tokens")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--holdout", type=float, default=defaults.holdout, help="share of samples held out for evaluation")
    p.add_argument("--max-prompt-tokens", type=int,
                   help="train only on samples whose prompt is at most N tokens (long documents make the "
                        "target's feature pass slow)")
    p.add_argument("--checkpoint-every", type=int, default=defaults.checkpoint_every)
    p.add_argument("--eval-every", type=int, default=defaults.eval_every)
    p.add_argument("--threads", type=int, default=defaults.threads, help="torch threads (0: all physical cores)")
    p.add_argument("--stop-at", type=int, help=argparse.SUPPRESS)  # simulate an interruption (tests)


def config_from_args(cls: type, args: argparse.Namespace, **extra):
    """`cls` (a TrainConfig) from the parsed flags of the same names, plus `extra`."""
    values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
    return cls(**(values | extra))


def flags_of(cfg: TrainConfig) -> str:
    """The shared flags of `cfg` as a command line (for the retrain command on a drafter's card)."""
    text = (f"--steps {cfg.steps} --batch-tokens {cfg.batch_tokens} --lr {cfg.lr} --kl-weight {cfg.kl_weight} "
            f"--ce-weight {cfg.ce_weight} --holdout {cfg.holdout} --seed {cfg.seed}")
    return text + (f" --max-prompt-tokens {cfg.max_prompt_tokens}" if cfg.max_prompt_tokens else "")
