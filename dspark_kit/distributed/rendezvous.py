"""Where training processes meet: master address, port, rendezvous backend, network interface.

One decision, made here and nowhere else, from the recipe's `train` section
plus facts about this machine (`HostFacts`: its interfaces, the local address
that routes to the master, the user's own *_SOCKET_IFNAME variables).
`resolve_rendezvous` is pure; `gather_host_facts` is the only part that looks
at the machine, and it never sends a packet: routing is found with a UDP
`connect()`, which only asks the kernel's routing table.

Rules:
- one node (train.nnodes == 1): today's single-node command; loopback is right
  (`HCCL_SOCKET_IFNAME=lo` stays the Ascend default).
- several nodes: a loopback master address or a loopback interface is an error
  unless `train.nodes_same_host` says every node is this machine (a local
  simulation). The interface is `train.socket_ifname`, else the user's own
  HCCL/NCCL/GLOO_SOCKET_IFNAME, else the NIC whose address routes to the
  master; when none is found the recipe must name it.
- rendezvous backend `auto`: static on one node, c10d across nodes (elastic:
  `--max-restarts` restarts every node's workers together, and a restarted
  job resumes from the last whole checkpoint).
- c10d: node_rank 0 hosts the rendezvous store (`is_host=true`, the others
  `false`). torchrun's own guess matches the endpoint against the machine's
  hostname, which fails in containers, pods, multi-NIC machines and network
  namespaces: then nobody hosts it and every node times out. Each node also
  gives torchrun its own address towards the master (`--local-addr`), else the
  workers get the rank-0 node's hostname as MASTER_ADDR, which may resolve to
  loopback on the others. The other nodes' `dspark-kit train` waits at most
  `rdzv_timeout` for that store to accept a connection before starting torchrun
  (whose own connect retries take ~3x its read timeout), and names the master
  when it does not, or when the store is lost mid-run.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from dspark_kit.devices import NPU_ENV_DEFAULTS
from dspark_kit.recipe import Recipe, RecipeError

# The variables that pin collective traffic to an interface, per device.
SOCKET_IFNAME_VARS: dict[str, tuple[str, ...]] = {
    "npu": ("HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"),
    "cuda": ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"),
    "cpu": ("GLOO_SOCKET_IFNAME",),
}
# Single-node defaults: loopback is right on one machine (devices.NPU_ENV_DEFAULTS, decided there once).
SINGLE_NODE_IFNAME = {"npu": NPU_ENV_DEFAULTS["HCCL_SOCKET_IFNAME"]}
_ALL_VARS = sorted({v for vs in SOCKET_IFNAME_VARS.values() for v in vs})


class RendezvousError(RecipeError):
    """The rendezvous cannot work across nodes; the message names the key to set."""


@dataclass(frozen=True)
class HostFacts:
    """What this machine says; gathered once by `gather_host_facts`, plain data for tests."""

    environ: Mapping[str, str] = field(default_factory=dict)  # the user's *_SOCKET_IFNAME
    interfaces: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # name -> addresses
    master_ips: tuple[str, ...] = ()  # master_addr resolved (the literal itself for an IP)
    route_ip: str | None = None  # this machine's address towards the master
    route_error: str | None = None


@dataclass(frozen=True)
class Rendezvous:
    nnodes: int
    nproc_per_node: int
    backend: str  # "static" | "c10d"
    master_addr: str
    master_port: int
    rdzv_id: str
    max_restarts: int
    timeout: int
    same_host: bool
    socket_ifname: str | None
    ifname_source: str
    socket_env: dict[str, str]
    elastic_env: dict[str, str] = field(default_factory=dict)
    this_rank: int = 0  # the node this machine runs (train.node_rank)
    local_addr: str | None = None  # this machine's address towards the master (c10d across machines)
    errors: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    def as_dict(self) -> dict:
        """Plain data, as a stage plan records it (the run rebuilds the same decision: `from_dict`)."""
        from dataclasses import asdict

        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> Rendezvous:
        d = dict(data)
        return cls(**{**d, "errors": tuple(d.get("errors", ())), "warnings": tuple(d.get("warnings", ()))})

    def torchrun_args(self, node_rank: int) -> list[str]:
        """torchrun's flags for node `node_rank`. c10d assigns worker ranks itself; the flags differ only
        in who hosts the store (node 0) and, on this machine's own node, its --local-addr."""
        args = [f"--nproc_per_node={self.nproc_per_node}", f"--nnodes={self.nnodes}"]
        if self.backend == "c10d":
            # read_timeout bounds each store operation (torch's default 60 s; never above the recipe's)
            conf = (f"join_timeout={self.timeout},read_timeout={min(self.timeout, 60)},"
                    f"is_host={str(node_rank == 0).lower()}")
            args += ["--rdzv-backend=c10d", f"--rdzv-endpoint={_endpoint(self.master_addr, self.master_port)}",
                     f"--rdzv-id={self.rdzv_id}", f"--rdzv-conf={conf}"]
            if self.local_addr and node_rank == self.this_rank:
                args += [f"--local-addr={self.local_addr}"]
        else:
            args += [f"--node_rank={node_rank}", f"--master_addr={self.master_addr}",
                     f"--master_port={self.master_port}"]
            if self.multi_node:
                args += ["--rdzv-backend=static", f"--rdzv-conf=timeout={self.timeout}"]
        if self.multi_node or self.max_restarts:
            args += [f"--max-restarts={self.max_restarts}"]
        return args

    def summary(self) -> str:
        """One comment line for dry runs."""
        where = "all nodes on this host" if self.same_host else f"{self.nnodes} machines"
        ifname = f"{self.socket_ifname} ({self.ifname_source})" if self.socket_ifname else "system default"
        host = ", node 0 hosts the store" if self.backend == "c10d" and self.multi_node else ""
        addr = f" address {self.local_addr}" if self.local_addr else ""
        return (f"rendezvous {self.backend} at {_endpoint(self.master_addr, self.master_port)}{host}, {where}, "
                f"{self.nproc_per_node} process(es) per node, this node (node {self.this_rank}): interface {ifname}"
                f"{addr}, max restarts {self.max_restarts}, timeout {self.timeout}s")


