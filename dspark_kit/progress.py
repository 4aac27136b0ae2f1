"""What a person sees while the kit works: progress bars, notes, and `run`'s one line per stage.

Outside `run` (a stage command on its own) a progress bar is a rich bar on a terminal and
nothing elsewhere, and notes go to stderr (`STANDALONE`). Inside `run`, a `StageDisplay` shows the
stages, and its `reporter` is handed down to each stage's code (no global "current display"): each stage
is one line (live on a terminal: progress, rate, ETA; plain lines elsewhere, never redrawn),
replaced by its one-line result; everything the stage's code, its libraries and its child
processes print goes to the stage's log under DIR/logs (output_capture.py does the capture, at the
file-descriptor level), and when a stage fails the last lines of the logs it wrote are shown. `verbose` streams everything, as the
stage commands do.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Self, TextIO

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

from dspark_kit.logs import log_tail
from dspark_kit.output_capture import log_states, logs_written, redirected, tee_stderr
from dspark_kit.processes import SignalStopped

PLAIN_EVERY_S = 20.0  # a plain (non-terminal) progress line at most this often, and at least (heartbeat)
TAIL_LINES = 20  # log lines shown when a stage fails


class _Bar:
    def __init__(self, progress: Progress | None, task, unit: str):
        self._p, self._t, self.unit = progress, task, unit

    def advance(self, n: float = 1) -> None:
        if self._p is not None:
            self._p.advance(self._t, n)

    def describe(self, text: str) -> None:
        if self._p is not None:
            self._p.update(self._t, description=text)

    def total(self, total: float | None) -> None:
        if self._p is not None:
            self._p.update(self._t, total=total)


class _Rate(TextColumn):
    def __init__(self, unit: str):
        super().__init__("")
        self.unit = unit

    def render(self, task):
        speed = task.finished_speed or task.speed
        return f"{speed:,.1f} {self.unit}/s" if speed else f"- {self.unit}/s"


@contextlib.contextmanager
def progress_bar(label: str, total: int | None, unit: str = "it", enabled: bool = True) -> Iterator[_Bar]:
    """A stage command's bar for `label`: a rich bar on a terminal, nothing elsewhere (nor when not
    `enabled`, e.g. under --json)."""
    console = Console(stderr=True)
    if not enabled or (not console.is_terminal and not sys.stderr.isatty()):
        yield _Bar(None, None, unit)
        return
    cols = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TaskProgressColumn(),
            _Rate(unit), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn()]
    with Progress(*cols, console=console, transient=False) as p:
        yield _Bar(p, p.add_task(label, total=total), unit)


def note(message: str) -> None:
    """A stage command's human-readable status: on stderr (stdout stays clean for --json)."""
    print(message, file=sys.stderr, flush=True)


class Reporter:
    """How stage code shows its progress and notes, handed down to it (`stage.run(res, reporter)`,
    `run_training(..., reporter=...)`): nothing global decides it. This one is a stage command on
    its own (and `run -v`): progress_bar, note, and a child process's output echoed to the console."""

    echo_children = True  # copy a child process's output to the console (it is always logged)

    def bar(self, label: str, total: int | None, unit: str = "it") -> contextlib.AbstractContextManager[_Bar]:
        return progress_bar(label, total, unit)

    def note(self, message: str) -> None:
        note(message)

    @contextlib.contextmanager
    def doing(self, label: str, what: str) -> Iterator[None]:
        """A step with no count of its own: its line says what it is doing (the heartbeat repeats it)."""
        with self.bar(label, None) as bar:
            bar.describe(what)
            yield


STANDALONE = Reporter()


# ---- `run`: one line per stage ------------------------------------------------------


def _fmt_s(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}"


