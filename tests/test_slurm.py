"""`--launcher slurm` against a real slurmctld and two slurmd hosts (tests/slurm_bed.py).

The kit runs where a user would type it, on the cluster's side of the network (host A, with the
clients), submits its batch script with sbatch and follows the job. Both hosts share the file
system, so one run folder serves every node (the shared storage a cluster mounts). Needs root
and the Slurm packages (`make slurm`): without them every test here fails with one line saying so.
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

from dspark_kit.engines.ports import free_port
from dspark_kit.launchers import slurm_job
from tests import slurm_bed
from tests.ctrl_c import default_sigint
from tests.test_multinode import KIT, TINY, _env

pytestmark = pytest.mark.slow
# 16 rows (14 train, 2 val): about 10 s an epoch on 2 loaded cores
SETS = ["train.device=cpu", "train.logger=none", "data.limit=16", "regen.enabled=false", "slurm.poll_s=0.5"]
STAGES = "prepare,hidden-states,train"


def _args(sets) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


@pytest.fixture(scope="module")
def cluster():
    """The controller and two hosts for this module; torn down after it, even after a failure."""
    if (why := slurm_bed.unavailable()) is not None:
        pytest.fail(why, pytrace=False)
    t0 = time.monotonic()
    bed = slurm_bed.up()
    print(f"\n[slurm] controller + 2 hosts idle after {time.monotonic() - t0:.1f}s")
    try:
        yield bed
    finally:
        t0 = time.monotonic()
        slurm_bed.down(bed)
        print(f"[slurm] down in {time.monotonic() - t0:.1f}s")
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
        assert bed.a.ns not in left and bed.b.ns not in left and not bed.root.exists()


@pytest.fixture(scope="module")
def prepared_run(tmp_path_factory) -> Path:
    """prepare + offline hidden states of 16 tiny rows, done in a run folder (state.json says so)."""
    wd = tmp_path_factory.mktemp("slurm-prepared")
    proc = subprocess.run([*KIT, "run", str(TINY), "--stages", "prepare,hidden-states", *_args(SETS), "-w", str(wd),
                           "--json"], capture_output=True, text=True, timeout=300, env=_env(), check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return wd


def _kit(cluster, *argv: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """The kit in host A (where the Slurm clients run)."""
    return subprocess.run(cluster.a.cmd([*KIT, *argv]), capture_output=True, text=True, timeout=timeout,
                          env={**_env(), **cluster.env}, check=False)


def _popen(cluster, *argv: str, err: Path) -> subprocess.Popen:
    return subprocess.Popen(cluster.a.cmd([*KIT, *argv]), env={**_env(), **cluster.env}, stdout=subprocess.DEVNULL,
                            stderr=err.open("w"), start_new_session=True,
                            preexec_fn=default_sigint)  # noqa: PLW1509 - only resets SIGINT (tests/ctrl_c.py)


def _copy(prepared_run: Path, wd: Path) -> Path:
    shutil.copytree(prepared_run, wd)
    return wd


def _job_ids(wd: Path) -> list[str]:
    return sorted((p.stem.removeprefix("slurm-") for p in (wd / "logs").glob("slurm-*.out")), key=int)


def _scontrol(cluster, job_id: str) -> dict:
    import re

    out = cluster.client("scontrol", "show", "job", "-o", job_id).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _errors(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("error:")]


def _train_sets(cluster, *more: str) -> list[str]:
    return [*SETS, "train.nnodes=2", f"train.master_port={free_port()}", "train.rdzv_timeout=120", *more]


def test_run_trains_across_the_two_hosts_under_sbatch_as_its_dry_run_printed(cluster, prepared_run, tmp_path):
    wd = _copy(prepared_run, tmp_path / "run")
    args = ["run", str(TINY), "--stages", STAGES, *_args(_train_sets(cluster, "train.epochs=2")), "-w", str(wd),
            "--launcher", "slurm"]
    dry = _kit(cluster, *args, "--dry-run", timeout=120)
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert "prepare skipped (unchanged)" in dry.stdout and "# stages: train" in dry.stdout  # the run folder's state
    t0 = time.monotonic()
    proc = _kit(cluster, *args)
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (wd / "slurm-job.sbatch").read_text() == dry.stdout  # the dry run printed what was submitted
    [job] = _job_ids(wd)
    info = _scontrol(cluster, job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", info
    assert info["NodeList"] == f"{cluster.a.node},{cluster.b.node}" or "[" in info["NodeList"], info
    out = (wd / "logs" / f"slurm-{job}.out").read_text()
    assert f"on {cluster.a.node} {cluster.b.node}" in out, out[-2000:]
    log = (wd / "logs" / "train.log").read_text()
    assert log.count("rank 1 of 2") == 1, log[-3000:]  # one group of two ranks, one on each host
    assert all((wd / "checkpoints" / str(e) / "training_state.json").exists() for e in range(2))
    state = json.loads((wd / "state.json").read_text())
    assert state["train"]["status"] == "done" and state["prepare"]["status"] == "done"
    assert f"slurm: job {job} RUNNING" in proc.stderr and f"slurm: job {job} COMPLETED" in proc.stderr
    assert "  | train: val accept_len" in proc.stderr  # the stage's own line, relayed from the job's log
    print(f"[slurm] run --launcher slurm, nnodes 2 across the hosts, 2 epochs: {took:.1f}s (job {job})")
    again = _kit(cluster, *args, timeout=120)  # resubmitted: the run folder says it is done
    assert again.returncode == 0 and "nothing to submit" in again.stderr, again.stderr[-2000:]
    assert _job_ids(wd) == [job]


def _wait(pred, what, timeout: float = 600, poll: float = 0.2):
    end = time.monotonic() + timeout
    while not (got := pred()):
        assert time.monotonic() < end, what() if callable(what) else what
        time.sleep(poll)
    return got


EPOCHS = 8


def test_a_killed_node_fails_the_job_in_one_line_ctrl_c_cancels_and_a_resubmission_resumes(cluster, prepared_run,
                                                                                          tmp_path):
    """Host B powers off mid-training (every process on it killed, its slurmd too): Slurm loses the node
    (SlurmdTimeout) and the job fails in one line naming it; B comes back, the next job is Ctrl-C'd,
    the third resumes from the last whole epoch."""
    wd = _copy(prepared_run, tmp_path / "run")
    # eight epochs, where three would do: three took about 1 s here (3 steps an epoch, 9 steps/s), and on a
    # loaded CI runner the job finished between two polls for epoch 0, before host B could be powered off
    args = ["run", str(TINY), "--stages", STAGES, *_args(_train_sets(cluster, f"train.epochs={EPOCHS}")), "-w",
            str(wd), "--launcher", "slurm"]
    epoch0 = wd / "checkpoints" / "0" / "training_state.json"
    kit = _popen(cluster, *args, err=tmp_path / "first.err")
    try:
        _wait(lambda: epoch0.exists() or kit.poll() is not None, "epoch 0 never finished")
        assert kit.poll() is None, (tmp_path / "first.err").read_text()[-3000:]
        assert slurm_bed.power_off(cluster, cluster.b) > 0
        off = time.monotonic()
        code = kit.wait(timeout=300)
        took = time.monotonic() - off
    finally:
        if kit.poll() is None:
            os.killpg(kit.pid, signal.SIGKILL)
        slurm_bed.power_on(cluster, cluster.b)
    err = (tmp_path / "first.err").read_text()
    errors = _errors(err)
    print(f"[slurm] host {cluster.b.node} powered off: the kit exited {code} {took:.1f}s later: {errors}")
    [job] = _job_ids(wd)
    info = _scontrol(cluster, job)
    # the kit's code is the ExitCode it saw when the job ended, "code:signal" as one status (0:15 -> 143);
    # Slurm may reset a NODE_FAIL job's ExitCode to 0:0 afterwards (seen in CI: the kit exited 143, then 0:0)
    assert info["JobState"] == "NODE_FAIL" and code != 0, (info, err[-3000:])
    assert info["ExitCode"] == "0:0" or code == slurm_job._exit_code(info["ExitCode"]), (info["ExitCode"], code)
    assert len(errors) == 1 and f"node {cluster.b.node} was lost" in errors[0] and "resumes" in errors[0], err[-3000:]
    assert json.loads((wd / "state.json").read_text())["train"]["status"] != "done"

    # resubmitted, then Ctrl-C while it runs: the job is cancelled, nothing of it is left on the hosts
    kit = _popen(cluster, *args, err=tmp_path / "second.err")
    try:
        _wait(lambda: len(_job_ids(wd)) == 2 and "dspark-kit job" in (wd / "logs" / f"slurm-{_job_ids(wd)[1]}.out")
              .read_text() or kit.poll() is not None, "the second job never started")
        second = _job_ids(wd)[1]
        os.killpg(kit.pid, signal.SIGINT)
        code = kit.wait(timeout=60)
    finally:
        if kit.poll() is None:
            os.killpg(kit.pid, signal.SIGKILL)
    err = (tmp_path / "second.err").read_text()
    errors = _errors(err)
    assert code == 130 and len(errors) == 1 and f"cancelled Slurm job {second} (scancel)" in errors[0], \
        (code, _scontrol(cluster, second).get("JobState"), err[-3000:])
    _wait(lambda: not cluster.client("squeue", "-h").stdout.strip(), "the cancelled job is still queued", 30)
    _wait(lambda: not any(_work_on(h) for h in cluster.hosts), lambda: [w for h in cluster.hosts for w in _work_on(h)], 30)
    left = [w for h in cluster.hosts for w in _work_on(h)]
    assert not left, left
    assert _scontrol(cluster, second)["JobState"] == "CANCELLED"

    t0 = time.monotonic()
    proc = _kit(cluster, *args)  # the third submission resumes from the last whole epoch and finishes
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = (wd / "logs" / "train.log").read_text()
    assert "Resuming training on epoch" in log, log[-3000:]
    assert all((wd / "checkpoints" / str(e) / "training_state.json").exists() for e in range(EPOCHS))
    assert json.loads((wd / "state.json").read_text())["train"]["status"] == "done"
    print(f"[slurm] resubmitted after the failure and the Ctrl-C: resumed and finished in "
          f"{time.monotonic() - t0:.1f}s")


def _work_on(host: slurm_bed.Host) -> list[str]:
    """The job's processes still running on `host` (anything but the daemons)."""
    import psutil

    out = []
    for pid in subprocess.run(["ip", "netns", "pids", host.ns], capture_output=True, text=True,
                              check=False).stdout.split():
        try:
            cmd = " ".join(psutil.Process(int(pid)).cmdline())
        except psutil.NoSuchProcess:
            continue
        if not any(d in cmd for d in ("slurmctld", "slurmd", "slurmscriptd")):
            out.append(cmd)
    return out


