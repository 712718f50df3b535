"""The one training loop every trainer runs (`train draft`, `train mtp`, `train dflash`): each
trainer is its model, its batches and its loss; the optimiser, schedule, checkpoints, resume,
held-out evaluation, log and progress live here (the settings and flags they share: settings.py).

Deterministic on CPU for a seed (`torch.use_deterministic_algorithms`, a batch schedule that is a
pure function of (seed, step)) and resumable: OUT/.train/checkpoint.pt every `checkpoint_every`
steps, refused if the run's settings changed.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from specchat.backends.base import BackendError
from specchat.backends.cpu import thread_count
from specchat.train.progress import bar

from specchat.train.settings import TrainConfig

STATE_DIR = ".train"
LOG = "train-log.jsonl"


def start(cfg: TrainConfig) -> None:
    """Threads and deterministic kernels for a run."""
    torch.set_num_threads(thread_count(cfg.threads))
    torch.use_deterministic_algorithms(True)


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
    """Linear warm-up over `warmup` of the steps, then cosine down to a tenth."""
    warm = max(1, int(cfg.steps * cfg.warmup))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    t = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))




def run(model: torch.nn.Module, cfg: TrainConfig, state: TrainState, step_loss: Callable[[int], Optional[dict]],
        held_out: Callable[[], dict], label: str, say=print) -> tuple[dict, float, bool]:
    """Train `model`'s trainable parameters for cfg.steps steps.

    `step_loss(step)` returns the step's losses ({"loss": tensor, other figures...}; None when
    its batch has nothing to learn from); `held_out()` the held-out figures ({"eval_...": ...}),
    computed every `eval_every` steps and at the end. Returns (the last log record, wall seconds
    trained, finished: False when the run stopped early at `stop_at`)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    step, wall = state.restore(model, opt, say)
    model.train()
    started = time.perf_counter()
    rec: dict = {}
    with bar(label, cfg.steps, step) as update:
        while step < cfg.steps:
            for g in opt.param_groups:
                g["lr"] = lr_at(step, cfg)
            losses = step_loss(step)
            rec = {"step": step + 1}
            if losses is not None:
                opt.zero_grad(set_to_none=True)
                losses["loss"].backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                rec |= {k: v.item() for k, v in losses.items() if isinstance(v, torch.Tensor) and v.dim() == 0}
            step += 1
            now = time.perf_counter()
            wall += now - started
            started = now
            rec |= {"lr": lr_at(step - 1, cfg), "wall_s": round(wall, 1)}
            if step % cfg.eval_every == 0 or step == cfg.steps:
                rec |= evaluated(model, held_out)
            state.log(rec)
            update(status=status_line(rec))
            if state.end_of_step(model, opt, step, wall, cfg, say):
                return rec, wall, False
            started = time.perf_counter()
    if not any(k.startswith("eval_") for k in rec):
        rec |= evaluated(model, held_out)
    return rec, wall, True


def evaluated(model: torch.nn.Module, held_out: Callable[[], dict]) -> dict:
    """Held-out figures, computed in eval mode without gradients."""
    model.eval()
    with torch.no_grad():
        figures = held_out()
    model.train()
    return figures


def status_line(rec: dict) -> str:
    text = f"loss {rec.get('loss', math.nan):.3f} agree {rec.get('agree', math.nan):.2f}"
    if "eval_tokens_per_pass" in rec:
        return text + f" held-out {rec['eval_tokens_per_pass']:.2f} tok/pass"
    return text + (f" held-out {rec['eval_agree']:.2f}" if "eval_agree" in rec else "")
