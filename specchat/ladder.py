"""`specchat ladder`: one speculative profile at every draft depth, against target-only, in one run.

More depth is not always more speed: each extra drafted token must be accepted often enough to
pay for drafting and verifying it. The ladder loads the model once, and for every prompt runs
target-only and then each depth in turn (so a slow spell of a shared machine hits every rung
alike), and reports per depth: tokens per pass and per drafted pass, acceptance by position, decode
tok/s, speed-up and what a drafted pass costs in target-only steps, with the best depth and where
the plateau starts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from specchat.backends.base import BackendError
from specchat.bench import ProfileResult, Run, run_one, speedup, warm_up
from specchat.profiles import Profile
from specchat.prompts import PromptItem
from specchat.verify import fresh

PLATEAU_GAIN = 0.1  # a rung adding fewer tokens per drafted pass than this is on the plateau


def parse_depths(text: str) -> list[int]:
    """'1-6' or '1,2,4' (or a mix) -> sorted depths."""
    depths: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            depths.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise BackendError(f"--depths '{text}': expected a range like 1-6 or a list like 1,2,4") from None
    if not depths or min(depths) < 1 or max(depths) > 64:
        raise BackendError(f"--depths '{text}': depths run from 1 to 64")
    return sorted(depths)


@dataclass
class Ladder:
    reference: ProfileResult
    rungs: list[tuple[int, ProfileResult]]

    @property
    def results(self) -> list[ProfileResult]:
        return [self.reference] + [r for _, r in self.rungs]

    def speedup(self, res: ProfileResult) -> float:
        return speedup(self.results, res) or 0.0

    def pass_cost(self, res: ProfileResult) -> float:
        """Time of one pass in target-only decoding steps: drafting plus verifying the block.
        A depth pays when its passes yield more tokens than this."""
        sp = self.speedup(res)
        return res.tokens_per_pass() / sp if sp else 0.0

    def best_depth(self) -> int:
        return max(self.rungs, key=lambda dr: self.speedup(dr[1]))[0]

    def plateau_depth(self) -> Optional[int]:
        """The first depth whose next rung adds less than PLATEAU_GAIN tokens per drafted pass."""
        for (d, r), (_, nxt) in zip(self.rungs, self.rungs[1:]):
            if nxt.mean_accepted() - r.mean_accepted() < PLATEAU_GAIN:
                return d
        return None


def check(profile: Profile) -> None:
    if profile.method == "none":
        raise BackendError(f"profile '{profile.name}' has no speculative method; the ladder needs one "
                           "(e.g. smollm2-mtp, smollm2-ngram)")
    if profile.backend != "torch":
        raise BackendError(f"profile '{profile.name}': the ladder runs the torch engine's speculative loop")


def run_ladder(profile: Profile, depths: list[int], prompts: list[PromptItem],
               on_run: Callable[[str, Run], None] = lambda label, r: None) -> Ladder:
    from specchat.loading import load_speculative

    check(profile)
    spec = load_speculative(profile)
    spec.adaptive = False  # each rung drafts at its depth on every pass, so the rungs measure the depth
    most = spec.drafter.max_depth
    if most is not None and max(depths) > most:
        spec.close()
        raise BackendError(f"profile '{profile.name}': its {spec.drafter.name} drafter proposes at most {most} "
                           f"tokens per pass; use --depths 1-{most}")
    try:
        ref_profile = profile.target_only()
        reference = ProfileResult(ref_profile.name, ref_profile)
        rungs = []
        for d in depths:
            p = profile.model_copy(update={"name": f"{profile.name}@{d}",
                                           "speculative": profile.speculative.model_copy(update={"depth": d})})
            rungs.append((d, ProfileResult(p.name, p, reference=reference.label)))
        warm_up(spec.target, ref_profile)
        warm_up(spec, profile)
        # every run from an empty cache, as `verify` runs: a run that found the prompt cached by the one
        # before would take its first token from a one-row pass instead of the prefill's last row (other
        # arithmetic, so near-ties may fall the other way) and its TTFT without the prefill
        for item in prompts:
            run = run_one(fresh(spec.target), ref_profile, item)
            reference.runs.append(run)
            on_run(reference.label, run)
            for d, res in rungs:
                spec.depth = d
                run = run_one(fresh(spec), res.profile, item)
                res.runs.append(run)
                on_run(res.label, run)
    finally:
        spec.close()
    return Ladder(reference, rungs)


def to_json(ladder: Ladder) -> dict:
    return {
        "reference": {"label": ladder.reference.label, "decode_tok_s": ladder.reference.decode_tok_s(),
                      "prompts": len(ladder.reference.runs)},
        "rungs": [{"depth": d, "mean_accepted": r.mean_accepted(), "acceptance_by_position": r.acceptance_by_position(),
                   "decode_tok_s": r.decode_tok_s(), "speedup": ladder.speedup(r),
                   "tokens_per_pass": r.tokens_per_pass(), "pass_cost": ladder.pass_cost(r), "tokens": r.tokens()}
                  for d, r in ladder.rungs],
        "best_depth": ladder.best_depth(), "plateau_depth": ladder.plateau_depth(),
    }


def render(ladder: Ladder):
    """A rich table plus bar charts of tokens per drafted pass and speed-up per depth."""
    from rich.console import Group
    from rich.text import Text

    from specchat.bench import compact_table, tok_s

    table = compact_table(f"specchat ladder · {ladder.rungs[0][1].profile.name.rsplit('@', 1)[0]}",
                          "t/pass: tokens per target pass · t/dp: tokens per drafted pass · by position: % of drafts accepted at "
                          "position 1, 2, … · pass cost: see below")
    table.add_column("depth", no_wrap=True)
    for col in ("t/pass", "t/dp"):
        table.add_column(col, justify="right", no_wrap=True)
    table.add_column("by position %", min_width=13)  # the one column that wraps, between its numbers
    for col in ("pass cost", "tok/s", "speed-up"):
        table.add_column(col, justify="right", no_wrap=True)
    table.add_row("target-only", "1.00", "-", "", "1.00", tok_s(ladder.reference.decode_tok_s()), "1.00x")
    best = ladder.best_depth()
    for d, r in ladder.rungs:
        pos = " ".join(f"{a:.0%}".rstrip("%") for a in r.acceptance_by_position())
        sp = f"{ladder.speedup(r):.2f}x"
        table.add_row(str(d), f"{r.tokens_per_pass():.2f}", f"{r.mean_accepted():.2f}", pos, f"{ladder.pass_cost(r):.2f}", tok_s(r.decode_tok_s()),
                      f"[bold green]{sp}[/]" if d == best else sp)
    width = 40
    top_acc = max(r.mean_accepted() for _, r in ladder.rungs) or 1.0
    top_sp = max([ladder.speedup(r) for _, r in ladder.rungs] + [1.0])
    chart = Text()
    chart.append("tokens per drafted pass", style="bold")
    chart.append(" " * (width - 11) + "speed-up vs target-only\n", style="bold")
    for d, r in ladder.rungs:
        acc, sp = r.mean_accepted(), ladder.speedup(r)
        a_bar = "█" * round(width / 2 * acc / top_acc)
        s_bar = "█" * round(width / 2 * sp / top_sp)
        chart.append(f"{d:>2} ")
        chart.append(f"{a_bar:<{width // 2}}", style="cyan")
        chart.append(f" {acc:4.2f}   ")
        chart.append(f"{s_bar:<{width // 2}}", style="green" if sp >= 1 else "red")
        chart.append(f" {sp:4.2f}x\n")
    plateau = ladder.plateau_depth()
    verdict = Text(f"best depth {best} ({ladder.speedup(dict(ladder.rungs)[best]):.2f}x target-only); ")
    verdict.append(f"plateau from depth {plateau}: deeper drafts add < {PLATEAU_GAIN} tokens per drafted pass"
                   if plateau else "no plateau within these depths")
    d, r = ladder.rungs[0]
    verdict.append(f"\npass cost: target-only steps per pass (drafting plus verifying); a depth pays when its passes "
                   f"yield more tokens than that. At depth {d} a pass costs {ladder.pass_cost(r):.2f} steps")
    drafted_every_pass = abs(r.tokens_per_pass() - r.mean_accepted()) < 0.02
    if d == 1 and drafted_every_pass and r.acceptance_by_position() and ladder.pass_cost(r) > 1:
        verdict.append(f", so the drafted token must be accepted more than {ladder.pass_cost(r) - 1:.0%} of the time "
                       f"to pay (measured: {r.acceptance_by_position()[0]:.0%})")
    return Group(table, "", chart, verdict)