ONLINE_SETS = ["serve.engine=vllm", "hidden_states.mode=online", "slurm.extractor_nodes=1", "train.epochs=1"]


@pytest.mark.vllm_real
def test_online_hidden_states_the_vllm_server_on_one_host_the_trainer_on_the_other(cluster, tiny_verifier,
                                                                                  vllm_cpu_build, tmp_path):
    """Node 0 (host A) trains; node 1 (host B) runs the vLLM CPU extraction server the job started first."""
    wd = tmp_path / "run"
    sets = [*SETS, *ONLINE_SETS, f"serve.hidden_states_port={free_port()}",
            f"hidden_states.storage_path={tmp_path / 'storage'}"]
    prep = subprocess.run([*KIT, "run", str(TINY), "--stages", "prepare", *_args(sets), "-w", str(wd), "--json"],
                          capture_output=True, text=True, timeout=300, env=_env(), check=False)
    assert prep.returncode == 0, prep.stderr[-3000:]
    args = ["run", str(TINY), "--stages", "prepare,hidden-states,train", *_args(sets), "-w", str(wd),
            "--launcher", "slurm"]
    dry = _kit(cluster, *args, "--dry-run", timeout=120)
    assert dry.returncode == 0, dry.stderr[-2000:]
    t0 = time.monotonic()
    proc = _kit(cluster, *args, timeout=900)
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (wd / "slurm-job.sbatch").read_text() == dry.stdout
    [job] = _job_ids(wd)
    assert _scontrol(cluster, job)["ExitCode"] == "0:0"
    out = (wd / "logs" / f"slurm-{job}.out").read_text()
    url = f"http://{cluster.b.node}:"
    assert f"hidden-state server healthy at {url}" in out, out[-3000:]
    manifest = json.loads((wd / "manifest.json").read_text())
    argv = manifest["stages"]["train"]["argv"]
    assert argv[argv.index("--vllm-endpoint") + 1].startswith(url), argv  # the trainer on A asked B's server
    assert (wd / "logs" / "serve-hidden-states.log").exists()
    assert (wd / "checkpoints" / "0" / "training_state.json").exists()
    assert not list((wd / "prepared" / "hidden_states").glob("hs_*.safetensors"))  # none written ahead
    state = json.loads((wd / "state.json").read_text())
    assert state["train"]["status"] == "done"
    print(f"[slurm] online: vLLM server on {cluster.b.node}, trainer on {cluster.a.node}: {took:.1f}s (job {job})")


