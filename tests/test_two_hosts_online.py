"""Online hidden states across two real hosts (tests/netns.py): the server on host A, the trainer on host B.

Host A (10.77.0.1) runs the kit's vLLM CPU extraction server, started with the line a user
types there (`dspark-kit serve --role hidden-states`, serve.host = A's address); host B
(10.77.0.2) runs `dspark-kit train` with hidden_states.endpoint = A's URL. Files: the server
writes each row's hidden states into storage_path, the one file system both hosts share (the
shared storage a cluster mounts). Mooncake: `serve` on A starts mooncake_master and the server
joins its store as A's address; the trainer on B joins as B's address (each host's route to
the master) and gets the tensors over TCP: no hidden-state file anywhere. The same training
on host A itself is the yardstick: the figures must agree, whichever transport and host.
Last, host A dies (every process killed, its link down: no reset, only silence) and training
on B stops within the documented bound with one line. Needs root and vLLM's CPU build.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from test_vllm_real_mooncake import mooncake_cpu  # noqa: F401 - fixture

from dspark_kit.engines.ports import free_port, free_ports_in_a_row
from tests import netns
from tests.ctrl_c import default_sigint
from tests.test_multinode import KIT, TINY, _env

pytestmark = [pytest.mark.vllm_real, pytest.mark.slow]

# 16 rows (14 train, 2 val), 2 epochs: the server answers every row of every epoch
SETS = ["serve.engine=vllm", "train.device=cpu", "train.logger=none", "regen.enabled=false", "data.limit=16",
        "train.epochs=2", "hidden_states.mode=online"]
MOONCAKE_SETS = ["hidden_states.transport=mooncake", "hidden_states.mooncake.global_segment_gib=0.0625",
                 "hidden_states.mooncake.local_buffer_gib=0.0625"]
# the same hidden states (float32, the same server code) in the same order: acceptance agrees to the print
TOLERANCE = 1e-6


def _args(sets) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_verifier) -> Path:
    wd = tmp_path_factory.mktemp("2h-prepared")
    proc = subprocess.run([*KIT, "prepare", "-r", str(TINY), "-w", str(wd), *_args(SETS)], capture_output=True,
                          text=True, timeout=600, env=_env(), check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return wd / "prepared"


class HostServer:
    """`dspark-kit serve --role hidden-states` on a host, from the line a user types there."""

    def __init__(self, host: netns.Host, workdir: Path, sets: list[str]):
        self.port = free_port()
        self.url = f"http://{host.addr}:{self.port}"
        self.workdir = workdir
        cmd = [*KIT, "serve", "--role", "hidden-states", "-r", str(TINY), "-w", str(workdir), "--port",
               str(self.port), *_args([*sets, f"serve.host={host.addr}"])]
        self.err = (workdir / "serve.stderr").open("w")
        self.proc = subprocess.Popen(host.cmd(cmd), env=_env(), stdout=subprocess.PIPE, stderr=self.err, text=True,
                                     start_new_session=True,
                                     preexec_fn=default_sigint)  # noqa: PLW1509 - stop()'s Ctrl-C must reach serve
        t0 = time.monotonic()
        line = self.proc.stdout.readline().strip()  # the URL once healthy; "" when it exited
        assert line == self.url, self.stderr()
        self.startup_s = time.monotonic() - t0

    def stderr(self) -> str:
        return (self.workdir / "serve.stderr").read_text()[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # serve's Ctrl-C: stops its server(s) cleanly
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.err.close()


def _train(host: netns.Host, prepared: Path, wd: Path, sets: list[str], timeout: float = 900) -> dict:
    shutil.copytree(prepared, wd / "prepared")
    t0 = time.monotonic()
    proc = subprocess.run(host.cmd([*KIT, "train", "-r", str(TINY), "-w", str(wd), "--json", *_args(sets)]),
                          capture_output=True, text=True, timeout=timeout, env=_env(), check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    out["wall_s"] = time.monotonic() - t0
    return out


@pytest.fixture(scope="module")
def file_server(hosts, tmp_path_factory, tiny_verifier, vllm_cpu_build):
    root = tmp_path_factory.mktemp("2h-file-server")
    server = HostServer(hosts.a, root, [*SETS, f"hidden_states.storage_path={root / 'storage'}"])
    print(f"\n[2 hosts] hidden-state server on host A healthy after {server.startup_s:.0f}s: {server.url}")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def same_host(hosts, file_server, prepared, tmp_path_factory) -> dict:
    """The yardstick: the trainer on host A, beside the server."""
    wd = tmp_path_factory.mktemp("2h-same-host")
    storage = file_server.workdir / "storage"
    out = _train(hosts.a, prepared, wd, [*SETS, f"hidden_states.endpoint={file_server.url}",
                                         f"hidden_states.storage_path={storage}"])
    print(f"[2 hosts] same host (A): val accept_len {out['accept_len_epoch']:.6f}, {out['wall_s']:.0f}s")
    return out


def test_trainer_on_host_b_reads_hidden_states_from_the_server_on_host_a(hosts, file_server, same_host, prepared,
                                                                        tmp_path):
    storage = file_server.workdir / "storage"
    out = _train(hosts.b, prepared, tmp_path / "run", [*SETS, f"hidden_states.endpoint={file_server.url}",
                                                       f"hidden_states.storage_path={storage}"])
    log = (tmp_path / "run" / "logs" / "train.log").read_text()
    assert f"{file_server.url}/v1/completions" in log or "/v1/completions" in log  # B asked A for every row
    assert not list((tmp_path / "run" / "prepared" / "hidden_states").glob("hs_*.safetensors"))  # none ahead
    print(f"[2 hosts] files, trainer on B: val accept_len {out['accept_len_epoch']:.6f} "
          f"(same host {same_host['accept_len_epoch']:.6f}), {out['wall_s']:.0f}s")
    assert out["accept_len_epoch"] == pytest.approx(same_host["accept_len_epoch"], abs=TOLERANCE)
    assert out["loss_epoch"] == pytest.approx(same_host["loss_epoch"], rel=1e-5)


def test_mooncake_master_and_store_on_host_a_trainer_on_host_b(hosts, mooncake_cpu, same_host, prepared,  # noqa: F811
                                                               tmp_path):
    """No shared files: storage_path is a folder only host A's server could write, and nothing is written."""
    master_port = free_ports_in_a_row(2)  # mooncake_master: RPC, HTTP
    storage = tmp_path / "unused-storage"
    sets = [*SETS, *MOONCAKE_SETS, f"hidden_states.mooncake.master_host={hosts.a.addr}",
            f"hidden_states.mooncake.master_port={master_port}", f"hidden_states.storage_path={storage}"]
    (tmp_path / "a").mkdir()
    server = HostServer(hosts.a, tmp_path / "a", sets)  # starts mooncake_master, then joins its store
    try:
        print(f"\n[2 hosts] mooncake_master + hidden-state server on host A healthy after {server.startup_s:.0f}s")
        dry = subprocess.run(hosts.b.cmd([*KIT, "train", "-r", str(TINY), "-w", str(tmp_path / "run"), "--dry-run",
                                          *_args([*sets, f"hidden_states.endpoint={server.url}"])]),
                             capture_output=True, text=True, timeout=120, env=_env(), check=False)
        assert dry.returncode == 0, dry.stderr[-2000:]
        assert f"MOONCAKE_LOCAL_HOSTNAME={hosts.b.addr}" in dry.stdout  # B joins as its own address
        assert "mooncake_master --rpc_port" not in dry.stdout  # A runs the master, not B
        out = _train(hosts.b, prepared, tmp_path / "run", [*sets, f"hidden_states.endpoint={server.url}"])
    finally:
        server.stop()
    server_log = (tmp_path / "a" / "logs" / "hidden-states-server.log")
    logs = "\n".join(p.read_text() for p in (tmp_path / "a").rglob("*.log"))
    assert "Master service started" in logs and "CpuMooncakeHiddenStatesConnector" in logs, server_log
    assert f"'local_hostname': '{hosts.a.addr}'" in logs or f'"local_hostname":"{hosts.a.addr}"' in logs
    argv = json.loads((tmp_path / "run" / "manifest.json").read_text())["stages"]["train"]["argv"]
    assert argv[argv.index("--mooncake-master") + 1] == f"{hosts.a.addr}:{master_port}"
    assert not list(storage.rglob("*.safetensors")) and not list(tmp_path.rglob("hs_*.safetensors"))
    print(f"[2 hosts] mooncake, master + store on A, trainer on B: val accept_len {out['accept_len_epoch']:.6f} "
          f"(files, same host {same_host['accept_len_epoch']:.6f}), {out['wall_s']:.0f}s")
    assert out["accept_len_epoch"] == pytest.approx(same_host["accept_len_epoch"], abs=TOLERANCE)
    assert out["loss_epoch"] == pytest.approx(same_host["loss_epoch"], rel=1e-5)


