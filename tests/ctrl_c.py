"""Ctrl-C as a terminal sends it, for tests that SIGINT a process they start.

A suite started in the background by a shell without job control (`make test &` in a script, nohup)
inherits SIGINT ignored, and the kit rightly keeps an ignored SIGINT ignored: without this reset in
the child, a test's Ctrl-C is lost (a serve hung on CI; a Slurm job ran on to COMPLETED)."""

from __future__ import annotations

import signal


def default_sigint() -> None:
    """preexec_fn: SIGINT back to its default in the child, as a terminal's Ctrl-C finds it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