def test_regen_shares_the_rows_over_a_chat_server_on_each_host(cluster, tmp_path):
    """regen with no endpoints on a 2-node allocation: the kit's chat server on both hosts, regen on node 0."""
    wd = tmp_path / "run"
    sets = ["train.nnodes=2", "data.limit=8", "regen.max_tokens=16", "slurm.poll_s=0.5"]
    t0 = time.monotonic()
    proc = _kit(cluster, "run", str(TINY), "--stages", "regen", *_args(sets), "-w", str(wd), "--launcher", "slurm")
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-4000:]
    [job] = _job_ids(wd)
    out = (wd / "logs" / f"slurm-{job}.out").read_text()
    healthy = next(ln for ln in out.splitlines() if ln.startswith("chat servers healthy at "))
    assert f"http://{cluster.a.node}:" in healthy and f"http://{cluster.b.node}:" in healthy, out[-3000:]
    rows = [json.loads(ln) for ln in (wd / "regen.jsonl").read_text().splitlines()]
    assert len(rows) == 8
    state = json.loads((wd / "state.json").read_text())
    assert state["regen"]["status"] == "done" and state["regen"]["figure"] == 8
    # both servers stop with the job (Slurm ends a job's steps just after it completes)
    _wait(lambda: not any(_work_on(h) for h in cluster.hosts), lambda: [w for h in cluster.hosts for w in _work_on(h)],
          30)
    print(f"[slurm] regen over a chat server on each host: {took:.1f}s (job {job})")
