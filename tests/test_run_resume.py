"""Issue 6: killing `dspark-kit run` during train and running it again resumes training
and skips the finished stages."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TINY_RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "tiny-cpu.yaml"
pytestmark = pytest.mark.slow


def _cmd(wd):
    return [sys.executable, "-m", "dspark_kit", "run", str(TINY_RECIPE), "--workdir", str(wd),
            "--stages", "prepare,hidden-states,train", "--json",
            "--set", "train.epochs=3", "--set", "data.limit=40", "--set", "regen.enabled=false"]


def test_killed_training_resumes_and_finished_stages_are_skipped(tmp_path, tiny_verifier):
    proc = subprocess.Popen(_cmd(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    first = tmp_path / "checkpoints" / "0" / "training_state.json"  # speculators writes it last
    deadline = time.time() + 600
    while not first.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.5)
    assert first.exists(), "epoch 0 never finished"
    os.killpg(proc.pid, signal.SIGKILL)  # the whole group: CLI and trainer, like a lost node
    proc.wait()
    assert not (tmp_path / "checkpoints" / "2").exists()
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["train"]["status"] == "running"
    # a kill during the next save leaves an epoch dir half-written (truncated optimizer state)
    half = tmp_path / "checkpoints" / "1"
    half.mkdir(exist_ok=True)
    (half / "model.safetensors").write_bytes((tmp_path / "checkpoints" / "0" / "model.safetensors").read_bytes())
    (half / "optimizer_state_dict.pt").write_bytes(b"PK\x03\x04truncated")
    (half / "training_state.json").unlink(missing_ok=True)

    out = subprocess.run(_cmd(tmp_path), capture_output=True, text=True, timeout=900, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["stage"]: r["status"] for r in json.loads(out.stdout)["stages"]}
    assert rows == {"prepare": "skipped (unchanged)", "hidden-states": "skipped (unchanged)", "train": "done"}
    log = (tmp_path / "logs" / "train.log").read_text()
    assert "Resuming training on epoch" in log or "Resuming mid-epoch" in log
    assert (tmp_path / "checkpoints" / "2" / "model.safetensors").exists()
    assert (tmp_path / "checkpoints" / "incomplete-1" / "optimizer_state_dict.pt").exists()  # kept, not deleted
