"""The tiny Qwen3-MoE, Llama-3 and gpt-oss verifiers on the REAL vLLM (its CPU build), per family: regen
through vLLM's chat server writes the local engine's replies (greedy, float32), and hidden-state
extraction through the kit's CPU connector equals the local engine's files within one bf16 step.
(`contract` with each family as the target: tests/test_family_pipelines.py.)

Both servers of a family start at once from the kit's own plans (`serve.engine: vllm` on a machine
without GPU/NPU) and stop by process group. Skips/fails like tests/test_vllm_real.py without the build."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_vllm_real import STARTUP_TIMEOUT, Served, _stop
from test_vllm_real_hidden_states import bf16_steps
from typer.testing import CliRunner

from dspark_kit.cli import app
from dspark_kit.engines.lifecycle import ManagedServer
from dspark_kit.engines.ports import free_port
from dspark_kit.recipe import load_recipe
from dspark_kit.resolved import Resolved
from dspark_kit.stages.server_plan import server_plan
from dspark_kit.stages.steps import run_stage

pytestmark = [pytest.mark.vllm_real, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
ROWS = 8  # regenerated conversations, and the prepared rows whose hidden states are compared
VLLM_SETS = ["serve.engine=vllm", "train.device=cpu", "regen.max_tokens=32"]


def recipe(name: str, *sets: str):
    return load_recipe(REPO / f"recipes/tiny-{name}-cpu.yaml", [*VLLM_SETS, f"data.limit={ROWS}", *sets])


@pytest.fixture(scope="module", params=["qwen3-moe", "llama3", "gpt-oss"])
def family(request, tmp_path_factory, vllm_cpu_build):
    """(name, chat server, extraction server, its storage) for one family, both started at once
    (start-up is mostly single-core imports: two in parallel take about as long as one)."""
    name = request.param
    root = tmp_path_factory.mktemp(f"vllm-{name}")
    storage = root / "storage"
    plans = {"chat": server_plan(Resolved(recipe(name), root / "chat"), "chat", port=free_port()),
             "hidden-states": server_plan(Resolved(recipe(name, f"hidden_states.storage_path={storage}"), root / "hs"),
                                          "hidden-states", port=free_port())}
    assert all(str(vllm_cpu_build) == p.argv[0] for p in plans.values())  # the kit chose the CPU build
    servers = {role: ManagedServer(plan, root / f"{role}.log").start() for role, plan in plans.items()}
    t0 = time.monotonic()
    try:
        for role, server in servers.items():
            server.wait_healthy(max(1.0, STARTUP_TIMEOUT - (time.monotonic() - t0)))
            print(f"\n[vllm-{name}] {role} healthy {time.monotonic() - t0:.1f}s after start")
    except Exception:
        for server in servers.values():
            server.stop()
        raise
    served = {role: Served(server, time.monotonic() - t0) for role, server in servers.items()}
    yield name, served["chat"], served["hidden-states"], storage
    for s in served.values():
        _stop(s)


def _regen(name: str, out: Path, *args: str) -> dict[int, list]:
    res = CliRunner().invoke(app, ["regen", "-r", str(REPO / f"recipes/tiny-{name}-cpu.yaml"), "-o", str(out),
                                   "--limit", str(ROWS), "--no-resume", "--json", "--set", "regen.max_tokens=32",
                                   *args])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["failed"] == 0 and summary["written"] == ROWS, summary
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return {r["metadata"]["idx"]: r["conversations"] for r in rows}


def test_regen_through_vllm_equals_the_local_engine(family, tmp_path):
    name, chat, _hs, _storage = family
    ours = _regen(name, tmp_path / "vllm.jsonl", "-e", chat.url)
    local = _regen(name, tmp_path / "local.jsonl")  # regen starts the local engine itself
    assert sorted(ours) == sorted(local) == list(range(ROWS))
    for idx in local:
        assert ours[idx] == local[idx], f"{name} row {idx} differs"
    replies = [t["value"] for c in local.values() for t in c if t["from"] == "gpt"]
    assert all(replies) and len(set(replies)) > ROWS // 2  # real, prompt-dependent text


def _hidden_state_files(name: str, prepared: Path, wd: Path, *sets: str) -> dict[int, dict]:
    shutil.copytree(prepared, wd / "prepared")
    run_stage("hidden-states", Resolved(recipe(name, "regen.enabled=false", *sets), wd))
    return {int(p.stem[3:]): load_file(str(p)) for p in (wd / "prepared" / "hidden_states").glob("hs_*.safetensors")}


def test_vllm_hidden_states_match_the_local_engine_within_one_bf16_step(family, tmp_path):
    name, _chat, hs, storage = family
    run_stage("prepare", Resolved(recipe(name, "regen.enabled=false"), tmp_path / "p"))
    prepared = tmp_path / "p" / "prepared"
    vllm = _hidden_state_files(name, prepared, tmp_path / "vllm", "hidden_states.backend=vllm",
                               f"hidden_states.endpoint={hs.url}", f"hidden_states.storage_path={storage}")
    local = _hidden_state_files(name, prepared, tmp_path / "bf16")  # the offline default, bf16
    assert sorted(vllm) == sorted(local) and len(local) >= ROWS // 2
    worst = 0.0
    for i in local:
        v, b = vllm[i], local[i]
        assert v["token_ids"].tolist() == b["token_ids"].tolist(), f"row {i}"
        assert v["hidden_states"].shape == b["hidden_states"].shape
        steps = bf16_steps(v["hidden_states"].to(torch.bfloat16), b["hidden_states"])
        assert steps.max() <= 1, f"{name} row {i}: bf16 differs by {steps.max():.0f} rounding steps"
        worst = max(worst, steps.max().item())
    print(f"[vllm-{name}] {len(local)} rows: vLLM vs local within {worst:.0f} bf16 rounding step(s)")
