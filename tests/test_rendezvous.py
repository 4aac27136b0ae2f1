"""rendezvous.py: one decision for master address, backend and network interface (no traffic sent)."""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_kit.distributed.rendezvous import (
    HostFacts,
    RendezvousError,
    ifname_is_loopback,
    require,
    resolve_rendezvous,
    route_ip,
)
from dspark_kit.recipe import load_recipe
from dspark_kit.resolved import Resolved

REPO = Path(__file__).resolve().parent.parent
ASCEND = REPO / "recipes" / "qwen3-30b-a3b-ultrachat-ascend.yaml"
HOST = HostFacts(interfaces={"lo": ("127.0.0.1", "::1"), "eth0": ("10.0.0.7",), "ib0": ("192.168.5.7",)})


def _recipe(*sets: str):
    return load_recipe(ASCEND, list(sets))


def test_single_node_keeps_the_seed_command():
    r = resolve_rendezvous(_recipe(), "npu", HostFacts())
    assert not r.errors and r.backend == "static"
    assert r.socket_env == {"HCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}
    assert r.torchrun_args(0) == ["--nproc_per_node=2", "--nnodes=1", "--node_rank=0",
                                  "--master_addr=127.0.0.1", "--master_port=29500"]


def test_single_node_users_own_interface_wins_over_the_default():
    r = resolve_rendezvous(_recipe(), "npu", HostFacts(environ={"HCCL_SOCKET_IFNAME": "eth1"}))
    assert r.socket_env == {"HCCL_SOCKET_IFNAME": "eth1", "GLOO_SOCKET_IFNAME": "lo"}  # per variable
    cuda = resolve_rendezvous(_recipe("train.device=cuda"), "cuda", HostFacts(environ={"NCCL_SOCKET_IFNAME": "ib0"}))
    assert cuda.socket_env == {"NCCL_SOCKET_IFNAME": "ib0"}  # nothing added on one node
    across = resolve_rendezvous(_recipe("train.nnodes=2", "train.master_addr=10.0.0.1"), "npu",
                                HostFacts(environ={"HCCL_SOCKET_IFNAME": "eth1"}, interfaces=HOST.interfaces))
    assert across.socket_env == {"HCCL_SOCKET_IFNAME": "eth1", "GLOO_SOCKET_IFNAME": "eth1"} and not across.errors


def test_two_nodes_loopback_master_is_an_error():
    r = resolve_rendezvous(_recipe("train.nnodes=2"), "npu", HOST)
    assert any("train.master_addr 127.0.0.1 is loopback" in e for e in r.errors)
    with pytest.raises(RendezvousError, match="nodes_same_host"):
        require(r)


@pytest.mark.parametrize("where", ["recipe", "environment"])
def test_two_nodes_lo_interface_is_an_error(where):
    sets = ["train.nnodes=2", "train.master_addr=10.0.0.1"]
    facts = HOST
    if where == "recipe":
        sets.append("train.socket_ifname=lo")
    else:
        facts = HostFacts(environ={"GLOO_SOCKET_IFNAME": "lo"}, interfaces=HOST.interfaces)
    r = resolve_rendezvous(_recipe(*sets), "npu", facts)
    assert len(r.errors) == 1 and "GLOO_SOCKET_IFNAME=lo" in r.errors[0] and "loopback" in r.errors[0]


def test_two_nodes_interface_from_the_route_to_the_master():
    facts = HostFacts(interfaces=HOST.interfaces, master_ips=("10.0.0.1",), route_ip="10.0.0.7")
    r = resolve_rendezvous(_recipe("train.nnodes=2", "train.master_addr=10.0.0.1"), "npu", facts)
    assert not r.errors and r.socket_ifname == "eth0" and "routes to 10.0.0.1" in r.ifname_source
    assert r.socket_env == {"HCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0"}
    assert r.backend == "c10d" and "--rdzv-endpoint=10.0.0.1:29500" in r.torchrun_args(1)
    assert "--rdzv-id=qwen3-30b-a3b-ultrachat-ascend" in r.torchrun_args(1)


def test_c10d_node_0_hosts_the_store_and_this_node_gives_its_own_address():
    """torchrun's own is_host guess matches the endpoint against the hostname: wrong in containers and
    namespaces (nobody hosts, every node times out). The rank-0 worker's MASTER_ADDR is the rank-0
    node's --local-addr, else its hostname (which may resolve to loopback elsewhere)."""
    facts = HostFacts(interfaces=HOST.interfaces, master_ips=("10.0.0.1",), route_ip="10.0.0.7")
    r = resolve_rendezvous(_recipe("train.nnodes=2", "train.master_addr=10.0.0.1", "train.node_rank=1",
                                   "train.rdzv_timeout=300"), "npu", facts)
    node0, node1 = r.torchrun_args(0), r.torchrun_args(1)
    assert "--rdzv-conf=join_timeout=300,read_timeout=60,is_host=true" in node0
    assert "--rdzv-conf=join_timeout=300,read_timeout=60,is_host=false" in node1
    assert "--local-addr=10.0.0.7" in node1 and not any(a.startswith("--local-addr") for a in node0)  # this node's only
    assert [a for a in node0 if "is_host" not in a] == [a for a in node1 if "is_host" not in a and "local-addr" not in a]
    assert not r.warnings and "node 0 hosts the store" in r.summary() and "address 10.0.0.7" in r.summary()
    # the same machine claiming node 0 while another machine has master_addr: said before it fails
    r0 = resolve_rendezvous(_recipe("train.nnodes=2", "train.master_addr=10.0.0.1"), "npu", facts)
    assert any("train.node_rank 0 but this machine does not have train.master_addr 10.0.0.1" in w for w in r0.warnings)
    owner = HostFacts(interfaces={**HOST.interfaces, "eth1": ("10.0.0.1",)}, master_ips=("10.0.0.1",), route_ip="10.0.0.1")
    r1 = resolve_rendezvous(_recipe("train.nnodes=2", "train.master_addr=10.0.0.1", "train.node_rank=1"), "npu", owner)
    assert any("train.node_rank 1 but this machine has train.master_addr" in w for w in r1.warnings)
    same = resolve_rendezvous(_recipe("train.nnodes=2", "train.nodes_same_host=true"), "cpu",
                              HostFacts(interfaces=HOST.interfaces, master_ips=("127.0.0.1",), route_ip="127.0.0.1"))
    assert same.local_addr is None and "is_host=false" in "".join(same.torchrun_args(1))


class FakeClock:
    """time.monotonic / time.sleep for a module under test: sleeping advances it, nothing else does."""

    def __init__(self) -> None:
        self.now, self.sleeps = 0.0, 0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now, self.sleeps = self.now + seconds, self.sleeps + 1


def test_a_node_waits_for_the_store_at_most_the_rdzv_timeout_then_names_the_master(monkeypatch):
    from dspark_kit.distributed import rendezvous
    from dspark_kit.distributed.rendezvous import RendezvousError, store_failure, wait_for_store

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        facts = HostFacts(interfaces=HOST.interfaces, master_ips=("127.0.0.1",), route_ip="127.0.0.1")
        sets = ("train.nnodes=2", "train.nodes_same_host=true", f"train.master_port={port}", "train.rdzv_timeout=2")
        r1 = resolve_rendezvous(_recipe(*sets, "train.node_rank=1"), "cpu", facts)
        assert wait_for_store(r1) < 1.0  # answered at once
    clock = FakeClock()  # the wait is judged on the kit's clock, not the machine's (a busy one is slow)
    monkeypatch.setattr(rendezvous, "time", clock)
    with pytest.raises(RendezvousError) as e:  # nothing listens there now
        wait_for_store(r1, poll_s=0.2)
    assert 2 - 0.2 <= clock.now <= 2 + 1e-9 and clock.sleeps in (9, 10)  # probed every 0.2 s up to the 2 s timeout
    assert f"train.master_addr 127.0.0.1:{port} within train.rdzv_timeout 2s" in str(e.value)
    assert "\n" not in str(e.value) and "--set train.node_rank=0" in str(e.value)
    r0 = resolve_rendezvous(_recipe(*sets), "cpu", facts)
    assert wait_for_store(r0) == 0.0  # node 0 hosts it: nothing to wait for
    lost = store_failure("...\ntorch.distributed.DistNetworkError: The client socket has timed out", r1)
    assert lost and lost.startswith(f"lost the rendezvous master at 127.0.0.1:{port} (train.master_addr)")
    assert store_failure("Connection reset by peer", r1) is None


def test_two_nodes_without_a_route_the_recipe_must_name_the_interface():
    facts = HostFacts(interfaces=HOST.interfaces, route_error="no route to 10.9.9.9")
    r = resolve_rendezvous(_recipe("train.nnodes=2", "train.master_addr=10.9.9.9"), "cuda", facts)
    assert len(r.errors) == 1 and "set train.socket_ifname" in r.errors[0]
    ok = resolve_rendezvous(_recipe("train.nnodes=2", "train.master_addr=10.9.9.9", "train.socket_ifname=ib0"),
                            "cuda", facts)
    assert not ok.errors and ok.socket_env == {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "ib0"}


def test_same_host_simulation_allows_loopback():
    facts = HostFacts(interfaces=HOST.interfaces, master_ips=("127.0.0.1",), route_ip="127.0.0.1")
    r = resolve_rendezvous(_recipe("train.nnodes=2", "train.nodes_same_host=true"), "cpu", facts)
    assert not r.errors and r.socket_env == {"GLOO_SOCKET_IFNAME": "lo"}
    bad = resolve_rendezvous(_recipe("train.nnodes=2", "train.nodes_same_host=true", "train.master_addr=10.3.3.3",
                                     "train.socket_ifname=eth0"), "cpu",
                             HostFacts(interfaces=HOST.interfaces, master_ips=("10.3.3.3",)))
    assert any("not an address of this machine" in e for e in bad.errors)


def test_static_backend_and_restarts():
    r = resolve_rendezvous(_recipe("train.nnodes=2", "train.master_addr=10.0.0.1", "train.socket_ifname=eth0",
                                   "train.rdzv_backend=static", "train.max_restarts=2", "train.rdzv_timeout=90"),
                           "npu", HOST)
    assert r.torchrun_args(1) == ["--nproc_per_node=2", "--nnodes=2", "--node_rank=1", "--master_addr=10.0.0.1",
                                  "--master_port=29500", "--rdzv-backend=static", "--rdzv-conf=timeout=90",
                                  "--max-restarts=2"]


def test_loopback_interface_names():
    assert ifname_is_loopback("lo") and ifname_is_loopback("=lo") and ifname_is_loopback("eth0,lo")
    assert not ifname_is_loopback("eth0") and not ifname_is_loopback("^lo,^docker")
    assert ifname_is_loopback("loop9", {"loop9": ("127.0.0.2",)}) and not ifname_is_loopback("lo2", {"lo2": ("10.1.1.1",)})


def test_route_lookup_is_a_udp_connect_to_loopback_here():
    ip, err = route_ip("127.0.0.1", 9)  # a routing-table question; nothing is sent
    assert ip == "127.0.0.1" and err is None


@pytest.mark.slow
def test_seed_recipe_two_nodes_prints_commands_differing_only_in_node_rank():
    cmd = [sys.executable, "-m", "dspark_kit", "train", "-r", str(ASCEND), "--set", "train.nnodes=2",
           "--set", "train.master_addr=10.0.0.1", "--set", "train.socket_ifname=eth0", "--dry-run"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True, cwd=REPO).stdout
    # (online mode: the plan also shows the extraction server each node's trainer starts)
    lines = [ln for ln in out.splitlines() if "torch.distributed.run" in ln and not ln.startswith("#")]
    assert len(lines) == 2 and "# node 0" in out and "# node 1" in out
    # the lines differ in the node rank, which node hosts the c10d store (is_host), and this machine's
    # own address (--local-addr, on its line only): nothing else
    hosts = [("is_host=true" in ln, "is_host=false" in ln) for ln in lines]
    assert hosts == [(True, False), (False, True)], hosts
    words = [[w.replace("is_host=true", "is_host=*").replace("is_host=false", "is_host=*") for w in shlex.split(ln)
              if not w.startswith(("--node_rank=", "--local-addr="))] for ln in lines]
    assert words[0] == words[1]
    for w in ("HCCL_SOCKET_IFNAME=eth0", "GLOO_SOCKET_IFNAME=eth0", "--rdzv-endpoint=10.0.0.1:29500", "--nnodes=2"):
        assert w in words[0], w
    launcher = words[0][:words[0].index("dspark_kit.compat.train_entry")]  # env + torchrun flags
    assert not any("127.0.0.1" in w or w.endswith("=lo") for w in launcher), launcher


@pytest.mark.slow
def test_seed_recipe_two_nodes_loopback_dry_run_fails():
    cmd = [sys.executable, "-m", "dspark_kit", "train", "-r", str(ASCEND), "--set", "train.nnodes=2", "--dry-run"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False, cwd=REPO)
    assert proc.returncode != 0 and "loopback" in proc.stderr + proc.stdout


# ---- what each node needs: hidden states and regen at scale -------------------


def test_hidden_states_dry_run_says_what_each_node_needs(tmp_path):
    from dspark_kit.stages.hidden.hidden_states_vllm import offline_processes

    per_node = offline_processes(Resolved(_recipe("train.nnodes=2", "hidden_states.mode=offline"), tmp_path, planning=True))[0]
    text = "\n".join(per_node)
    assert "run dir" in text and "shared storage" in text and "one extraction server per node" in text
    assert "--world-size 2 --rank 1" in text
    shared = "\n".join(offline_processes(Resolved(_recipe("train.nnodes=2", "hidden_states.endpoint=http://10.0.0.1:9736"), tmp_path, planning=True))[0])
    assert "one extraction server for all 2 nodes at http://10.0.0.1:9736" in shared
    assert "hidden_states.storage_shared" in shared and "vllm serve" not in shared  # nothing to start per node


def test_regen_dry_run_shows_servers_on_machines_into_one_output(tmp_path):
    from typer.testing import CliRunner

    from dspark_kit.cli import app

    eps = ["http://10.0.0.5:8000/v1", "http://10.0.0.5:8001/v1", "http://10.0.0.6:8000/v1"]
    args = ["regen", "-r", str(ASCEND), "--dry-run", "-o", str(tmp_path / "regen.jsonl")]
    for e in eps:
        args += ["-e", e]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "# 3 server(s) on 2 machine(s) (10.0.0.5, 10.0.0.6)" in res.stdout
    assert f"one output {tmp_path / 'regen.jsonl'}" in res.stdout and "--resume" in res.stdout
    assert "--host 0.0.0.0" in res.stdout and all(f"endpoint {e}" in res.stdout for e in eps)
    # each server starts on its endpoint's port (before: every one on serve.port)
    starts = [line for line in res.stdout.splitlines() if line.startswith("#   10.0.0.")]
    assert [(line.split(":")[0][4:], line.split("--port ")[1].split()[0]) for line in starts] == [
        ("10.0.0.5", "8000"), ("10.0.0.5", "8001"), ("10.0.0.6", "8000")]
    assert "# 10.0.0.5: more than one server on a machine" in res.stdout
    assert not (tmp_path / "regen.jsonl").exists()


def test_node_k_watches_the_store_and_names_the_master_after_rdzv_timeout_of_silence():
    """A master host that powers off answers nothing (tests/test_two_hosts.py): the watch says so."""
    import time

    from dspark_kit.distributed.rendezvous import MasterWatch

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        facts = HostFacts(interfaces=HOST.interfaces, master_ips=("127.0.0.1",), route_ip="127.0.0.1")
        sets = ("train.nnodes=2", "train.nodes_same_host=true", f"train.master_port={port}", "train.rdzv_timeout=1")
        watch = MasterWatch(resolve_rendezvous(_recipe(*sets, "train.node_rank=1"), "cpu", facts))
        assert watch.active and watch.gone() is None and watch.silent_since is None
    assert not MasterWatch(resolve_rendezvous(_recipe(*sets), "cpu", facts)).active  # node 0 hosts it
    assert not MasterWatch(resolve_rendezvous(_recipe(*sets, "train.node_rank=1", "train.rdzv_backend=static"),
                                              "cpu", facts)).active
    assert watch.gone() is None and watch.silent_since is not None  # silent, not yet for rdzv_timeout
    time.sleep(1.1)
    lost = watch.gone()
    assert lost and lost.startswith(f"lost the rendezvous master at 127.0.0.1:{port} (train.master_addr) (silent for")
    assert "train.rdzv_timeout 1s" in lost and "restart node 0" in lost and "\n" not in lost
