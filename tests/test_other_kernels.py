"""A second machine in CI: the trained pipeline, regen -> prepare -> hidden states -> train -> eval on the
tiny recipe, under ATEN_CPU_CAPABILITY=default (other CPU kernels, other rounding: what a stranger's
machine may run), with one stray-reasoning reply planted among its 128 regenerated rows (half the demo's: the flow on
other kernels, not the demo's figure, which `ATEN_CPU_CAPABILITY=default make demo` measures).

Greedy decoding can pick other tokens under other kernels, so nothing here expects a particular reply
or figure: the pipeline must run to the end, the planted row must be dropped and counted in one line
by regen (and skipped as regen decided by prepare), and the draft must train and accept tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from planting_proxy import PlantingProxy, stray_reasoning

from tests.conftest import TINY_RECIPE

pytestmark = pytest.mark.slow
OTHER_KERNELS = {"ATEN_CPU_CAPABILITY": "default"}
ROWS = 128  # half the demo's 256: every stage runs on them, in half the suite time


def test_the_trained_pipeline_on_other_kernels_with_one_stray_reply(tmp_path, tiny_verifier, monkeypatch):
    from dspark_kit.engines.lifecycle import ManagedServer
    from dspark_kit.recipe import load_recipe
    from dspark_kit.resolved import Resolved
    from dspark_kit.stages.server_plan import server_plan

    for k, v in OTHER_KERNELS.items():
        monkeypatch.setenv(k, v)  # the engine below inherits it, as does the CLI
    recipe = load_recipe(TINY_RECIPE, ["serve.port=0"])
    server = ManagedServer(server_plan(Resolved(recipe, tmp_path / "engine"), "chat"), tmp_path / "engine.log")
    server.start()
    try:
        server.wait_healthy(120)
        proxy = PlantingProxy(server.base_url, stray_reasoning(lambda _n, planted: planted < 1))
        try:
            wd = tmp_path / "run"
            cmd = [sys.executable, "-m", "dspark_kit", "run", str(TINY_RECIPE), "-w", str(wd), "--json",
                   "--stages", "regen,prepare,hidden-states,train,eval", "--set", f"regen.endpoints=[{proxy.url}]",
                   "--set", "train.epochs=2", "--set", f"data.limit={ROWS}"]  # the flow on other kernels, not the demo's 8-epoch figure
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, check=False,
                                  env={**os.environ, **OTHER_KERNELS})
        finally:
            proxy.stop()
    finally:
        server.stop()
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proxy.planted == 1
    stages = {s["stage"]: s for s in json.loads(proc.stdout)["stages"]}
    mode_line = f"dropped 1 of {ROWS} rows: reply carries reasoning but the row's thinking mode is off"
    assert sum(mode_line in line for line in proc.stderr.splitlines()) == 1, proc.stderr[-4000:]  # one line
    regen = [json.loads(line) for line in (wd / "regen.jsonl").read_text().splitlines()]
    assert len(regen) == ROWS and sum(r["metadata"]["mode_check"] != "ok" for r in regen) == 1
    prepared = json.loads((wd / "prepared" / "prepare_meta.json").read_text())["summary"]
    assert prepared["mode_dropped_by_regen"] == 1 and prepared["mode_rule"]["rows"] == 0
    assert prepared["conversations_in"] == ROWS == prepared["conversations_used"] + sum(prepared["rejected"].values())
    assert prepared["conversations_used"] >= ROWS // 2, prepared["rejected"]  # truncated replies may go, not most
    trained, accepted = stages["train"]["figure"], stages["eval"]["figure"]
    assert trained > 1.0 and accepted > 1.0, (trained, accepted)
    print(f"\n[other kernels] regen {len(regen)} rows written (1 planted, dropped), prepare "
          f"{prepared['conversations_used']} conversations -> {prepared['rows_out']} rows; val accept_len "
          f"{trained:.3f}; eval acceptance length {accepted:.3f}")
