"""Two real network hosts on one machine (tests/netns.py): multi-node training without nodes_same_host.

Host A (node 0, 10.77.0.1) and host B (node 1, 10.77.0.2) are network namespaces joined by a
veth pair, each with its own interface name. Each node's command is the line `dspark-kit train
--dry-run --set train.node_rank=N` prints there for "this machine": the plan names that node's
own interface and address. Both hosts share the file system, so one work dir serves both (it
stands for the shared storage a cluster mounts). Needs root: without it every test here fails
with one line saying so.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from dspark_kit.engines.ports import free_port
from tests import netns
from tests.test_multinode import KIT, TINY, _env, _stop, prepared  # noqa: F401 - prepared: fixture

pytestmark = pytest.mark.slow
# 16 rows (14 train, 2 val), 4 epochs: about 40 s a run on 2 loaded cores
SETS = ["train.device=cpu", "train.logger=none", "data.limit=16", "regen.enabled=false", "train.epochs=4"]
# Same seed, same world size (2 ranks), same data order and the same gloo allreduce of two
# CPU tensors: nothing differs but where the ranks run, so val acceptance should agree
# exactly; 1e-6 allows only float printing, not a different training.
TOLERANCE = 1e-6


def _args(*sets: str) -> list[str]:
    return [a for s in (*SETS, *sets) for a in ("--set", s)]


def _kit(host: netns.Host | None, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [*KIT, *argv]
    return subprocess.run(host.cmd(cmd) if host else cmd, capture_output=True, text=True, timeout=timeout,
                          env=_env(), check=False)


def _this_node_line(host: netns.Host, rank: int, workdir: Path, *sets: str) -> tuple[str, dict, list[str]]:
    """(the plan, env, argv) of the line `train --dry-run --set train.node_rank=rank` prints on `host`."""
    proc = _kit(host, "train", "-r", str(TINY), *_args(*sets, f"train.node_rank={rank}"),
                "--workdir", str(workdir), "--dry-run", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    line = lines[lines.index(f"# node {rank} (this machine)") + 1]
    words = shlex.split(line)
    n = next(i for i, w in enumerate(words) if "=" not in w or w.startswith("-"))
    return proc.stdout, dict(w.split("=", 1) for w in words[:n]), words[n:]


def _last_val(workdir: Path) -> dict:
    ck = workdir / "checkpoints"
    last = max((p for p in ck.glob("[0-9]*") if p.is_dir()), key=lambda p: int(p.name))
    return json.loads((last / "val_metrics.json").read_text())


@pytest.fixture(scope="module")
def one_node(tmp_path_factory, prepared) -> dict:  # noqa: F811 - the imported fixture
    """The same recipe on one node with two ranks (world size 2, as across the two hosts)."""
    wd = tmp_path_factory.mktemp("one-node")
    shutil.copytree(prepared, wd / "prepared")
    t0 = time.time()
    proc = _kit(None, "train", "-r", str(TINY), *_args("train.nproc=2"), "--workdir", str(wd), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(f"one node, 2 ranks: {time.time() - t0:.1f}s")
    return _last_val(wd)


@pytest.mark.parametrize("backend", ["auto", "static"])
def test_two_hosts_train_from_their_printed_lines_like_one_node(hosts, prepared, one_node, tmp_path,  # noqa: F811
                                                                backend):
    """auto = c10d: node 0 hosts the store (is_host) although the hostname resolves to 127.0.0.1."""
    wd = tmp_path / "run"
    shutil.copytree(prepared, wd / "prepared")
    sets = ("train.nnodes=2", "train.nproc=1", f"train.master_addr={hosts.a.addr}",
            f"train.master_port={free_port()}", f"train.rdzv_backend={backend}", "train.rdzv_timeout=120")
    nodes = []
    try:
        for rank, host in enumerate((hosts.a, hosts.b)):
            plan, env, argv = _this_node_line(host, rank, wd, *sets)
            # this node's own interface (the one routing to the master) and, for c10d, its own address
            assert f"interface {host.ifname} (routes to {hosts.a.addr} via {host.addr})" in plan, plan
            assert env["GLOO_SOCKET_IFNAME"] == host.ifname
            if backend == "auto":
                assert f"--local-addr={host.addr}" in argv
                assert any(a.startswith("--rdzv-conf=") and a.endswith(f"is_host={str(rank == 0).lower()}")
                           for a in argv), argv
            else:
                assert f"--node_rank={rank}" in argv and "--rdzv-backend=static" in argv
            log = wd / f"node{rank}.log"
            nodes.append((subprocess.Popen(host.cmd(argv), env={**_env(), **env}, stdout=log.open("w"),
                                           stderr=subprocess.STDOUT, cwd=wd, start_new_session=True), log))
        t0 = time.time()
        codes = [p.wait(timeout=600) for p, _ in nodes]
        took = time.time() - t0
    finally:
        _stop(nodes)
    logs = [log.read_text() for _, log in nodes]
    assert codes == [0, 0], "\n----\n".join(text[-3000:] for text in logs)
    two = _last_val(wd)
    print(f"two hosts ({backend}): {took:.1f}s; val accept_len {two['accept_len_epoch']:.6f} "
          f"vs one node {one_node['accept_len_epoch']:.6f}")
    assert two["accept_len_epoch"] == pytest.approx(one_node["accept_len_epoch"], abs=TOLERANCE)
    assert two["loss_epoch"] == pytest.approx(one_node["loss_epoch"], rel=1e-5)


def test_a_node_that_cannot_reach_the_master_fails_within_the_rdzv_timeout(hosts, prepared, tmp_path):  # noqa: F811
    """Node 1 alone on host B: node 0 never starts, so nothing answers at host A's address."""
    wd = tmp_path / "run"
    shutil.copytree(prepared, wd / "prepared")
    timeout = 8
    t0 = time.time()
    proc = _kit(hosts.b, "train", "-r", str(TINY), "--workdir", str(wd),
                *_args("train.nnodes=2", "train.nproc=1", f"train.master_addr={hosts.a.addr}",
                       f"train.master_port={free_port()}", "train.node_rank=1", f"train.rdzv_timeout={timeout}"),
                timeout=300)
    took = time.time() - t0
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert f"train.master_addr {hosts.a.addr}:" in errors[0] and f"train.rdzv_timeout {timeout}s" in errors[0]
    assert "--set train.node_rank=0" in errors[0], errors[0]  # the fix
    assert not (wd / "logs" / "train.log").exists()  # torchrun never started: the kit waited, then said why
    # the wait is rdzv_timeout; the rest is the kit's own start (python, torch, the plan) on 2 loaded cores
    assert took < timeout + 60, took
    print(f"unreachable master: failed after {took:.1f}s (rdzv_timeout {timeout}s): {errors[0]}")


