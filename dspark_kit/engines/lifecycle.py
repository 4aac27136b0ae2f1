"""Start, health-check and stop any engine's ServerPlan the same way.

The server runs in its own process group so `stop()` also ends the workers a
server may fork (vLLM spawns engine cores); its output goes to a log file
whose tail is quoted in every startup error, because "server did not become
healthy" is useless without the reason the server printed.

Every server dies with the kit process that started it:
- SIGTERM / SIGHUP / SIGINT to the kit: a handler signals every live server's group,
  then raises SystemExit / KeyboardInterrupt so `finally: stop()` blocks run;
- SIGKILL of the kit (no handler runs): the child gets SIGTERM from the kernel
  (Linux prctl PR_SET_PDEATHSIG, set between fork and exec), and the local engine
  also polls its parent pid (DSPARK_KIT_PARENT_PID) and exits when it changes.
"""

from __future__ import annotations

import atexit
import functools
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path
from typing import Self

from dspark_kit.engines import ServerPlan


class ServerStartError(RuntimeError):
    """The server died or never became healthy; the message quotes its log."""


PARENT_PID_ENV = "DSPARK_KIT_PARENT_PID"  # the local engine exits when its parent is gone
_LIVE: weakref.WeakSet = weakref.WeakSet()  # servers started and not yet stopped
_HANDLED = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
_installed = False


def _signal_live_servers(sig: int = signal.SIGTERM) -> None:
    for server in list(_LIVE):
        if server.proc is not None and server.proc.poll() is None:
            server._signal_group(sig)


def _on_signal(signum, frame) -> None:
    _signal_live_servers(signal.SIGTERM)  # at once: stop() in the finally blocks then waits for them
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


def install_signal_handlers() -> None:
    """Stop managed servers when the kit is terminated (main thread; keeps handlers others set)."""
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    _installed = True
    for sig in _HANDLED:
        current = signal.getsignal(sig)
        if current in (signal.SIG_DFL, signal.default_int_handler):
            signal.signal(sig, _on_signal)
    atexit.register(_signal_live_servers, signal.SIGTERM)


_PRCTL = None  # libc's prctl, looked up in the parent: the child must not import or load anything


def _libc_prctl():
    global _PRCTL
    if _PRCTL is None:
        try:
            import ctypes

            _PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else False
        except (OSError, AttributeError):
            _PRCTL = False
    return _PRCTL


def die_with_parent_preexec():
    """A preexec_fn that ties a child to this process (PDEATHSIG), or None off Linux / off the main thread."""
    prctl = _libc_prctl() if threading.current_thread() is threading.main_thread() else None
    return functools.partial(_die_with_parent, prctl, os.getpid(), int(signal.SIGTERM)) if prctl else None


def _die_with_parent(prctl, parent_pid: int, sig: int) -> None:
    """preexec_fn: the kernel sends `sig` to this child when the thread that forked it dies."""
    prctl(1, sig, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def log_tail(path: Path, lines: int = 30) -> str:
    from dspark_kit.redact import redact_text

    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return redact_text("\n".join(text.splitlines()[-lines:])) or "(log is empty)"


class ManagedServer:
    """A server subprocess: `with ManagedServer(plan, log) as s: s.wait_healthy(60)`."""

    def __init__(self, plan: ServerPlan, log_path: Path, grace_s: float = 10.0):
        self.plan = plan
        self.log_path = Path(log_path)
        self.grace_s = grace_s
        self.proc: subprocess.Popen | None = None
        self._log_file = None

    @property
    def base_url(self) -> str:
        return self.plan.base_url

    def start(self) -> Self:
        if self.proc is not None:
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = self.log_path.open("ab")
        env = {**os.environ, **self.plan.env, PARENT_PID_ENV: str(os.getpid())}
        install_signal_handlers()
        # PDEATHSIG fires when the forking *thread* exits: only tie it to the main thread
        preexec = die_with_parent_preexec()
        self.proc = subprocess.Popen(
            self.plan.argv,
            env=env,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # own process group: stop() signals the whole tree
            preexec_fn=preexec,  # noqa: PLW1509 - only calls prctl (looked up beforehand)
        )
        _LIVE.add(self)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_healthy(self, timeout: float, poll_s: float = 0.2) -> None:
        """Block until GET health_path answers 200; raise ServerStartError otherwise."""
        if self.proc is None:
            self.start()
        url = self.plan.base_url + self.plan.health_path
        deadline = time.monotonic() + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ServerStartError(
                    f"server exited with code {code} before becoming healthy "
                    f"(command: {self.plan.shell_line()}); log {self.log_path} ends with:\n"
                    + log_tail(self.log_path)
                )
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() >= deadline:
                self.stop()
                raise ServerStartError(
                    f"server not healthy at {url} after {timeout:.0f}s (raise "
                    f"serve.startup_timeout if the model is large); log {self.log_path} ends with:\n"
                    + log_tail(self.log_path)
                )
            time.sleep(poll_s)

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self) -> int | None:
        """SIGINT, then SIGTERM, then SIGKILL to the whole group; returns the exit code."""
        if self.proc is None:
            return None
        for sig, wait_s in ((signal.SIGINT, self.grace_s), (signal.SIGTERM, self.grace_s / 2)):
            if self.proc.poll() is not None:
                break
            self._signal_group(sig)
            try:
                self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
        if self.proc.poll() is None:
            self._signal_group(signal.SIGKILL)
            self.proc.wait(timeout=10)
        # The leader may be gone while forked children linger: sweep the group.
        self._signal_group(signal.SIGKILL)
        _LIVE.discard(self)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return self.proc.returncode

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
