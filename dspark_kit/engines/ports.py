"""Where a server listens: one decision, the same for `--dry-run` and the run.

A configured port (serve.port, serve.hidden_states_port) is honoured: the run refuses it, before
anything loads, when something already listens there. Port 0 asks for any free port; it is taken
when the plan is made, and the plan says so (`Port.chosen_at_start`), so a dry run and the run
it previews differ only there.
"""

from __future__ import annotations

import errno
import random
import socket
from dataclasses import dataclass
from pathlib import Path

from dspark_kit.recipe import ServeCfg

PORT_KEYS = {"chat": "serve.port", "spec": "serve.port", "hidden-states": "serve.hidden_states_port"}


class PortBusy(RuntimeError):
    pass


@dataclass(frozen=True)
class Port:
    number: int
    key: str  # the recipe key it comes from
    chosen_at_start: bool  # the key is 0: a free port taken when the plan was made

    @property
    def source(self) -> str:
        return f"{self.key} 0: a free port taken when the plan is made" if self.chosen_at_start else self.key


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free right now (bind port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports_in_a_row(count: int, host: str = "127.0.0.1") -> int:
    """The first of `count` consecutive ports free right now, for a server that listens on several
    (mooncake_master: its RPC port and the HTTP port next to it). Picked below the kernel's ephemeral
    range, where no outgoing connection (and no `free_port`) takes one between the check and the
    server's bind. `free_port() + 1` is the worst choice: Linux gives bind(port 0) odd ports and
    outgoing connections even ones, so the port after a free one is where connections land."""
    low, _ = _ephemeral_range()
    rng = random.SystemRandom()
    for _ in range(200):
        first = rng.randrange(10000, low - count)
        if not any(port_in_use(host, p) for p in range(first, first + count)):
            return first
    raise PortBusy(f"no {count} consecutive free ports found below {low}")


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out for port 0 and outgoing connections (Linux's default elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def decide_port(serve: ServeCfg, role: str, host: str | None = None) -> Port:
    """The port `role`'s server listens on: its recipe key (in `serve`, the recipe's serve section),
    or a free one when that key is 0."""
    key = PORT_KEYS[role]
    configured = getattr(serve, key.split(".")[1])
    if configured == 0:
        return Port(free_port(host or serve.host), key, True)
    return Port(configured, key, False)


def port_in_use(host: str, port: int) -> str | None:
    """"in use" when something listens on `host:port` now, else None. Other bind errors (an address
    of another machine, a name that does not resolve) are the server's to report."""
    bind_host = "" if host in ("0.0.0.0", "::") else host
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is not "in use"
        try:
            s.bind((bind_host, port))
        except OSError as e:
            return "in use" if e.errno == errno.EADDRINUSE else None
    return None


def busy_message(port: Port, host: str, why: str) -> str:
    return (f"{port.key} {port.number} on {host} is {why}: stop what listens there, or set {port.key}: 0 "
            "to take a free port when the run starts")


def ensure_free(port: Port, host: str) -> None:
    """Refuse a configured port something else holds, before the server (and its model) loads."""
    if port.chosen_at_start:
        return
    why = port_in_use(host, port.number)
    if why:
        raise PortBusy(busy_message(port, host, why))


def ensure_others_free(ports: dict[str, int]) -> None:
    """Refuse ports a server listens on besides its own (mooncake_master's RPC and HTTP ports, on
    every interface) when something holds one, before it starts: it would die or join a stranger."""
    for key, number in ports.items():
        if port_in_use("0.0.0.0", number):
            raise PortBusy(f"{key} {number} is in use: stop what listens there (an earlier run's server?) "
                           f"or set {key.split()[0]} to a free port")
