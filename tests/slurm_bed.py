"""A real Slurm cluster on one machine: slurmctld and two slurmd "hosts" in network namespaces (root only).

Host A (node1, 10.78.0.1) and host B (node2, 10.78.0.2) are two namespaces joined by a veth pair
(names dksl-<pid>-a/-b, interfaces dksl<pid>a/b). slurmctld runs in A; each slurmd runs in its
host's namespace under `nsenter --net` (never `ip netns exec`: it remounts /sys, hiding the cgroup
file system slurmd's cgroup plugin needs, and the node then sits in `unk*` with no error) plus
`unshare --uts --mount`, with the host's own hostname and a bind-mounted hosts file naming both
nodes, so a job's `scontrol show hostnames` names resolve on either host. munged runs as the munge
user on its own socket and key in the bed's folder. Clients (sbatch, squeue, the kit that follows
a job) run inside host A. `down` stops every daemon and job step and deletes both namespaces; a bed
left by a killed run (its pid gone) is removed when the next one is made.

`python -m tests.slurm_bed clean` removes leftover beds.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.netns import _alive

REPO = Path(__file__).resolve().parent.parent
PREFIX = "dksl-"
SUBNET = "10.78.0"
RUN_ROOT = Path("/run")  # beds live in /run/dksl-<pid>: munged refuses world-writable parents (/tmp)
_OURS = re.compile(rf"^{PREFIX}(\d+)-[ab]$")
DAEMONS = ("slurmctld", "slurmd", "munged")


class SlurmBedError(RuntimeError):
    """The cluster cannot be made here; the message says why in one line."""


def unavailable() -> str | None:
    """Why a Slurm bed cannot be made here (one line), or None."""
    failed = REPO / ".venv.slurm-failed"  # `make test` wrote why its install failed
    missing = [t for t in ("ip", "nsenter", "unshare", "slurmctld", "slurmd", "sbatch", "munged", "mungekey")
               if shutil.which(t) is None]
    if missing:
        why = failed.read_text().strip() + ": " if failed.exists() else ""
        return (f"the Slurm tests need {', '.join(missing)}: {why}`make slurm` (apt-get install slurmctld slurmd "
                "slurm-client munge iproute2) as root")
    if os.geteuid() != 0:
        return "the Slurm tests create network namespaces and run slurmd, which needs root: run them as root"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "the Slurm tests run munged as the munge user, which is missing: reinstall the munge package"
    return None


def _run(argv: list[str], check: bool = True, timeout: float = 20, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, **kw)
    if check and proc.returncode != 0:
        raise SlurmBedError(f"{' '.join(argv)} failed: {(proc.stderr or proc.stdout).strip() or proc.returncode}")
    return proc


@dataclass(frozen=True)
class Host:
    ns: str
    ifname: str
    addr: str
    node: str  # the Slurm node name, also this host's hostname

    def cmd(self, argv: list[str]) -> list[str]:
        """argv run inside this host's network namespace (clients: sbatch, squeue, the kit)."""
        return ["nsenter", f"--net=/run/netns/{self.ns}", *argv]


@dataclass
class Cluster:
    a: Host
    b: Host
    root: Path
    env: dict[str, str]  # SLURM_CONF for every client
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def hosts(self) -> tuple[Host, Host]:
        return self.a, self.b

    def client(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """A Slurm client (squeue, sinfo, scontrol) run in host A."""
        return subprocess.run(self.a.cmd(list(argv)), capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **self.env}, check=False)


def _ns_pids(ns: str) -> list[int]:
    return [int(p) for p in _run(["ip", "netns", "pids", ns], check=False).stdout.split() if p.isdigit()]


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _remove(ns: str) -> None:
    _kill(_ns_pids(ns))
    _run(["ip", "netns", "del", ns], check=False)


def _munged_pids(root: Path) -> list[int]:
    pid_file = root / "munge" / "munged.pid"
    try:
        return [int(pid_file.read_text().strip())]
    except (OSError, ValueError):
        return []


