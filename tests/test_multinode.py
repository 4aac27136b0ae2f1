"""Two nodes on one machine: the commands `train --dry-run` prints really rendezvous, train and restart.

Each "node" is its own torchrun (c10d rendezvous, one CPU worker, gloo), started
from the printed line in its own process group, as two machines would run it.
`train.nodes_same_host: true` is what makes loopback legal here.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dspark_kit.engines.ports import free_port

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "recipes" / "tiny-cpu.yaml"
KIT = [sys.executable, "-m", "dspark_kit"]
pytestmark = pytest.mark.slow


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """prepare + hidden states of 16 tiny rows (the two-node runs copy it)."""
    wd = tmp_path_factory.mktemp("mn-prepared")
    proc = subprocess.run([*KIT, "run", str(TINY), "--stages", "prepare,hidden-states", "--set", "data.limit=16", "--set", "regen.enabled=false",
                           "--workdir", str(wd), "--json"], capture_output=True, text=True, timeout=300,
                          env=_env(), check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return wd / "prepared"


def _node_commands(workdir: Path, *sets: str) -> list[tuple[dict, list[str]]]:
    """The per-node lines `train --dry-run` prints, split into (env, argv)."""
    args = ["--set", "train.nnodes=2", "--set", "train.nproc=1", "--set", "train.nodes_same_host=true",
            "--set", "train.device=cpu", "--set", "train.logger=none", "--set", "data.limit=16", "--set", "regen.enabled=false",
            "--set", f"train.master_port={free_port()}", "--set", "train.rdzv_id=mn-test"]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run([*KIT, "train", "-r", str(TINY), *args, "--workdir", str(workdir), "--dry-run"],
                          capture_output=True, text=True, timeout=120, env=_env(), check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln and not ln.startswith("#")]
    assert len(lines) == 2 and "# node 1" in proc.stdout, proc.stdout
    out = []
    for line in lines:
        words = shlex.split(line)
        n = next(i for i, w in enumerate(words) if "=" not in w or w.startswith("-"))
        out.append((dict(w.split("=", 1) for w in words[:n]), words[n:]))
    return out


def _launch(commands, workdir: Path) -> list[tuple[subprocess.Popen, Path]]:
    nodes = []
    for i, (env, argv) in enumerate(commands):
        log = workdir / f"node{i}.log"
        nodes.append((subprocess.Popen(argv, env={**_env(), **env}, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                       cwd=workdir, start_new_session=True), log))
    return nodes


def _kill_node(proc: subprocess.Popen) -> None:
    """SIGKILL a "machine": the torchrun agent and its workers (torchrun puts workers in their own sessions)."""
    import psutil

    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()


def _stop(nodes) -> None:
    for proc, _ in nodes:
        if proc.poll() is None:
            _kill_node(proc)


def _workdir(tmp_path: Path, prepared: Path) -> Path:
    wd = tmp_path / "run"
    shutil.copytree(prepared, wd / "prepared")
    return wd


def test_two_nodes_rendezvous_train_and_restart_from_the_last_whole_epoch(tmp_path, prepared):
    """Both nodes join one gloo group, train, write epoch 0; a worker killed then is restarted
    (train.max_restarts=1) on both nodes, the job resumes at epoch 1 and both nodes exit 0."""
    wd = _workdir(tmp_path, prepared)
    commands = _node_commands(wd, "train.epochs=6", "train.max_restarts=1", "train.rdzv_timeout=120")
    (env0, argv0), (env1, argv1) = commands
    assert env0 == env1 and env0["GLOO_SOCKET_IFNAME"] == "lo"
    # one difference: node 0 hosts the c10d store (is_host; torchrun's hostname guess fails off loopback)
    assert [a.replace("is_host=true", "is_host=false") for a in argv0] == argv1 and argv0 != argv1
    assert env0["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"  # else the restarted workers hang (pytorch#135712)
    assert "--rdzv-backend=c10d" in argv0 and "--nnodes=2" in argv0 and "--nproc_per_node=1" in argv0
    nodes = _launch(commands, wd)
    t0 = time.time()
    epoch0 = wd / "checkpoints" / "0" / "training_state.json"
    try:
        while not epoch0.exists():  # trained together up to one whole checkpoint
            assert time.time() - t0 < 600 and all(p.poll() is None for p, _ in nodes), \
                [log.read_text()[-2000:] for _, log in nodes]
            time.sleep(0.2)
        import psutil

        workers = psutil.Process(nodes[1][0].pid).children(recursive=True)
        assert workers
        for w in workers:  # node 1's worker dies; its agent and node 0's restart everyone
            w.kill()
        codes = [proc.wait(timeout=400) for proc, _ in nodes]
    finally:
        _stop(nodes)
    logs = [log.read_text() for _, log in nodes]
    assert codes == [0, 0], "\n----\n".join(text[-3000:] for text in logs)
    joined = "\n".join(logs)
    # one process group of two ranks, formed twice (before and after the restart)
    assert joined.count("rank 0 of 2") == 2 and joined.count("rank 1 of 2") == 2, joined[-3000:]
    assert "Resuming training on epoch" in joined, joined[-3000:]  # from the last whole epoch, not epoch 0
    ck = wd / "checkpoints"
    assert all((ck / str(e) / "training_state.json").exists() for e in range(6))
    print(f"two-node train with one restart: {time.time() - t0:.1f}s")


def test_killing_a_node_fails_the_job_within_the_rendezvous_timeout(tmp_path, prepared):
    wd = _workdir(tmp_path, prepared)
    # long enough to be mid-run when killed; one restart allowed, then the survivor waits
    # at most train.rdzv_timeout for the dead node to rejoin
    commands = _node_commands(wd, "train.epochs=50", "train.max_restarts=1", "train.rdzv_timeout=10")
    assert "--max-restarts=1" in commands[0][1] and "--rdzv-conf=join_timeout=10,read_timeout=10,is_host=true" in commands[0][1]
    nodes = _launch(commands, wd)
    epoch0 = wd / "checkpoints" / "0" / "training_state.json"
    try:
        deadline = time.time() + 600  # a hang, not a busy machine
        while not epoch0.exists():  # one whole epoch trained together: the job is mid-run
            assert time.time() < deadline, "the two nodes never finished epoch 0"
            assert all(proc.poll() is None for proc, _ in nodes), [log.read_text()[-2000:] for _, log in nodes]
            time.sleep(0.5)
        killed, survivor = nodes[1][0], nodes[0][0]
        _kill_node(killed)  # the whole "machine": agent and worker
        t_kill = time.time()
        try:
            # join timeout 10 s + restart + teardown; torch's default join timeout is 600 s, so a
            # survivor still waiting at 300 s did not take the recipe's rdzv_timeout
            code = survivor.wait(timeout=300)
        except subprocess.TimeoutExpired:
            pytest.fail(f"survivor still waiting 300 s after its peer died:\n{nodes[0][1].read_text()[-3000:]}")
        waited = time.time() - t_kill
    finally:
        _stop(nodes)
    log = nodes[0][1].read_text()
    assert code != 0, log[-3000:]
    # the worker saw the peer go (gloo), then the agent gave up: restart found no peer in time,
    # or the rendezvous store went with the killed node
    assert "Connection reset by peer" in log or "Rendezvous" in log, log[-3000:]
    print(f"survivor exited {code} {waited:.1f}s after the kill")
