"""Start, health-check and stop any engine's ServerPlan the same way.

The server runs under the kit's one process supervisor (dspark_kit.processes: its own process
group, tied to the kit, one stop policy), so `stop()` also ends the workers a server may fork
(vLLM spawns engine cores); its output goes to a log file whose tail is quoted in every startup
error, because "server did not become healthy" is useless without the reason the server printed.

A 200 on the port proves nothing by itself: another process may take a port between the kit
choosing it and the server binding it. So health counts only when the listening socket belongs to
the started process or one of its descendants (`holds_port`). That works for every engine alike
(vLLM, whose /health and /v1/models the kit cannot add a token to without changing the ids the
trainer compares; the local engine; mooncake_master) and needs no cooperation from the server.
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Self

from dspark_kit import processes
from dspark_kit.engines import ServerPlan
from dspark_kit.logs import quoted_tail


class ServerStartError(RuntimeError):
    """The server died or never became healthy; the message quotes its log."""


def holds_port(pid: int, port: int) -> bool | None:
    """Whether `pid` or a descendant listens on TCP `port` (read from each process's own network
    namespace); None when the OS will not say (psutil cannot read the sockets here)."""
    import psutil

    try:
        root = psutil.Process(pid)
        family = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return False
    unknown = False
    for p in family:
        try:
            conns = p.net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        except psutil.AccessDenied:
            unknown = True
            continue
        if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns):
            return True
    return None if unknown else False


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
        self.proc = processes.start(self.plan.argv, {**os.environ, **self.plan.env},
                                    stdout=self._log_file, stderr=subprocess.STDOUT)
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
                    + quoted_tail(self.log_path)
                )
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        self._check_identity(url)
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() >= deadline:
                self.stop()
                raise ServerStartError(
                    f"server not healthy at {url} after {timeout:.0f}s (raise "
                    f"serve.startup_timeout if the model is large); log {self.log_path} ends with:\n"
                    + quoted_tail(self.log_path)
                )
            time.sleep(poll_s)

    def _check_identity(self, url: str) -> None:
        """Refuse a 200 from a process the kit did not start (module docstring)."""
        if holds_port(self.proc.pid, self.plan.port) is False:
            self.stop()
            key = self.plan.port_decision.key if self.plan.port_decision else "its port"
            raise ServerStartError(
                f"{url} answered, but not from the server this command started (pid {self.proc.pid} holds "
                f"no socket on port {self.plan.port}): another process took the port; stop it, or set {key} "
                "to another port (0: a free one), then rerun")

    def stop(self) -> int | None:
        """The supervisor's stop policy (SIGTERM to the group, grace_s, SIGKILL); returns the exit code."""
        if self.proc is None:
            return None
        code = processes.stop(self.proc, self.grace_s)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return code

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
