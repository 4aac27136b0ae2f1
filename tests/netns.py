"""Two network hosts on one machine: two namespaces joined by a veth pair (root only).

Host A is 10.77.0.1 on interface dkt<pid>a, host B 10.77.0.2 on dkt<pid>b: distinct
interface names, so each node's own choice of interface is visible. Neither namespace has
a route anywhere else (no default route, no bridge), so traffic only goes between the two.
Names carry this process's pid: a test bed left by a killed run (its pid gone) is removed,
with whatever still runs inside it, when the next one is made; a live run's is left alone.

`python -m tests.netns clean` removes leftover beds (`make two-hosts-check` runs it after pytest).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PREFIX = "dkt2h-"  # namespaces dkt2h-<pid>-a / -b
SUBNET = "10.77.0"
TIMEOUT_S = 20  # an `ip` call that takes longer is broken, not slow
_OURS = re.compile(rf"^{PREFIX}(\d+)-[ab]$")


class NetnsError(RuntimeError):
    """The test bed cannot be made here; the message says why in one line."""


@dataclass(frozen=True)
class Host:
    ns: str
    ifname: str
    addr: str

    def cmd(self, argv: list[str]) -> list[str]:
        """argv run inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]


@dataclass(frozen=True)
class TwoHosts:
    a: Host
    b: Host


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    if check and proc.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)} failed: {proc.stderr.strip() or proc.returncode}")
    return proc


def unavailable() -> str | None:
    """Why namespaces cannot be made here (one line), or None."""
    if shutil.which("ip") is None:
        failed = REPO / ".venv.iproute2-failed"  # `make test` wrote why its install failed
        why = failed.read_text().strip() + ": " if failed.exists() else ""
        return f"the two-host tests need `ip` (iproute2): {why}`make iproute2` (or apt-get install iproute2) as root"
    if os.geteuid() != 0:
        return ("the two-host tests create network namespaces (ip netns add), which needs root: "
                "run them as root (CI does), e.g. sudo make two-hosts-check")
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ours() -> list[tuple[str, int]]:
    names = [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]
    return [(n, int(m.group(1))) for n in names if (m := _OURS.match(n))]


def remove(ns: str) -> None:
    """Kill what still runs in `ns` (only processes a test bed of ours started there), then delete it;
    deleting a namespace deletes its end of the veth pair, and with it the pair."""
    for pid in _ip("netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _ip("netns", "del", ns, check=False)


def power_off(host: Host) -> int:
    """The host dies: every process in it is killed and its link goes down, so a peer's packets
    meet silence (no reset), as when a machine loses power. Returns how many processes it killed."""
    pids = _ip("netns", "pids", host.ns, check=False).stdout.split()
    _ip("-n", host.ns, "link", "set", host.ifname, "down")
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    return len(pids)


def power_on(host: Host) -> None:
    _ip("-n", host.ns, "link", "set", host.ifname, "up", check=False)


def clean_leftovers() -> list[str]:
    """Remove the test beds whose creating process is gone; returns their names."""
    gone = [n for n, pid in _ours() if not _alive(pid)]
    for n in gone:
        remove(n)
    return gone


def up(pid: int | None = None) -> TwoHosts:
    if (why := unavailable()) is not None:
        raise NetnsError(why)
    clean_leftovers()
    pid = os.getpid() if pid is None else pid
    bed = TwoHosts(*(Host(f"{PREFIX}{pid}-{s}", f"dkt{pid}{s}", f"{SUBNET}.{i}") for i, s in ((1, "a"), (2, "b"))))
    try:
        for h in (bed.a, bed.b):
            _ip("netns", "add", h.ns)
        _ip("link", "add", bed.a.ifname, "type", "veth", "peer", "name", bed.b.ifname)
        for h in (bed.a, bed.b):
            _ip("link", "set", h.ifname, "netns", h.ns)
            _ip("-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", h.ifname)
            _ip("-n", h.ns, "link", "set", h.ifname, "up")
            _ip("-n", h.ns, "link", "set", "lo", "up")
    except BaseException:
        down(bed)
        raise
    return bed


def down(bed: TwoHosts) -> None:
    for h in (bed.a, bed.b):
        remove(h.ns)
    _ip("link", "del", bed.a.ifname, check=False)  # made but not yet moved into a namespace


def main(argv: list[str]) -> int:
    """`python -m tests.netns clean`: remove the test beds whose run is gone (a live run's stays)."""
    if argv != ["clean"]:
        print("usage: python -m tests.netns clean", file=sys.stderr)
        return 2
    if (why := unavailable()) is not None:
        print(why, file=sys.stderr)
        return 1
    print("\n".join(f"removed {n}" for n in clean_leftovers()) or "no leftover dkt2h-* namespaces")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