def _endpoint(addr: str, port: int) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def _is_loopback_ip(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr.split("%")[0]).is_loopback
    except ValueError:
        return False


def master_is_loopback(addr: str, resolved: tuple[str, ...] = ()) -> bool:
    if addr.lower() in ("localhost", "localhost.localdomain", "ip6-localhost") or _is_loopback_ip(addr):
        return True
    return bool(resolved) and all(_is_loopback_ip(a) for a in resolved)


def _ifnames(spec: str) -> list[str]:
    """Names in an interface spec: 'eth0', 'eth0,eth1', NCCL's '=eth0' (exact) or '^docker' (exclude)."""
    return [n.lstrip("=") for n in (p.strip() for p in spec.split(",")) if n and not n.startswith("^")]


def ifname_is_loopback(spec: str, interfaces: Mapping[str, tuple[str, ...]] | None = None) -> bool:
    """True when the spec names a loopback interface (by its addresses here, else by the name lo/lo0)."""
    interfaces = interfaces or {}
    for name in _ifnames(spec):
        addrs = interfaces.get(name)
        if addrs:
            if all(_is_loopback_ip(a) for a in addrs):
                return True
        elif re.fullmatch(r"lo\d*", name):
            return True
    return False


def _local_ips(interfaces: Mapping[str, tuple[str, ...]]) -> set[str]:
    return {a.split("%")[0] for addrs in interfaces.values() for a in addrs}


def interface_for_ip(ip: str, interfaces: Mapping[str, tuple[str, ...]]) -> str | None:
    for name, addrs in interfaces.items():
        if any(a.split("%")[0] == ip for a in addrs):
            return name
    return None


def _rdzv_id(recipe: Recipe) -> str:
    if recipe.train.rdzv_id:
        return recipe.train.rdzv_id
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", recipe.name).strip("-") or "dspark"


