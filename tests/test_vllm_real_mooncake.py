"""hidden_states.transport mooncake for real, on one machine over TCP: `dspark-kit train` starts
mooncake_master, the vLLM CPU build as the producer (the kit's CPU subclass of hs_connectors'
Mooncake connector) and speculators' trainer consuming through the store (`--hidden-states-backend
mooncake`): no hidden-state file is written anywhere.

Needs `make mooncake-cpu` (`make test` runs it); like the vLLM build, a failed install fails these
tests with one line, and a missing one skips them (fails on CI)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_build import on_ci

from dspark_kit.engines.ports import free_ports_in_a_row

pytestmark = [pytest.mark.vllm_real, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "recipes" / "tiny-cpu.yaml"
MOONCAKE_FAILED = REPO / ".venv-vllm.mooncake-failed"  # the Makefile's $(MOONCAKE_FAILED)


@pytest.fixture(scope="module")
def mooncake_cpu(vllm_cpu_build) -> None:
    if MOONCAKE_FAILED.exists():
        pytest.fail(f"Mooncake: {MOONCAKE_FAILED.read_text().strip()} (see the `make test` log)", pytrace=False)
    probe = [str(vllm_cpu_build), "-c", "import hs_connectors.mooncake_hidden_states_connector, mooncake.store"]
    here = importlib.util.find_spec("mooncake") is not None
    there = subprocess.run(probe, capture_output=True, check=False).returncode == 0
    if not (here and there):
        why = f"Mooncake not installed ({'.venv-vllm' if here else '.venv'}): run `make mooncake-cpu`"
        pytest.fail(why, pytrace=False) if on_ci() else pytest.skip(why)


def test_online_training_through_mooncake(mooncake_cpu, tmp_path, tiny_verifier):
    storage = tmp_path / "hs-storage"
    sets = ["serve.engine=vllm", "train.device=cpu", "regen.enabled=false", "data.limit=16", "train.epochs=1",
            "hidden_states.mode=online", "hidden_states.transport=mooncake", f"hidden_states.storage_path={storage}",
            f"hidden_states.mooncake.master_port={free_ports_in_a_row(2)}",
            "hidden_states.mooncake.global_segment_gib=0.0625", "hidden_states.mooncake.local_buffer_gib=0.0625"]
    cmd = [sys.executable, "-m", "dspark_kit", "run", str(TINY), "-w", str(tmp_path), "--json",
           "--stages", "prepare,hidden-states,train", *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    stages = {s["stage"]: s for s in json.loads(proc.stdout)["stages"]}
    assert stages["train"]["figure"] > 1.0  # a real validation pass on hidden states from the store
    argv = json.loads((tmp_path / "manifest.json").read_text())["stages"]["train"]["argv"]
    assert argv[argv.index("--hidden-states-backend") + 1] == "mooncake"
    logs = tmp_path / "logs"
    assert "Master service started" in (logs / "mooncake-master.log").read_text()
    server_log = (logs / "hidden-states-server.log").read_text()
    assert "CpuMooncakeHiddenStatesConnector" in server_log and "/v1/completions" in (logs / "train.log").read_text()
    assert not list(storage.rglob("*.safetensors")) and not list(tmp_path.rglob("hs_*.safetensors"))  # no files
    print(f"\n[mooncake] online training through the store: val accept_len {stages['train']['figure']:.3f}, "
          f"train {stages['train']['seconds']}s")
