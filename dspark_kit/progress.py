"""Progress bars with rate and ETA, quiet when stderr is not a terminal."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class _Bar:
    def __init__(self, progress: Progress | None, task, unit: str):
        self._p, self._t, self.unit = progress, task, unit

    def advance(self, n: float = 1) -> None:
        if self._p is not None:
            self._p.advance(self._t, n)

    def describe(self, text: str) -> None:
        if self._p is not None:
            self._p.update(self._t, description=text)


class _Rate(TextColumn):
    def __init__(self, unit: str):
        super().__init__("")
        self.unit = unit

    def render(self, task):
        speed = task.finished_speed or task.speed
        return f"{speed:,.1f} {self.unit}/s" if speed else f"- {self.unit}/s"


@contextlib.contextmanager
def progress_bar(label: str, total: int | None, unit: str = "it") -> Iterator[_Bar]:
    console = Console(stderr=True)
    if not console.is_terminal and not sys.stderr.isatty():
        yield _Bar(None, None, unit)
        return
    cols = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TaskProgressColumn(),
            _Rate(unit), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn()]
    with Progress(*cols, console=console, transient=False) as p:
        yield _Bar(p, p.add_task(label, total=total), unit)


def note(message: str) -> None:
    """Human-readable status on stderr, so stdout stays clean for --json."""
    print(message, file=sys.stderr, flush=True)


class _Tee:
    def __init__(self, *streams):
        self.streams = streams

    def write(self, data):
        for s in self.streams:
            s.write(data)
        return len(data)

    def flush(self):
        for s in self.streams:
            s.flush()

    def isatty(self):
        return self.streams[0].isatty()

    def fileno(self):
        return self.streams[0].fileno()


@contextlib.contextmanager
def tee_stderr(path):
    """Copy everything written to stderr during a stage into `path` (the stage's log)."""
    from pathlib import Path

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    original = sys.stderr
    with open(path, "a") as log:
        sys.stderr = _Tee(original, log)
        try:
            yield
        finally:
            sys.stderr = original