def resolve_rendezvous(recipe: Recipe, device: str, facts: HostFacts) -> Rendezvous:
    """The rendezvous for `recipe` on `device`, given this machine's facts (pure)."""
    t = recipe.train
    multi, same_host = t.nnodes > 1, t.nodes_same_host
    errors: list[str] = []
    warnings: list[str] = []
    backend = t.rdzv_backend if t.rdzv_backend != "auto" else ("c10d" if multi else "static")
    variables = SOCKET_IFNAME_VARS.get(device, ("GLOO_SOCKET_IFNAME",))

    # the interface: recipe, else the user's own variable, else the route to the master, else a default
    user = {v: facts.environ[v] for v in variables if facts.environ.get(v)}
    if t.socket_ifname:
        ifname, source = t.socket_ifname, "train.socket_ifname"
        env = dict.fromkeys(variables, ifname)
    else:
        first = next(iter(user.items()), None)
        routed = interface_for_ip(facts.route_ip, facts.interfaces) if facts.route_ip else None
        if not multi:  # per variable: yours, else the single-node default (npu: lo), else unset
            default = SINGLE_NODE_IFNAME.get(device)
            env = {v: user.get(v, default) for v in variables if user.get(v, default)}
            ifname, source = (first[1], f"your {first[0]}") if first else (
                (default, "single-node default") if default else (None, "unset"))
        else:  # one interface for every variable: a loopback default for the others would be wrong
            if first:
                ifname, source = first[1], f"your {first[0]}"
            elif routed:
                ifname, source = routed, f"routes to {t.master_addr} via {facts.route_ip}"
            else:
                ifname, source = None, "unset"
            env = {v: user.get(v, ifname) for v in variables if user.get(v, ifname)}

    if multi:
        loop_master = master_is_loopback(t.master_addr, facts.master_ips)
        if same_host:
            if not loop_master and facts.interfaces and not (set(facts.master_ips) | {t.master_addr}) & \
                    _local_ips(facts.interfaces):
                errors.append(f"train.nodes_same_host is true but train.master_addr {t.master_addr} is not an "
                              "address of this machine; use 127.0.0.1 for a one-machine simulation")
        else:
            if loop_master:
                errors.append(f"train.master_addr {t.master_addr} is loopback with train.nnodes {t.nnodes}: every "
                              "other node would connect to itself and wait forever; set train.master_addr to "
                              "node 0's address that every node can reach (e.g. --set train.master_addr=10.0.0.1), "
                              "or train.nodes_same_host: true to run all nodes on this machine")
            looped = [f"{var}={value} ({'your environment' if var in user and not t.socket_ifname else source})"
                      for var, value in env.items() if ifname_is_loopback(value, facts.interfaces)]
            if looped and not (loop_master and source.startswith("routes to")):  # else the master is the fault
                errors.append(f"{', '.join(looped)} pins collective traffic to loopback with train.nnodes "
                              f"{t.nnodes}: other nodes cannot connect; set train.socket_ifname to the NIC "
                              "that reaches the other nodes (e.g. eth0), or train.nodes_same_host: true")
            if not env and not loop_master:
                detail = f" ({facts.route_error})" if facts.route_error else ""
                errors.append(f"no network interface found that routes to train.master_addr {t.master_addr}"
                              f"{detail}; set train.socket_ifname to the NIC that reaches the other nodes")
            if ifname and facts.interfaces and not any(n in facts.interfaces for n in _ifnames(ifname)):
                warnings.append(f"interface {ifname} ({source}) is not on this machine "
                                f"({', '.join(sorted(facts.interfaces))}); fine when planning for other machines")
            if backend == "c10d" and facts.interfaces and not loop_master:
                owns = bool((set(facts.master_ips) | {t.master_addr}) & _local_ips(facts.interfaces))
                if owns != (t.node_rank == 0):  # c10d: node 0 hosts the store at master_addr
                    warnings.append(
                        f"train.node_rank {t.node_rank} but this machine {'has' if owns else 'does not have'} "
                        f"train.master_addr {t.master_addr}: node 0 hosts the rendezvous store there, so run "
                        f"--set train.node_rank=0 on the machine at {t.master_addr} and --set train.node_rank=K "
                        "on each other node; fine when planning for other machines")
    # torch >= 2.5 shares the agents' c10d store with the workers; after a restart the workers
    # find the previous round's keys there and hang in init_process_group (pytorch#135712):
    # a fresh store per round makes `--max-restarts` work (measured: tests/test_multinode.py).
    elastic_env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if backend == "c10d" else {}
    local_addr = facts.route_ip if backend == "c10d" and multi and not same_host else None
    return Rendezvous(
        elastic_env=elastic_env, this_rank=t.node_rank, local_addr=local_addr,
        nnodes=t.nnodes, nproc_per_node=t.nproc, backend=backend, master_addr=t.master_addr,
        master_port=t.master_port, rdzv_id=_rdzv_id(recipe), max_restarts=t.max_restarts,
        timeout=t.rdzv_timeout, same_host=same_host, socket_ifname=ifname, ifname_source=source,
        socket_env=env, errors=tuple(errors), warnings=tuple(warnings),
    )