def clean_leftovers() -> list[str]:
    """Remove the beds whose creating process is gone (namespaces, their processes, munged, folder)."""
    names = [ln.split()[0] for ln in _run(["ip", "netns", "list"], check=False).stdout.splitlines() if ln.strip()]
    gone = sorted({int(m.group(1)) for n in names if (m := _OURS.match(n))} |
                  {int(d.name[len(PREFIX):]) for d in RUN_ROOT.glob(f"{PREFIX}*") if d.name[len(PREFIX):].isdigit()})
    removed = []
    for pid in gone:
        if _alive(pid):
            continue
        for s in "ab":
            _remove(f"{PREFIX}{pid}-{s}")
        root = RUN_ROOT / f"{PREFIX}{pid}"
        _kill(_munged_pids(root))
        shutil.rmtree(root, ignore_errors=True)
        removed.append(f"{PREFIX}{pid}")
    return removed


SLURM_CONF = """\
ClusterName=dksl
SlurmctldHost={ctl}({ctl_addr})
SlurmctldPort={ctl_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={root}/ctld
SlurmctldPidFile={root}/slurmctld.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdSpoolDir={root}/spool-%n
SlurmdPidFile={root}/slurmd-%n.pid
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
MailProg=/bin/true
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
MinJobAge=600
KillWait=10
SlurmdTimeout=30
InactiveLimit=0
SchedulerType=sched/builtin
SelectType=select/linear
{nodes}
PartitionName=dksl Nodes={a_node},{b_node} Default=YES MaxTime=INFINITE State=UP
"""


def up(pid: int | None = None, cpus: int = 2) -> Cluster:
    """The controller and two hosts, both nodes idle; raises SlurmBedError (after tearing down) otherwise."""
    if (why := unavailable()) is not None:
        raise SlurmBedError(why)
    clean_leftovers()
    pid = os.getpid() if pid is None else pid
    a, b = (Host(f"{PREFIX}{pid}-{s}", f"dksl{pid}{s}", f"{SUBNET}.{i}", f"dksl{i}") for i, s in ((1, "a"), (2, "b")))
    root = RUN_ROOT / f"{PREFIX}{pid}"
    cluster = Cluster(a, b, root, {"SLURM_CONF": str(root / "slurm.conf")})
    try:
        _network(a, b)
        root.mkdir(mode=0o755, exist_ok=True)
        _munge(cluster)
        (root / "hosts").write_text(f"127.0.0.1 localhost\n{a.addr} {a.node}\n{b.addr} {b.node}\n")
        nodes = "\n".join(f"NodeName={h.node} NodeAddr={h.addr} CPUs={cpus} State=UNKNOWN" for h in (a, b))
        (root / "slurm.conf").write_text(SLURM_CONF.format(
            ctl=a.node, ctl_addr=a.addr, ctl_port=6817, d_port=6818, munge_socket=root / "munge" / "munge.socket",
            root=root, nodes=nodes, a_node=a.node, b_node=b.node))
        (root / "ctld").mkdir(exist_ok=True)
        conf = str(root / "slurm.conf")
        log = (root / "daemons.out").open("a")
        cluster.procs.append(subprocess.Popen(
            _on_host(a, ["slurmctld", "-D", "-f", conf]), stdout=log, stderr=log, start_new_session=True))
        for h in (a, b):
            cluster.procs.append(subprocess.Popen(
                _on_host(h, ["slurmd", "-D", "-f", conf, "-N", h.node]), stdout=log, stderr=log,
                start_new_session=True))
        _wait_idle(cluster)
    except BaseException:
        down(cluster)
        raise
    return cluster


def _network(a: Host, b: Host) -> None:
    for h in (a, b):
        _run(["ip", "netns", "add", h.ns])
    _run(["ip", "link", "add", a.ifname, "type", "veth", "peer", "name", b.ifname])
    for h in (a, b):
        _run(["ip", "link", "set", h.ifname, "netns", h.ns])
        _run(["ip", "-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", h.ifname])
        _run(["ip", "-n", h.ns, "link", "set", h.ifname, "up"])
        _run(["ip", "-n", h.ns, "link", "set", "lo", "up"])


