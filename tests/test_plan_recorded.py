"""What `--dry-run --json` prints is what runs: every stage of the tiny recipe records the plan it
executed in DIR/plans/<stage>.json, and it equals the dry run's plan (argv, environment, ports,
paths, K, window, devices), but for ports the plan marks as taken at start (serve.port 0 in the
tiny recipe), which engines/ports.py decides the same way on both paths."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY_RECIPE, set_args

from dspark_kit.stages.plan import comparable

pytestmark = pytest.mark.slow


def dry_run_plans(cmd: list[str]) -> dict[str, dict]:
    proc = subprocess.run([*cmd, "--dry-run", "--json"], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {p["stage"]: p for p in json.loads(proc.stdout)["plans"]}


def assert_recorded_equals_dry_run(wd: Path, planned: dict[str, dict], stages: list[str]) -> None:
    for stage in stages:
        recorded = json.loads((wd / "plans" / f"{stage}.json").read_text())
        assert comparable(recorded) == comparable(planned[stage]), stage


def kit_run(wd: Path, stages: str, sets: list[str]) -> list[str]:
    return [sys.executable, "-m", "dspark_kit", "run", str(TINY_RECIPE), "--stages", stages, "--workdir", str(wd),
            "--json", *set_args(sets)]


def test_prepare_hidden_states_and_train_ran_the_plans_their_dry_run_printed(trained_run):
    """The session's run was dry-run first with the same command (tests/conftest.py)."""
    dry = json.loads((trained_run.parent / f"{trained_run.name}-dry-run.json").read_text())
    planned = {p["stage"]: p for p in dry["plans"]}
    assert_recorded_equals_dry_run(trained_run, planned, ["prepare", "hidden-states", "train"])
    [trainer] = planned["train"]["processes"]
    assert trainer["role"] == "trainer" and "dspark_kit.compat.train_entry" in trainer["argv"]
    assert planned["train"]["decisions"]["train_device"]["value"] == "cpu"
    assert planned["prepare"]["outputs"]["prepared"] == str(trained_run / "prepared")


def test_regen_and_report_ran_the_plans_their_dry_run_printed_on_the_configured_port(tmp_path):
    """regen starts the local engine's chat server on serve.port: the dry run, the recorded plan and the
    server the rows came from agree on it (tests/test_served_gate.py covers ports taken at start)."""
    from dspark_kit.engines.ports import free_port

    port = free_port()
    wd = tmp_path / "run"
    cmd = kit_run(wd, "regen,report", ["data.limit=3", "regen.max_tokens=8", f"serve.port={port}"])
    planned = dry_run_plans(cmd)
    assert not wd.exists()  # the dry run wrote nothing
    [chat] = planned["regen"]["processes"]
    assert (chat["role"], chat["port"], chat["port_chosen_at_start"], chat["port_source"]) == (
        "chat server", port, False, "serve.port")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_recorded_equals_dry_run(wd, planned, ["regen", "report"])
    recorded = json.loads((wd / "plans" / "regen.json").read_text())
    assert recorded["processes"][0] == chat  # nothing set aside: equal as printed
    assert f":{port}" in (wd / "regen.jsonl").read_text()  # every row says the endpoint it came from
