"""`specchat ladder --plot FILE`: a matplotlib chart as PNG or SVG, and a bad FILE refused before any work."""
from __future__ import annotations

import math
from xml.etree import ElementTree

import pytest

from specchat import cli, loading, plot
from tests import results

SVG = "{http://www.w3.org/2000/svg}"


def shown_ticks(axis) -> list[str]:
    """The tick labels matplotlib drew on an axis (those within its view)."""
    lo, hi = sorted(axis.get_view_interval())
    return [label.get_text() for loc, label in zip(axis.get_majorticklocs(), axis.get_ticklabels())
            if lo - 1e-9 <= loc <= hi + 1e-9]


def test_png_and_svg_are_drawn_by_matplotlib(tmp_path):
    result = results.ladder("smollm2-mtp", range(1, 7))
    png, svg = tmp_path / "ladder.png", tmp_path / "ladder.svg"
    plot.write_ladder_plot(result, str(png))
    plot.write_ladder_plot(result, str(svg))
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and png.stat().st_size > 10_000

    fig = plot.figure(result)
    fig.canvas.draw()
    ax = fig.axes[0]
    ticks = shown_ticks(ax.yaxis)
    values = [float(t) for t in ticks]
    step = values[1] - values[0]
    assert all(math.isclose(b - a, step) for a, b in zip(values, values[1:]))
    assert step / 10 ** math.floor(math.log10(step)) in (1, 2, 2.5, 5)  # round ticks, matplotlib's choice
    assert shown_ticks(ax.xaxis) == [str(d) for d in range(1, 7)]  # whole depths only

    texts = {t.text for t in ElementTree.parse(svg).getroot().iter(f"{SVG}text")}  # the same ticks, as SVG text
    assert set(ticks) <= texts and {str(d) for d in range(1, 7)} <= texts
    assert {"draft depth (tokens drafted per pass)", "tokens per pass · speed-up (×)"} <= texts  # axis labels
    assert {"tokens per drafted pass", "speed-up vs target-only", f"best depth ({result.best_depth()})"} <= texts
    assert "specchat ladder · smollm2-mtp" in texts  # the title names the profile


@pytest.mark.parametrize("name, says", [("ladder.pdf", "give a file name ending in .png or .svg"),
                                        ("ladder", "give a file name ending in .png or .svg"),
                                        ("missing/ladder.png", "no such folder"),
                                        (".", "give a file name ending in .png or .svg")])
def test_a_bad_plot_file_is_one_line_before_any_model_loads(tmp_path, monkeypatch, capsys, name, says):
    def no_model(*a, **k):
        raise AssertionError("a model was loaded before --plot was checked")

    monkeypatch.setattr(loading, "load_speculative", no_model)
    monkeypatch.setattr(loading, "load_backend", no_model)
    assert cli.main(["ladder", "-p", "smollm2-ngram", "--plot", str(tmp_path / name)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.endswith("\n") and len(captured.err.splitlines()) == 1
    assert captured.err.startswith("specchat: error: --plot ") and says in captured.err


def test_a_folder_named_like_a_chart_is_refused(tmp_path):
    (tmp_path / "chart.svg").mkdir()
    assert "is a folder" in plot.plot_problem(str(tmp_path / "chart.svg"))
    assert plot.plot_problem(str(tmp_path / "new.PNG")) is None  # the suffix in any case
