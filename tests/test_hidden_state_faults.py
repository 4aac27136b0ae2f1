"""Faults on the way from an extraction server to training: a row whose hidden states never
arrive, or arrive for other tokens, is an error naming the row (offline and online), never a
silent skip; a server that dies during online training stops it with one line naming the server,
and a rerun resumes (from the interrupted save, else the last whole epoch); an external server
stopping is seen through its /health."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_hs_server import FakeHiddenStateServer

from dspark_kit.recipe import load_recipe
from dspark_kit.resolved import Resolved
from dspark_kit.stages.steps import run_stage

pytestmark = pytest.mark.slow

TINY = Path(__file__).resolve().parent.parent / "recipes" / "tiny-cpu.yaml"
ROWS, BAD_ROW = 12, 5  # the bad row is in the train split (train_data_ratio 0.875)
REASON = {"no-path": "missing kv_transfer_params", "wrong-ids": "Token ids don't match"}


def recipe(*sets: str):
    return load_recipe(TINY, ["regen.enabled=false", f"data.limit={ROWS}", "train.epochs=1", *sets])


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_verifier):
    from datasets import load_from_disk

    wd = tmp_path_factory.mktemp("prepared-run")
    run_stage("prepare", Resolved(recipe(), wd))
    rows = [list(map(int, r)) for r in load_from_disk(str(wd / "prepared"))["input_ids"]]
    assert len(rows) > BAD_ROW + 2
    return wd, rows


@pytest.fixture()
def fake(prepared, tmp_path, tiny_verifier, request):
    _, rows = prepared
    with FakeHiddenStateServer(str(tiny_verifier), tmp_path / "storage", layers=4, hidden=128,
                               faults={tuple(rows[BAD_ROW]): request.param}) as srv:
        yield srv


def run_dir(prepared, tmp_path) -> Path:
    wd = tmp_path / "run"
    shutil.copytree(prepared[0] / "prepared", wd / "prepared")
    return wd


@pytest.mark.parametrize("fake", ["no-path", "wrong-ids"], indirect=True)
def test_offline_bad_row_is_named(prepared, fake, tmp_path):
    wd = run_dir(prepared, tmp_path)
    r = recipe("hidden_states.backend=vllm", f"hidden_states.endpoint={fake.url}",
               f"hidden_states.storage_path={fake.storage}")
    with pytest.raises(RuntimeError) as e:
        run_stage("hidden-states", Resolved(r, wd))
    msg = str(e.value)
    print(f"\n[faults] offline {next(iter(fake.faults.values()))}: {msg}")
    assert f"row {BAD_ROW} of {wd / 'prepared'}" in msg and REASON[fake.faults[tuple(prepared[1][BAD_ROW])]] in msg
    assert fake.url in msg and "\n" not in msg
    assert not (wd / "prepared" / "hidden_states" / f"hs_{BAD_ROW}.safetensors").exists()  # a rerun asks again


@pytest.mark.parametrize("fake", ["no-path", "wrong-ids"], indirect=True)
def test_online_bad_row_stops_training_naming_it(prepared, fake, tmp_path):
    wd = run_dir(prepared, tmp_path)
    r = recipe("hidden_states.mode=online", f"hidden_states.endpoint={fake.url}",
               f"hidden_states.storage_path={fake.storage}")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        run_stage("train", Resolved(r, wd))
    msg = str(e.value)
    print(f"\n[faults] online {next(iter(fake.faults.values()))}: stopped after {time.monotonic() - t0:.0f}s: {msg}")
    assert msg.startswith(f"hidden states for prepared row {BAD_ROW} from {fake.url} failed")
    assert REASON[fake.faults[tuple(prepared[1][BAD_ROW])]] in msg and "\n" not in msg
    assert fake.requests.count(prepared[1][BAD_ROW]) >= 1  # really asked, not skipped
    assert not list((wd / "checkpoints").glob("[0-9]*"))  # no epoch trained without that row


def _pids_with(arg: str) -> list[int]:
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if arg.encode() in argv and b"dspark_kit.engines.local.server" in argv:
            pids.append(int(cmdline.parent.name))
    return pids


def test_server_death_stops_training_and_rerun_resumes(prepared, tmp_path):
    """The kit started the extraction server (the local engine here: the watch is the same for
    every engine); SIGKILL it during epoch 1 and training stops within seconds, naming it."""
    wd = run_dir(prepared, tmp_path)
    storage = tmp_path / "hs-storage"
    cmd = [sys.executable, "-m", "dspark_kit", "train", "-r", str(TINY), "-w", str(wd),
           *[a for s in ["regen.enabled=false", f"data.limit={ROWS}", "train.epochs=2", "hidden_states.mode=online",
                         f"hidden_states.storage_path={storage}"] for a in ("--set", s)]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        first = wd / "checkpoints" / "0" / "training_state.json"  # speculators writes it last
        deadline = time.monotonic() + 600
        while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # kill early in epoch 1, while it still needs the server
        assert first.exists(), "epoch 0 never finished"
        servers = _pids_with(str(storage))
        assert len(servers) == 1, servers
        os.kill(servers[0], signal.SIGKILL)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=300)  # bounded: the watch polls every second, the trainer gets 30 s
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    stopped_s = time.monotonic() - killed
    # the error line, wherever late warnings put it
    last = next((x for x in reversed(err.splitlines()) if "error: train:" in x), err.strip()[-500:])
    print(f"\n[faults] server killed: training stopped {stopped_s:.0f}s later: {last}")
    assert proc.returncode != 0 and stopped_s < 120
    assert "the hidden-state server http://127.0.0.1:" in last and "exited with code -9" in last, err[-2000:]
    assert "resume" in last and not (wd / "checkpoints" / "1").exists()
    epoch0 = (wd / "checkpoints" / "0" / "model.safetensors").stat().st_mtime_ns

    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    log = (wd / "logs" / "train.log").read_text()
    assert "Resuming training on epoch" in log or "Resuming mid-epoch" in log
    assert (wd / "checkpoints" / "1" / "training_state.json").exists()
    assert (wd / "checkpoints" / "0" / "model.safetensors").stat().st_mtime_ns == epoch0  # resumed, not redone


def _cli(wd: Path, *sets: str) -> list[str]:
    return [sys.executable, "-m", "dspark_kit", "train", "-r", str(TINY), "-w", str(wd),
            *[a for s in ["regen.enabled=false", f"data.limit={ROWS}", *sets] for a in ("--set", s)]]


def test_external_server_stopping_stops_training_within_the_bound(prepared, tmp_path, tiny_verifier):
    """hidden_states.endpoint is a server the kit did not start: it is watched through /health, and
    one gone mid-training stops it within EXTERNAL_GONE_AFTER_S + the trainer's stop grace, in one line."""
    from dspark_kit.engines.servers import EXTERNAL_GONE_AFTER_S
    from dspark_kit.stages.training.train import STOP_GRACE_S

    wd = run_dir(prepared, tmp_path)
    fake = FakeHiddenStateServer(str(tiny_verifier), tmp_path / "storage", layers=4, hidden=128, faults={})
    cmd = _cli(wd, "train.epochs=2", "hidden_states.mode=online", f"hidden_states.endpoint={fake.url}",
               f"hidden_states.storage_path={fake.storage}")
    with fake:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            deadline = time.monotonic() + 600
            while len(fake.requests) < 3 and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)  # training has asked the server: stop it in use
            assert len(fake.requests) >= 3, "training never asked the server"
    # leaving `with fake` shut it down: connections are refused from here on
            stopped = time.monotonic()
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    took = time.monotonic() - stopped
    last = next((x for x in reversed(err.splitlines()) if "error: train:" in x), err.strip()[-500:])
    print(f"\n[faults] external server stopped: training stopped {took:.0f}s later: {last}")
    bound = EXTERNAL_GONE_AFTER_S + STOP_GRACE_S + 15  # + the watch's poll and probe, the kit's exit
    assert proc.returncode != 0 and took < bound, (took, err[-2000:])
    assert f"the hidden-state server {fake.url} (hidden_states.endpoint) has not answered" in last, err[-2000:]
    assert not (wd / "checkpoints" / "1").exists()

