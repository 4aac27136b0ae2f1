"""Output capture: what a stage prints goes to its log, and which logs a stage wrote.

`redirected` sends stdout and stderr into a log for a block, at the file-descriptor level when the
console has descriptors (so C extensions, loggers that kept a handle on stderr and child processes
are caught too); `tee_stderr` copies stderr into a log while it still shows; `log_states` and
`logs_written` tell which logs of a folder a stage wrote (shown when it fails). progress.py (what a
person sees) uses them; this module shows nothing.

Part of the core (layer 0): imports the standard library only.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO


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
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    original = sys.stderr
    with open(path, "a") as log:
        sys.stderr = _Tee(original, log)
        try:
            yield
        finally:
            sys.stderr = original


@contextlib.contextmanager
def redirected(log: Path, console: TextIO, by_descriptor: bool) -> Iterator[None]:
    """stdout and stderr into `log` for the block: descriptors 1 and 2 when the console has them
    (catches C code and child processes), else the Python streams."""
    sys.stdout.flush()
    sys.stderr.flush()
    with open(log, "a", buffering=1, encoding="utf-8", errors="replace") as f:
        if not by_descriptor:
            old = sys.stdout, sys.stderr
            sys.stdout = sys.stderr = f
            try:
                yield
            finally:
                sys.stdout, sys.stderr = old
            return
        saved = [os.dup(1), os.dup(2)]
        try:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def log_states(folder: Path) -> dict[Path, tuple[int, int]]:
    """Size and modification time of every log in `folder` (what a stage then writes shows as a change)."""
    states = {}
    for p in Path(folder).glob("*.log"):
        try:
            st = p.stat()
        except OSError:
            continue
        states[p] = (st.st_size, st.st_mtime_ns)
    return states


def logs_written(folder: Path, before: dict[Path, tuple[int, int]], first: Path | None = None,
                 limit: int = 3) -> list[Path]:
    """Logs in `folder` that grew or changed since `before` (non-empty): `first`, then the most recent."""
    now = log_states(folder)
    found = [p for p, state in now.items() if state[0] > 0 and before.get(p) != state]
    found.sort(key=lambda p: (p != first, -now[p][1]))
    return found[:limit]
