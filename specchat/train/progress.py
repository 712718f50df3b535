"""A rich progress bar on stderr (quiet when stderr is not a terminal), with a live status text."""
from __future__ import annotations

import sys
from contextlib import contextmanager


@contextmanager
def bar(label: str, total: int, done: int = 0):
    """Yields update(advance=1, status='') ."""
    if not sys.stderr.isatty():
        yield lambda advance=1, status="": None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), TextColumn("{task.fields[status]}"), console=Console(stderr=True)) as p:
        task = p.add_task(label, total=total, completed=done, status="")

        def update(advance: int = 1, status: str = "") -> None:
            p.update(task, advance=advance, status=status)

        yield update
