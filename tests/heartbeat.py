"""A line at least every EVERY_S seconds in `make test`'s log (hooks used by conftest.py).

pytest -q prints a dot per finished test and a newline every ~80 of them; a slow test (a server,
a training) or a run of ~80 quick ones can leave a piped log without a new line for minutes. The
controller process (with xdist it hears every worker's tests start and finish) prints a line naming
what runs, for how long, and how far the suite is, whenever EVERY_S seconds passed since its last one.
"""

from __future__ import annotations

import os
import threading
import time

EVERY_S = 25.0  # a piped log never goes 30 s without a line


class Heartbeat:
    def __init__(self, reporter, every_s: float = EVERY_S, capture=None):
        # capture: pytest's capture manager. Without xdist a test's output capture holds the
        # terminal while it runs; the line then goes straight to the terminal's own file
        # descriptor, which the capture saved (`_terminal_fd`). Suspending the capture from this
        # thread instead swaps sys.stdout under a running test: a CliRunner's stream it replaced
        # is dropped, closed, and the test fails with "I/O operation on closed file".
        self.reporter, self.every_s, self.capture = reporter, every_s, capture
        self.running: dict[str, float] = {}
        self.done = 0
        self.total: int | None = None
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="test-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def line(self, now: float) -> str:
        longest = sorted(self.running.items(), key=lambda kv: kv[1])[:2]
        what = ", ".join(f"{nodeid} ({now - t0:.0f}s)" for nodeid, t0 in longest) or "collecting or between tests"
        of = f"/{self.total}" if self.total else ""
        return f"[{(now - self.started) / 60:.1f} min, {self.done}{of} tests done] running: {what}"

    def _beat(self) -> None:
        while not self._stop.wait(self.every_s):
            text = self.line(time.monotonic())
            if self.capture is None:
                self.reporter.write_line(text)
                continue
            fd = _terminal_fd(self.capture)
            try:
                if fd is None:  # capture by sys.stdout only: file descriptor 1 is still the terminal
                    fd = 1
                os.write(fd, f"\n{text}\n".encode())
            except OSError:  # never the suite's failure
                continue


def _terminal_fd(capture) -> int | None:
    """The terminal's file descriptor that pytest's fd capture saved before redirecting fd 1."""
    out = getattr(getattr(capture, "_global_capturing", None), "out", None)
    return getattr(out, "targetfd_save", None)


_BEAT: list[Heartbeat] = []


def pytest_sessionstart(session):
    """Started here, not in pytest_configure: the terminal reporter registers itself in its own
    pytest_configure, which may run after conftest's."""
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller prints
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and not _BEAT:
        _BEAT.append(Heartbeat(reporter, capture=session.config.pluginmanager.get_plugin("capturemanager")))
        _BEAT[0].start()


def pytest_collection_finish(session):
    if _BEAT:
        _BEAT[0].total = len(session.items)


def pytest_xdist_node_collection_finished(node, ids):
    if _BEAT:
        _BEAT[0].total = len(ids)


def pytest_runtest_logstart(nodeid, location):
    if _BEAT:
        _BEAT[0].running.setdefault(nodeid, time.monotonic())


def pytest_runtest_logfinish(nodeid, location):
    if _BEAT:
        _BEAT[0].running.pop(nodeid, None)
        _BEAT[0].done += 1


def pytest_unconfigure(config):
    if _BEAT and not hasattr(config, "workerinput"):
        _BEAT.pop().stop()
