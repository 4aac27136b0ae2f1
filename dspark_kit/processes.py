"""The one supervisor for the processes the kit starts (servers, trainers), and its one stop policy.

`start` runs a command in its own process group (so a stop reaches every worker it forks) and
ties it to the kit; `stop` is the only way the kit ends one:

    SIGTERM once to every process: to the whole group, and to each descendant that left it
    (torchrun starts its workers in sessions of their own) once its parent can no longer pass
    it on (torchrun's agent forwards it to its workers; a parent that died does not); `grace_s`
    for all of them to exit (a trainer saves an "interrupted" checkpoint, a server drains);
    then SIGKILL to whatever is left, to every descendant. Once, because a second SIGTERM that
    lands while speculators' handler runs deadlocks the trainer (graceful_shutdown.py takes a
    non-reentrant lock in the handler): measured, 1 stop in 6 hung for the whole grace and lost
    its save when each process got two or three.

Every supervised process dies with the kit process that started it:
- SIGTERM / SIGHUP / SIGINT to the kit: a handler signals every live group (SIGTERM), then
  raises SystemExit / KeyboardInterrupt so the callers' `finally: stop(...)` blocks run;
- SIGKILL of the kit (no handler runs): the child gets SIGTERM from the kernel (Linux prctl
  PR_SET_PDEATHSIG, set between fork and exec); the local engine also polls its parent pid
  (PARENT_PID_ENV) and exits when it changes.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import signal
import subprocess
import sys
import threading
import time
import weakref

PARENT_PID_ENV = "DSPARK_KIT_PARENT_PID"  # the local engine exits when its parent is gone
KILL_WAIT_S = 10.0  # after SIGKILL: only a process stuck in the kernel (D state) takes this long

# Signals are process-wide, so the processes a handler must reach are too: these registries are
# what the handler and atexit read; no caller's behaviour depends on them.
_LIVE: weakref.WeakSet = weakref.WeakSet()  # started and not yet stopped
_TERMED: set[int] = set()  # process groups already sent SIGTERM (by the kit's signal handler)
_HANDLED = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
_installed = False
_PRCTL = None  # libc's prctl, looked up in the parent: the child must not import or load anything


def _signal_live(sig: int = signal.SIGTERM) -> None:
    for proc in list(_LIVE):
        if proc.poll() is None and proc.pid not in _TERMED:
            _killpg(proc.pid, sig)
            if sig == signal.SIGTERM:
                _TERMED.add(proc.pid)


def signal_exit_code(signum: int) -> int:
    """The exit status a shell gives a process ended by signal `signum` (128 + signum)."""
    return 128 + signum


class SignalStopped(SystemExit):
    """SIGTERM or SIGHUP reached the kit (`scancel`, a scheduler's preemption, `timeout`, a closed
    terminal): raised as Ctrl-C's KeyboardInterrupt is, so the callers' `finally` blocks stop what
    the kit started, and told as a stop, not a failure; exits with the status a shell gives."""

    def __init__(self, signum: int):
        super().__init__(signal_exit_code(signum))
        self.signal_name = signal.Signals(signum).name


def _on_signal(signum, frame) -> None:
    _signal_live(signal.SIGTERM)  # at once: stop() in the callers' finally blocks then waits for them
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SignalStopped(signum)


def install_signal_handlers() -> None:
    """Stop supervised processes when the kit is terminated (main thread; keeps handlers others set)."""
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    _installed = True
    for sig in _HANDLED:
        current = signal.getsignal(sig)
        if current in (signal.SIG_DFL, signal.default_int_handler):
            signal.signal(sig, _on_signal)
    atexit.register(_signal_live, signal.SIGTERM)


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
    """A preexec_fn that ties a child to this process (PDEATHSIG), or None off Linux / off the main
    thread (PDEATHSIG fires when the forking *thread* exits)."""
    prctl = _libc_prctl() if threading.current_thread() is threading.main_thread() else None
    return functools.partial(_die_with_parent, prctl, os.getpid(), int(signal.SIGTERM)) if prctl else None


def _die_with_parent(prctl, parent_pid: int, sig: int) -> None:
    """preexec_fn: the kernel sends `sig` to this child when the thread that forked it dies."""
    prctl(1, sig, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def start(argv: list[str], env: dict[str, str], **popen_kw) -> subprocess.Popen:
    """`argv` in its own process group, tied to the kit, stdin closed; `popen_kw`: its output."""
    install_signal_handlers()
    proc = subprocess.Popen(
        argv,
        env={**env, PARENT_PID_ENV: str(os.getpid())},
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # own process group: stop() signals the whole tree
        preexec_fn=die_with_parent_preexec(),  # noqa: PLW1509 - only calls prctl (looked up beforehand)
        **popen_kw,
    )
    _LIVE.add(proc)
    return proc


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _descendants(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _signal_family(proc: subprocess.Popen, family: list, sig: int) -> list:
    """`sig` to the group and to the descendants outside it. SIGTERM reaches each process once:
    a descendant outside the group whose parent is inside it is left to that parent (returned,
    with its parent's pid, for `stop` to signal once the parent is gone)."""
    import psutil

    once = sig == signal.SIGTERM
    if not (once and proc.pid in _TERMED):
        _killpg(proc.pid, sig)
        if once:
            _TERMED.add(proc.pid)
    in_group, deferred = {proc.pid}, []
    for p in family:  # parents before children (psutil walks the tree breadth first)
        with contextlib.suppress(psutil.Error, OSError):
            if not p.is_running():  # psutil checks the pid was not reused since the snapshot
                continue
            if once and os.getpgid(p.pid) == proc.pid:
                in_group.add(p.pid)  # the group's SIGTERM got it
            elif once and (parent := p.ppid()) in in_group:
                deferred.append((p, parent))  # torchrun's agent forwards it to its workers
            else:
                p.send_signal(sig)
    return deferred


def _term_orphans(deferred: list) -> list:
    """SIGTERM the deferred descendants whose parent is gone (it cannot forward any more); the rest."""
    import psutil

    left = []
    for p, parent in deferred:
        with contextlib.suppress(psutil.Error):
            if not p.is_running():
                continue
            if p.ppid() != parent or not psutil.pid_exists(parent):
                p.send_signal(signal.SIGTERM)
            else:
                left.append((p, parent))
    return left


def stop(proc: subprocess.Popen, grace_s: float) -> int | None:
    """The stop policy (module docstring): SIGTERM once to the group and every descendant, `grace_s`
    for them to exit, then SIGKILL; returns the leader's exit code (None: not even SIGKILL ended it)."""
    import psutil

    # the descendants before any exits: a worker whose parent is gone is reparented, out of reach
    family = _descendants(proc.pid)
    deferred = _signal_family(proc, family, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        deferred = _term_orphans(deferred)
        if proc.poll() is not None and not any(_running(p) for p in family):
            break
        time.sleep(0.1)
    # SIGKILL whatever is left, and sweep the group: the leader may be gone while forked children linger
    family = [p for p in family if _running(p)] + _descendants(proc.pid)
    _signal_family(proc, family, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=KILL_WAIT_S)
    psutil.wait_procs(family, timeout=KILL_WAIT_S)
    _LIVE.discard(proc)
    _TERMED.discard(proc.pid)
    return proc.returncode


def _running(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _watch(proc: subprocess.Popen, watch, stopped: list[str], grace_s: float, poll_s: float = 1.0) -> None:
    """Stop `proc` once `watch` reports what it needs is gone (else it would retry for minutes);
    the reason goes into `stopped`."""
    while proc.poll() is None:
        if (reason := watch()) is not None:
            stopped.append(reason)
            stop(proc, grace_s)
            return
        time.sleep(poll_s)


def _drain(stream, log) -> None:
    """What a stopping command still prints, into its log (redacted) until it closes its output."""
    from dspark_kit.redact import redact_text

    with contextlib.suppress(OSError, ValueError):  # closed under us: the command is gone anyway
        for line in stream:
            log.write(redact_text(line))


def run_logged(argv: list[str], env: dict[str, str], log_path, *, watch=None, echo: bool = False,
               on_line=None, grace_s: float = 30.0) -> tuple[int, str | None]:
    """Run a command to its end, its output appended to `log_path` (secrets redacted) and echoed to
    stderr (`echo`) or fed line by line to `on_line`; returns (exit code, why it was stopped or None).

    `watch`: polled every second; when it returns a reason (a server the command needs has exited)
    the command is stopped and that reason returned whatever the exit code. After a failing exit
    it is asked once more: the command may fail on the dead server before the watch's next look.
    """
    from pathlib import Path

    from dspark_kit.redact import redact_text

    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # line-buffered: the log is live (`tail -f`, and whoever waits for a line in it), not 8 KB behind
    with log_path.open("a", buffering=1) as log:
        proc = start(argv, {**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                     text=True)
        assert proc.stdout is not None
        stopped: list[str] = []
        watcher = None
        try:
            if watch is not None:
                watcher = threading.Thread(target=_watch, args=(proc, watch, stopped, grace_s), daemon=True,
                                           name="watch")
                watcher.start()
            for line in proc.stdout:
                line = redact_text(line)  # a command that echoes its argv: no key in the log or the terminal
                log.write(line)
                if echo:
                    sys.stderr.write(line)
                elif on_line is not None:
                    on_line(line)
            code = proc.wait()
        finally:  # Ctrl-C / SIGTERM to the kit included: the command (and anything it left) never outlives this
            # keep reading while it stops: a command that logs as it saves (speculators' `interrupted`
            # checkpoint) would block on a full pipe and be killed at the grace's end, unsaved
            drain = threading.Thread(target=_drain, args=(proc.stdout, log), daemon=True, name="drain")
            drain.start()
            stop(proc, grace_s)
            drain.join(timeout=KILL_WAIT_S)
            proc.stdout.close()
            if watcher is not None:
                watcher.join()  # it returns once the command has exited, with or without a reason
    if watcher is None:
        return code, None
    if stopped:
        return code, stopped[0]
    return code, watch() if code != 0 else None