def _start_nodes(hosts, wd: Path, *sets: str) -> list[tuple[subprocess.Popen, Path]]:
    """`dspark-kit train --set train.node_rank=N` on host A (node 0) and host B (node 1)."""
    nodes = []
    for rank, host in enumerate((hosts.a, hosts.b)):
        log = wd / f"node{rank}.err"
        cmd = [*KIT, "train", "-r", str(TINY), *_args(*sets, f"train.node_rank={rank}"), "--workdir", str(wd)]
        nodes.append((subprocess.Popen(host.cmd(cmd), env=_env(), stdout=subprocess.DEVNULL, stderr=log.open("w"),
                                       cwd=wd, start_new_session=True), log))
    return nodes


def _wait_for_epoch0(wd: Path, nodes) -> None:
    epoch0 = wd / "checkpoints" / "0" / "training_state.json"
    deadline = time.time() + 600  # a hang, not a busy machine
    while not epoch0.exists():  # one whole epoch trained together: the job is mid-run
        assert time.time() < deadline, "the two nodes never finished epoch 0"
        assert all(p.poll() is None for p, _ in nodes), [log.read_text()[-2000:] for _, log in nodes]
        time.sleep(0.2)


def _cross_host_sets(hosts, *sets: str) -> tuple[str, ...]:
    return ("train.nnodes=2", "train.nproc=1", f"train.master_addr={hosts.a.addr}",
            f"train.master_port={free_port()}", *sets)