def _on_host(h: Host, argv: list[str]) -> list[str]:
    """A daemon on host h: its network namespace, its own hostname and hosts file (a private mount)."""
    hosts = RUN_ROOT / f"{PREFIX}{h.ns.split('-')[1]}" / "hosts"
    inner = f"hostname {h.node} && mount --bind {hosts} /etc/hosts && exec {' '.join(argv)}"
    return ["nsenter", f"--net=/run/netns/{h.ns}", "unshare", "--uts", "--mount", "--propagation", "private",
            "sh", "-c", inner]


def _munge(cluster: Cluster) -> None:
    d = cluster.root / "munge"
    d.mkdir(exist_ok=True)
    os.chmod(d, 0o755)  # munged: every user reaches its socket
    pw = pwd.getpwnam("munge")
    key = d / "munge.key"
    _run(["mungekey", "--create", f"--keyfile={key}"])
    for p in (d, key):
        os.chown(p, pw.pw_uid, pw.pw_gid)
    os.chmod(key, 0o600)
    _run(["runuser", "-u", "munge", "--", "munged", f"--socket={d / 'munge.socket'}", f"--key-file={key}",
          f"--pid-file={d / 'munged.pid'}", f"--log-file={d / 'munged.log'}", f"--seed-file={d / 'munged.seed'}"])


def _wait_idle(cluster: Cluster, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    last = ""
    while time.monotonic() < end:
        for p in cluster.procs:
            if p.poll() is not None:
                raise SlurmBedError(f"{p.args[-1]} exited with {p.returncode}; see {cluster.root}/daemons.out and "
                                    f"{cluster.root}/*.log")
        proc = cluster.client("sinfo", "-h", "-N", "-o", "%N %t", timeout=10)
        last = proc.stdout.strip() or proc.stderr.strip()
        states = dict(ln.split() for ln in proc.stdout.splitlines() if len(ln.split()) == 2)
        if states and all(s == "idle" for s in states.values()) and len(states) == 2:
            return
        time.sleep(0.3)
    raise SlurmBedError(f"the two nodes did not become idle within {timeout:.0f}s: {last}")


def power_off(cluster: Cluster, host: Host) -> int:
    """Host dies: every process in its namespace is killed (its slurmd and job steps); returns how many."""
    pids = _ns_pids(host.ns)
    _kill(pids)
    for p in [p for p in cluster.procs if p.args[-1].endswith(f"-N {host.node}")]:  # its slurmd: gone
        p.wait(timeout=10)
        cluster.procs.remove(p)
    return len(pids)


def power_on(cluster: Cluster, host: Host, timeout: float = 60) -> None:
    """The host is back: its slurmd starts again and the node returns to service (ReturnToService=2)."""
    log = (cluster.root / "daemons.out").open("a")
    cluster.procs.append(subprocess.Popen(
        _on_host(host, ["slurmd", "-D", "-f", str(cluster.root / "slurm.conf"), "-N", host.node]), stdout=log,
        stderr=log, start_new_session=True))
    _wait_idle(cluster, timeout)


def down(cluster: Cluster) -> None:
    """Stop every daemon and job step, delete the namespaces and the bed's folder (also after a failure)."""
    for p in cluster.procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for h in cluster.hosts:
        _remove(h.ns)
    _run(["ip", "link", "del", cluster.a.ifname], check=False)
    for p in cluster.procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    _kill(_munged_pids(cluster.root))
    shutil.rmtree(cluster.root, ignore_errors=True)


def main(argv: list[str]) -> int:
    """`python -m tests.slurm_bed clean`: remove the beds whose run is gone (a live run's stays)."""
    if argv != ["clean"]:
        print("usage: python -m tests.slurm_bed clean", file=sys.stderr)
        return 2
    if (why := unavailable()) is not None:
        print(why, file=sys.stderr)
        return 1
    print("\n".join(f"removed {n}" for n in clean_leftovers()) or f"no leftover {PREFIX}* beds")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