# ---- the machine's side (no packets sent) ------------------------------------


def local_interfaces() -> dict[str, tuple[str, ...]]:
    """Interface name -> its IPv4/IPv6 addresses (psutil)."""
    try:
        import psutil

        return {name: tuple(a.address for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6))
                for name, addrs in psutil.net_if_addrs().items()}
    except Exception:  # noqa: BLE001 - no interface list: the recipe must name the interface
        return {}


def this_machine_address() -> str | None:
    """A non-loopback, non-link-local IPv4 address of this machine (a default for train.master_addr)."""
    interfaces = local_interfaces()
    for name in sorted(interfaces):
        for addr in interfaces[name]:
            try:
                ip = ipaddress.ip_address(addr.split("%")[0])
            except ValueError:
                continue
            if ip.version == 4 and not ip.is_loopback and not ip.is_link_local:
                return addr
    return None


def route_ip(addr: str, port: int) -> tuple[str | None, str | None]:
    """This machine's address towards addr:port, by a UDP connect (a routing-table lookup, no packet)."""
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError) as e:
        return None, f"cannot resolve {addr}: {e}"
    last = None
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.connect(sockaddr)  # UDP: picks the route, sends nothing
                return s.getsockname()[0], None
        except OSError as e:
            last = f"no route to {addr}: {e.strerror or e}"
    return None, last


def _resolve(addr: str) -> tuple[str, ...]:
    try:
        ipaddress.ip_address(addr.split("%")[0])
        return (addr,)
    except ValueError:
        pass
    try:
        return tuple(sorted({i[4][0] for i in socket.getaddrinfo(addr, None)}))
    except (OSError, UnicodeError):
        return ()


def gather_host_facts(recipe: Recipe, device: str, environ: Mapping[str, str] | None = None) -> HostFacts:
    """Look at this machine for what `resolve_rendezvous` needs (across nodes only)."""
    environ = os.environ if environ is None else environ
    t = recipe.train
    user = {v: environ[v] for v in _ALL_VARS if environ.get(v)}
    if t.nnodes == 1:
        return HostFacts(environ=user)
    interfaces = local_interfaces()
    master_ips = _resolve(t.master_addr)
    ip, err = route_ip(t.master_addr, t.master_port)  # the interface (when not named) and --local-addr
    return HostFacts(environ=user, interfaces=interfaces, master_ips=master_ips, route_ip=ip, route_error=err)


def rendezvous_for(recipe: Recipe, device: str, environ: Mapping[str, str] | None = None) -> Rendezvous:
    return resolve_rendezvous(recipe, device, gather_host_facts(recipe, device, environ))