class StageLine:
    """One stage's progress: what the live line (or a plain progress line) says."""

    def __init__(self, name: str, clock=time.monotonic):
        self.name, self.clock = name, clock
        self.started = clock()
        self.detail = ""
        self.total: float | None = None
        self.count = 0.0
        self.unit = "it"
        self._since: float | None = None  # when counting started: the rate excludes start-up (model loading)
        self._base = 0.0  # the count then
        self._last: float | None = None  # when the count last moved: the rate is measured up to there

    def start_counting(self) -> None:
        if self._since is None:
            self._since, self._base = self.clock(), self.count

    def counted(self) -> None:
        """The count just moved (a bar's advance)."""
        self._last = self.clock()

    def rate(self) -> float | None:
        """Units per second from the start of counting to the count's last move (None until there is
        a second point): between moves it holds, so the ETA counts down instead of growing."""
        until = self._last if self._last is not None else self.clock()
        if self._since is None or self.count <= self._base or until <= self._since:
            return None
        return (self.count - self._base) / (until - self._since)

    def eta(self, rate: float) -> float:
        """Seconds left at `rate`, less the time since the count last moved."""
        waited = self.clock() - self._last if self._last is not None else 0.0
        return max(0.0, (self.total - self.count) / rate - waited)

    def text(self) -> str:
        parts = [self.name]
        if self.detail:
            parts.append(self.detail)
        if self.total:
            parts.append(f"{self.count:,.0f}/{self.total:,.0f} {self.unit}")
        elif self.count:
            parts.append(f"{self.count:,.0f} {self.unit}")
        rate = self.rate()
        if rate:
            parts.append(f"{rate:,.1f} {self.unit}/s" if rate >= 0.1 else f"{rate * 60:,.1f} {self.unit}/min")
            if self.total and self.count < self.total:
                parts.append(f"eta {_fmt_s(self.eta(rate))}")
        parts.append(_fmt_s(self.clock() - self.started))
        return "  ".join(parts)


class _LineBar(_Bar):
    """progress_bar's handle inside `run`: it moves the stage's line."""

    def __init__(self, display: StageDisplay, line: StageLine):
        super().__init__(None, None, line.unit)
        self.display, self.line = display, line

    def advance(self, n: float = 1) -> None:
        self.line.count += n
        self.line.start_counting()  # the first unit's own time is unknown: the rate counts from here
        self.line.counted()
        self.display.changed()

    def describe(self, text: str) -> None:
        self.line.detail = text
        self.display.changed()

    def total(self, total: float | None) -> None:
        """Announce the work (a unit starts now: the rate counts from here)."""
        self.line.total = total
        self.line.start_counting()
        self.display.changed()


class _LineReporter(Reporter):
    """Inside `run`: a bar moves the stage's line, a note goes above it (and into the stage's log),
    a child's output only into its log."""

    echo_children = False

    def __init__(self, display: StageDisplay):
        self.display = display

    @contextlib.contextmanager
    def bar(self, label: str, total: int | None, unit: str = "it") -> Iterator[_Bar]:
        yield self.display.line_bar(label, total, unit)

    def note(self, message: str) -> None:
        self.display.note(message)


