"""Render the A/B split view to an SVG for the README, with Textual's own screenshot.

    python scripts/readme_screenshot.py

It runs the real default model, SmolLM2-135M-Instruct, with the shipped profile `smollm2-ngram`
(prompt lookup) on the left and its target-only reference on the right, exactly as
`specchat ab -p smollm2-ngram` would, on one fixed prompt that copies text. It waits until the
verdict (identical / near-tie / mismatch, and the decode speed-up) is shown, then writes the
screen of a 120x36 terminal to `docs/ab-view.svg`.

Needs: the package installed (`pip install -e .`) and the default model in the cache, fetched
once with `specchat pull`; no network, no GPU. It takes a minute or two on a 2-core CPU (the
model loads twice, once per side, and the two replies run one after the other). History is
off, so nothing is written to `history.db`.

The timings in the picture (TTFT, tok/s, speed-up) are this machine's, measured in the run, so
they differ from run to run; the tokens and the verdict do not (greedy, fixed seed).

Options: `--profile NAME` (another speculative profile), `--prompt TEXT`, `--out PATH`,
`--size 120x36`, `--timeout SECONDS` (how long to wait for the model and the verdict).
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "docs" / "ab-view.svg"
DEFAULT_PROFILE = "smollm2-ngram"
DEFAULT_PROMPT = ("Repeat this sentence exactly: The quick brown fox jumps over the lazy dog "
                  "near the quiet river bank.")


def check_model(profile_name: str) -> None:
    """Stop with one line (exit 2) when the profile is unknown or its model is not on this machine,
    instead of a TUI that waits for a model that cannot load."""
    from specchat.backends.base import BackendError
    from specchat.models import resolve_model
    from specchat.profiles import ProfileError, load_profiles

    try:
        profile = load_profiles().get(profile_name)
        ref = resolve_model(profile.model, profile.base_dir, fetch=False)
    except (ProfileError, BackendError) as e:
        sys.exit(f"readme_screenshot: {e}")
    if ref.kind == "gguf" and not Path(ref.location).exists():
        sys.exit(f"readme_screenshot: the model of {profile_name} is not in the cache "
                 f"({ref.location}); run `specchat pull` once first")


async def wait_until(pilot, predicate, timeout: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        if loop.time() > end:
            raise SystemExit(f"readme_screenshot: timed out after {timeout:.0f} s waiting for {what}")
        await pilot.pause(0.1)


async def render(profile_name: str, prompt: str, size: tuple[int, int], timeout: float) -> tuple[str, str]:
    """The SVG of the A/B screen once the verdict is in, and the verdict's line."""
    from specchat.tui.ab_screen import ABScreen
    from specchat.tui.app import SpecChatApp

    app = SpecChatApp(profile_name, history=False, start_ab=True)
    async with app.run_test(size=size) as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, ABScreen) and app.screen.ready, timeout,
                         "both models to load")
        ab = app.screen
        box = ab.query_one("#ab-prompt")
        box.text = prompt
        box.focus()
        await pilot.press("enter")
        await wait_until(pilot, lambda: ab.verdict is not None, timeout, "the verdict")
        await pilot.pause(0.2)
        app.clear_notifications()
        ab.set_focus(None)  # no cursor in the picture
        await pilot.pause(0.2)
        return app.export_screenshot(title=f"specchat ab -p {profile_name}"), ab.verdict.line()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=DEFAULT_PROFILE, help=f"speculative profile (default {DEFAULT_PROFILE})")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT, help="the one prompt to run")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the SVG (default docs/ab-view.svg)")
    ap.add_argument("--size", default="120x36", help="terminal size, COLUMNSxROWS (default 120x36)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for each stage (default 600)")
    args = ap.parse_args(argv)
    try:
        cols, rows = (int(x) for x in args.size.lower().split("x"))
    except ValueError:
        ap.error(f"--size: expected COLUMNSxROWS such as 120x36, got {args.size!r}")

    check_model(args.profile)
    svg, verdict = asyncio.run(render(args.profile, args.prompt, (cols, rows), args.timeout))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(svg, encoding="utf-8")
    print(f"{args.out}: {len(svg.encode()):,} bytes; verdict: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
