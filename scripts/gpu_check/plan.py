"""What the check runs where: the full grid and real shapes on CUDA, a smaller grid and a small
shape on CPU (`--cpu`, seconds: it keeps the script from rotting between GPU loans).

Budgets are seconds of wall time per part, in the order the parts run; on an H200 the CUDA
plan is meant to finish within 8 minutes with room to spare, so that a second try fits in the
device time a task gets. A part that runs out skips its remaining steps with a note.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

H200_TB_S = 4.8  # the H200's peak memory bandwidth (NVIDIA's datasheet), TB/s


@dataclass(frozen=True)
class Plan:
    device: str
    threads: int  # CPU threads for the engines (0: every physical core)
    precisions: tuple[str, ...]  # for logits and the parity grid
    parity_depths: tuple[int, ...]
    parity_prompts: int
    parity_tokens: int
    compiled_precision: str
    speed_shapes: tuple[str, ...]
    speed_precision: str
    compiled_speed_shapes: tuple[str, ...]
    prompt_tokens: int
    decode_tokens: int
    verify_rows: tuple[int, ...]
    repeats: int
    peak_tb_s: float | None  # nominal peak memory bandwidth; None: only the measured one
    budgets: dict[str, float] = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return sum(self.budgets.values())

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    def engine(self, **kw) -> dict:
        """Keyword arguments for every TorchBackend the check makes."""
        return dict(device=self.device, threads=self.threads) | kw


def cuda_plan(threads: int = 0, peak_tb_s: float = H200_TB_S) -> Plan:
    return Plan(device="cuda", threads=threads, precisions=("float32", "bfloat16"), parity_depths=(1, 3, 6),
                parity_prompts=2, parity_tokens=40,
                compiled_precision="bfloat16",  # what a CUDA profile runs (dtype auto)
                speed_shapes=("qwen3-8b", "smollm2-135m"), speed_precision="bfloat16",
                compiled_speed_shapes=("qwen3-8b", "smollm2-135m"),
                prompt_tokens=128, decode_tokens=128, verify_rows=tuple(range(1, 17)), repeats=2,
                peak_tb_s=peak_tb_s,
                budgets={"logits": 40, "parity": 100, "compiled": 100, "speed": 80, "speed_compiled": 90})


def cpu_plan(threads: int = 0) -> Plan:
    # float32 for the compiled part: on CPU that is the precision whose compile=True takes the
    # static-shape path CUDA takes (bfloat16 and int4 go through exact_rows' compiled row graphs)
    return Plan(device="cpu", threads=threads, precisions=("float32", "bfloat16"), parity_depths=(3,),
                parity_prompts=1, parity_tokens=24, compiled_precision="float32",
                speed_shapes=("cpu-small",), speed_precision="float32", compiled_speed_shapes=("cpu-small",),
                prompt_tokens=32, decode_tokens=32, verify_rows=(1, 2, 4, 8, 16), repeats=2, peak_tb_s=None,
                budgets={"logits": 60, "parity": 120, "compiled": 120, "speed": 60, "speed_compiled": 90})