def require(rdzv: Rendezvous) -> Rendezvous:
    """Raise the rendezvous errors as one line (launching would hang or fail to connect)."""
    if rdzv.errors:
        raise RendezvousError("; ".join(rdzv.errors))
    return rdzv


def _store_silent(rdzv: Rendezvous, timeout: float) -> str | None:
    """Why node 0's store did not accept a TCP connection within `timeout` s, or None when it did."""
    try:
        with socket.create_connection((rdzv.master_addr, rdzv.master_port), timeout=timeout):
            return None
    except OSError as e:
        return e.strerror or str(e) or type(e).__name__


def wait_for_store(rdzv: Rendezvous, poll_s: float = 0.5) -> float:
    """c10d across nodes, node K > 0: wait up to `rdzv.timeout` s for node 0's store to accept a TCP
    connection (raises one line naming the master otherwise); returns the seconds waited."""
    if rdzv.backend != "c10d" or not rdzv.multi_node or rdzv.this_rank == 0:
        return 0.0
    t0 = time.monotonic()
    end = t0 + rdzv.timeout
    while True:
        left = end - time.monotonic()
        if (last := _store_silent(rdzv, max(0.1, min(5.0, left)))) is None:
            return time.monotonic() - t0
        if time.monotonic() + poll_s >= end:
            raise RendezvousError(
                f"node {rdzv.this_rank} cannot reach the rendezvous store at train.master_addr "
                f"{_endpoint(rdzv.master_addr, rdzv.master_port)} within train.rdzv_timeout {rdzv.timeout}s "
                f"({last}): start node 0 (--set train.node_rank=0) on the machine at {rdzv.master_addr} first, "
                f"and check this node routes to it (interface {rdzv.socket_ifname or 'default'})")
        time.sleep(poll_s)


@dataclass
class MasterWatch:
    """c10d across nodes, node K > 0: node 0's store is probed (a TCP connect, as wait_for_store)
    while this node trains. A master host that powers off answers nothing, no reset: torchrun's
    agent and the gloo collective wait far past train.rdzv_timeout (measured: node 1 still
    running 300 s after host A died, tests/test_two_hosts.py). Silent for rdzv_timeout: lost."""

    rdzv: Rendezvous
    probe_timeout_s: float = 3.0
    silent_since: float | None = None

    @property
    def active(self) -> bool:
        r = self.rdzv
        return r.backend == "c10d" and r.multi_node and r.this_rank != 0

    def gone(self) -> str | None:
        """One line once the store has not accepted a connection for rdzv_timeout, else None."""
        r = self.rdzv
        if (why := _store_silent(r, self.probe_timeout_s)) is None:
            self.silent_since = None
            return None
        now = time.monotonic()
        self.silent_since = self.silent_since or now
        if now - self.silent_since < r.timeout:
            return None
        return _lost_master(r, f"silent for {now - self.silent_since:.0f}s, train.rdzv_timeout {r.timeout}s: {why}")


def _lost_master(rdzv: Rendezvous, detail: str) -> str:
    where = f"{_endpoint(rdzv.master_addr, rdzv.master_port)} (train.master_addr)"
    return (f"lost the rendezvous master at {where}{f' ({detail})' if detail else ''}: node 0 stopped or became "
            "unreachable; restart node 0, then rerun the same command here to resume from the last whole epoch")


_STORE_LOST = re.compile(r"RendezvousConnectionError|DistNetworkError|The client socket has timed out|"
                         r"failed to connect/validate to host")


def store_failure(log_text: str, rdzv: Rendezvous) -> str | None:
    """One line when torchrun failed on the c10d store (node 0 gone, or never reachable), else None."""
    if rdzv.backend != "c10d" or not rdzv.multi_node or not _STORE_LOST.search(log_text):
        return None
    if rdzv.this_rank == 0:
        where = f"{_endpoint(rdzv.master_addr, rdzv.master_port)} (train.master_addr)"
        return (f"node 0 could not host or use the rendezvous store at {where}: run node 0 on the machine that "
                f"has {rdzv.master_addr}, with train.master_port free there")
    return _lost_master(rdzv, "")