class StageDisplay:
    """`run`'s console: `with StageDisplay() as d: with d.stage("train", log_path): ...`."""

    def __init__(self, stream: TextIO | None = None, *, verbose: bool = False, terminal: bool | None = None,
                 plain_every_s: float = PLAIN_EVERY_S):
        self.stream = stream or sys.stderr
        self.verbose = verbose
        self.terminal = self.stream.isatty() if terminal is None else terminal
        self.plain_every_s = plain_every_s
        self._out: TextIO = self.stream
        self._owned: TextIO | None = None
        self._line: StageLine | None = None
        self._live = None
        self._last_plain = 0.0
        self._said_at = time.monotonic()  # when the console last got a line (the heartbeat's clock)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._heart: threading.Thread | None = None

    # ---- lifetime ---------------------------------------------------------------
    def __enter__(self) -> Self:
        try:  # our own handle on the console, so redirecting fd 1/2 during a stage leaves it alone
            self._owned = os.fdopen(os.dup(self.stream.fileno()), "w", buffering=1, encoding="utf-8",
                                    errors="replace")
            self._out = self._owned
        except (AttributeError, OSError, ValueError):  # a stream without a descriptor (tests): use it as is
            self._out = self.stream
        if not self.terminal and not self.verbose:  # a pipe or CI log: never a silent half minute
            self._stop.clear()
            self._heart = threading.Thread(target=self._heartbeat, name="stage-heartbeat", daemon=True)
            self._heart.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._heart is not None:
            self._heart.join()
            self._heart = None
        if self._owned is not None:
            self._owned.close()
            self._owned = None

    def _heartbeat(self) -> None:
        """The running stage's line whenever the console has been silent for plain_every_s: what
        it does (its detail), its counts and its time, while a model loads or a server starts too."""
        tick = min(1.0, max(self.plain_every_s / 4, 0.01))
        while not self._stop.wait(tick):
            line = self._line
            if line is not None and time.monotonic() - self._said_at >= self.plain_every_s:
                self.say(f"  {line.text()}")

    @property
    def reporter(self) -> Reporter:
        """What the stages it shows report through: their lines (verbose: streamed, as stage commands)."""
        return STANDALONE if self.verbose else _LineReporter(self)

    def say(self, text: str) -> None:
        """A line on the console (above a live line)."""
        with self._lock:
            self._said_at = time.monotonic()
            if self._live is not None:
                self._live.console.print(text, highlight=False, markup=False, soft_wrap=True)
            else:
                self._out.write(text + "\n")
                self._out.flush()

    # ---- one stage --------------------------------------------------------------
    @contextlib.contextmanager
    def stage(self, name: str, log: Path) -> Iterator[StageLine]:
        """Run a stage's body under its line; its output goes to `log` (verbose: also to the console)."""
        log = Path(log)
        log.parent.mkdir(parents=True, exist_ok=True)
        if self.verbose:
            self.say(f"==> {name}")
            with tee_stderr(log):
                yield StageLine(name)
            return
        line = self._line = StageLine(name)
        before = log_states(log.parent)
        self._begin_line(line)
        try:
            with redirected(log, self.stream, self._owned is not None):
                yield line
        except BaseException as e:  # the error itself is the command's last line; here: what led to it
            self._end_line()
            # the user (Ctrl-C) or a scheduler (SIGTERM) stopped it: the logs' tails are no news
            stopped = isinstance(e, KeyboardInterrupt | SignalStopped)
            written = [] if stopped else logs_written(log.parent, before, first=log)
            how = f"stopped by {e.signal_name}" if isinstance(e, SignalStopped) else "interrupted" if stopped else "failed"
            self.say(f"x {name} {how} after {_fmt_s(line.clock() - line.started)}"
                     + ("; the last lines of its logs:" if written else ""))
            for path in written:
                self.say(f"  last lines of {path}:")
                for text in log_tail(path, TAIL_LINES) or []:
                    self.say(f"  | {text}")
            raise
        finally:
            self._end_line()
            self._line = None

    def result(self, name: str, text: str, seconds: float | None = None) -> None:
        """The stage's one-line result (skipped stages too)."""
        took = f" in {_fmt_s(seconds)}" if seconds is not None else ""
        self.say(f"{'✓' if self.terminal else '-'} {name}{took}: {text}" if text else f"- {name}{took}")

    def note(self, message: str) -> None:
        self.say(f"  {message}")
        if self._line is not None:  # the log keeps it too
            print(message, file=sys.stderr, flush=True)

    def line_bar(self, label: str, total: int | None, unit: str) -> _LineBar:
        line = self._line or StageLine(label)
        line.total, line.unit = total, unit
        if label != line.name:
            line.detail = label
        return _LineBar(self, line)

    def changed(self) -> None:
        """The line's numbers moved: a live line redraws itself; a plain one prints at most every few seconds."""
        line = self._line
        if line is None or self._live is not None or self.terminal:
            return
        now = line.clock()
        if now - self._last_plain >= self.plain_every_s:
            self._last_plain = now
            self.say(f"  {line.text()}")

    def _begin_line(self, line: StageLine) -> None:
        self._last_plain = line.clock()
        if not self.terminal:
            self.say(f"> {line.name}")
            return
        from rich.live import Live
        from rich.text import Text

        class _Render:
            def __rich__(self_inner):
                return Text(line.text(), no_wrap=True, overflow="ellipsis")

        console = Console(file=self._out, force_terminal=True)
        self._live = Live(_Render(), console=console, transient=True, refresh_per_second=4,
                          redirect_stdout=False, redirect_stderr=False)
        self._live.start()

    def _end_line(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
