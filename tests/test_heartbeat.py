"""`make test`'s heartbeat (tests/heartbeat.py): a line naming the longest-running tests every EVERY_S."""

from __future__ import annotations

import time

import pytest
from heartbeat import Heartbeat


class Reporter:
    def __init__(self):
        self.lines: list[str] = []

    def write_line(self, text: str) -> None:
        self.lines.append(text)


def test_the_heartbeat_names_what_runs_and_how_far_the_suite_is():
    beat = Heartbeat(Reporter(), every_s=0.05)
    beat.total, beat.done = 10, 3
    now = time.monotonic()
    beat.running = {"tests/test_a.py::test_slow": now - 75, "tests/test_b.py::test_x": now - 5,
                    "tests/test_c.py::test_y": now - 1}
    line = beat.line(now)
    assert "3/10 tests done" in line
    assert line.endswith("running: tests/test_a.py::test_slow (75s), tests/test_b.py::test_x (5s)")
    beat.running = {}
    assert beat.line(now).endswith("running: collecting or between tests")


def test_it_prints_while_nothing_else_does_and_stops():
    reporter = Reporter()
    beat = Heartbeat(reporter, every_s=0.05)
    t0 = time.monotonic()
    beat.start()
    deadline = t0 + 30  # waits on the heartbeat's own lines, not on wall time (a loaded machine wakes it late)
    while len(reporter.lines) < 2:
        assert time.monotonic() < deadline, "no two heartbeat lines in 30 s"
        time.sleep(0.01)
    beat.stop()
    beat._thread.join(30)  # a line being written as it was stopped is in before counting
    n = len(reporter.lines)
    assert 2 <= n <= (time.monotonic() - t0) / 0.05 + 1, reporter.lines  # at most one per 0.05 s
    time.sleep(0.15)
    assert len(reporter.lines) == n  # stopped


@pytest.mark.slow  # starts a process
def test_an_install_that_prints_nothing_still_leaves_a_line_and_its_exit_code(capfd):
    """scripts/heartbeat.py wraps the Makefile's silent installs (pip -q): the command's output passes
    through untouched, a line names what runs while it is silent, and its exit code is kept."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "heartbeat.py"  # not tests/heartbeat.py
    spec = importlib.util.spec_from_file_location("install_heartbeat", path)
    hb_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hb_script)

    silent = "import time; print('start', flush=True); time.sleep(1.2); raise SystemExit(3)"
    code = hb_script.run("installing x", [sys.executable, "-c", silent], every_s=0.3)
    out = capfd.readouterr().out.splitlines()
    assert code == 3 and out[0] == "start"
    beats = [ln for ln in out if ln.startswith("  ... installing x: still working (0m0")]
    assert len(beats) >= 2 and len(beats) == len(out) - 1, out  # 1.2 s of silence at one line per 0.3 s