def test_killing_node_1s_worker_restarts_both_hosts_from_the_last_whole_epoch(hosts, prepared, tmp_path):  # noqa: F811
    import psutil

    wd = tmp_path / "run"
    shutil.copytree(prepared, wd / "prepared")
    nodes = _start_nodes(hosts, wd, *_cross_host_sets(hosts, "train.epochs=6", "train.max_restarts=1",
                                                      "train.rdzv_timeout=120"))
    t0 = time.time()
    try:
        _wait_for_epoch0(wd, nodes)
        agent = next(p for p in psutil.Process(nodes[1][0].pid).children(recursive=True)
                     if "torch.distributed.run" in p.cmdline())
        workers = agent.children(recursive=True)
        assert workers
        for w in workers:  # node 1's worker dies; both hosts' agents restart everyone
            w.kill()
        codes = [p.wait(timeout=600) for p, _ in nodes]
    finally:
        _stop(nodes)
    log = (wd / "logs" / "train.log").read_text()  # both nodes' trainers append to the shared run's log
    assert codes == [0, 0], "\n----\n".join(p.read_text()[-3000:] for _, p in nodes) + log[-3000:]
    assert log.count("rank 1 of 2") == 2, log[-3000:]  # one group of two ranks, formed twice
    assert "Resuming training on epoch" in log, log[-3000:]  # from the last whole epoch, not epoch 0
    assert all((wd / "checkpoints" / str(e) / "training_state.json").exists() for e in range(6))
    print(f"two hosts, node 1's worker killed after epoch 0: restarted and finished in {time.time() - t0:.1f}s")


def test_losing_host_a_stops_node_1_within_the_rdzv_timeout_naming_the_master(hosts, prepared, tmp_path):  # noqa: F811
    """Host A (node 0, the c10d store) powers off mid-run: node 1 gets silence, not resets, and
    torchrun alone would wait far longer (measured: still running 300 s later)."""
    from dspark_kit.distributed.rendezvous import MasterWatch
    from dspark_kit.stages.training.train import STOP_GRACE_S

    wd = tmp_path / "run"
    shutil.copytree(prepared, wd / "prepared")
    timeout = 10
    sets = _cross_host_sets(hosts, "train.epochs=50", f"train.rdzv_timeout={timeout}")
    nodes = _start_nodes(hosts, wd, *sets)
    try:
        _wait_for_epoch0(wd, nodes)
        netns.power_off(hosts.a)
        t_off = time.time()
        try:
            code = nodes[1][0].wait(timeout=300)
        except subprocess.TimeoutExpired:
            pytest.fail(f"node 1 still running 300 s after host A died:\n{nodes[1][1].read_text()[-3000:]}")
        waited = time.time() - t_off
    finally:
        _stop(nodes)
        netns.power_on(hosts.a)
    err = nodes[1][1].read_text()
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    print(f"two hosts, host A powered off: node 1 stopped {waited:.1f}s later: {errors}")
    assert code != 0 and len(errors) == 1, err[-3000:]
    assert f"lost the rendezvous master at {hosts.a.addr}:" in errors[0], errors[0]
    # silence for rdzv_timeout (the kit's watch), the trainer's grace to save (it hangs in gloo), exit
    bound = timeout + MasterWatch.probe_timeout_s + STOP_GRACE_S + 15
    assert waited < bound, (waited, bound)