def test_host_a_dying_stops_training_on_host_b_within_the_bound(hosts, file_server, prepared, tmp_path):
    """Last in the module: it takes host A (and the module's server) down."""
    from dspark_kit.engines.servers import EXTERNAL_GONE_AFTER_S
    from dspark_kit.stages.training.train import STOP_GRACE_S

    wd = tmp_path / "run"
    shutil.copytree(prepared, wd / "prepared")
    sets = [*SETS, "train.epochs=4", f"hidden_states.endpoint={file_server.url}",
            f"hidden_states.storage_path={file_server.workdir / 'storage'}"]
    proc = subprocess.Popen(hosts.b.cmd([*KIT, "train", "-r", str(TINY), "-w", str(wd), *_args(sets)]), env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        first = wd / "checkpoints" / "0" / "training_state.json"
        deadline = time.monotonic() + 600
        while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)  # epoch 1 still needs the server
        assert first.exists(), "epoch 0 never finished"
        killed = netns.power_off(hosts.a)
        died = time.monotonic()
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        netns.power_on(hosts.a)
    took = time.monotonic() - died
    last = next((x for x in reversed(err.splitlines()) if "error: train:" in x), err.strip()[-500:])
    print(f"\n[2 hosts] host A powered off ({killed} processes killed, link down): training on B stopped "
          f"{took:.0f}s later: {last}")
    bound = EXTERNAL_GONE_AFTER_S + STOP_GRACE_S + 15  # the watch's poll and probe, the kit's exit
    assert proc.returncode != 0 and took < bound, (took, err[-2000:])
    assert f"the hidden-state server {file_server.url} (hidden_states.endpoint) has not answered" in last, err[-2000:]
    assert (wd / "checkpoints" / "0").exists() and not (wd / "checkpoints" / "3").exists()
