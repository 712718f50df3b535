"""`specchat ladder --plot FILE`: the ladder's chart, drawn with matplotlib as PNG or SVG (by the suffix).

matplotlib is imported only when a chart is drawn, and never through pyplot: the figure is drawn on
the Agg canvas, so no display is needed and no global backend is chosen.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from specchat.ladder import Ladder

FORMATS = (".png", ".svg")


def plot_problem(path: str) -> Optional[str]:
    """Why `--plot PATH` could not be written, in one line, or None: checked before any model loads."""
    target = Path(path)
    if target.suffix.lower() not in FORMATS:
        return f"--plot {path}: give a file name ending in .png or .svg"
    folder = target.parent
    if not folder.is_dir():
        return f"--plot {path}: no such folder {folder}"
    if target.is_dir():
        return f"--plot {path}: is a folder; give a file name"
    if not os.access(folder, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        return f"--plot {path}: not writable"
    if importlib.util.find_spec("matplotlib") is None:
        return "--plot needs matplotlib: pip install 'matplotlib>=3.8'"
    return None


def figure(ladder: "Ladder") -> "Figure":
    """Tokens per drafted pass and speed-up per depth, against target-only's 1.0, best depth marked."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    from specchat.bench import tok_s

    depths = [d for d, _ in ladder.rungs]
    speedups = [ladder.speedup(r) for _, r in ladder.rungs]
    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(depths, [r.mean_accepted() for _, r in ladder.rungs], "o-", label="tokens per drafted pass")
    ax.plot(depths, speedups, "s-", label="speed-up vs target-only")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--", label="target-only")
    best = ladder.best_depth()
    ax.plot([best], [speedups[depths.index(best)]], "*", ms=14, color="tab:green", label=f"best depth ({best})")
    plateau = ladder.plateau_depth()
    if plateau is not None:
        ax.axvline(plateau, color="tab:red", lw=0.8, ls=":", label=f"plateau from depth {plateau}")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(bottom=0)
    ax.set_xlabel("draft depth (tokens drafted per pass)")
    ax.set_ylabel("tokens per pass · speed-up (×)")
    name = ladder.rungs[0][1].profile.name.rsplit("@", 1)[0]
    prompts = len(ladder.reference.runs)
    ax.set_title(f"specchat ladder · {name}\n{prompts} prompt{'s' * (prompts != 1)}, target-only "
                 f"{tok_s(ladder.reference.decode_tok_s())} tok/s", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def write_ladder_plot(ladder: "Ladder", path: str) -> None:
    import matplotlib

    fig = figure(ladder)
    svg = Path(path).suffix.lower() == ".svg"
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "specchat"}):  # SVG text stays text
        fig.savefig(path, dpi=120, metadata={"Date": None} if svg else None)
