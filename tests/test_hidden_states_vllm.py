"""Offline hidden states via an extraction server: speculators' own generate-offline-data
against our local engine writes the same tensors as the in-process local backend."""

import shlex

import pytest
import torch
from safetensors.torch import load_file

from dspark_kit.resolved import Resolved
from dspark_kit.stages.hidden_states_vllm import dry_run_lines, run_offline_vllm
from dspark_kit.stages.steps import stage_hidden_states, stage_prepare


@pytest.mark.slow
def test_server_backend_matches_local_backend(tmp_path, tiny_recipe, tiny_verifier):
    tiny_recipe.data.limit = 6
    tiny_recipe.regen.enabled = False  # prepare the raw data.source
    a, b = tmp_path / "a", tmp_path / "b"
    for wd in (a, b):
        stage_prepare(Resolved(tiny_recipe, wd))
    stage_hidden_states(Resolved(tiny_recipe, a))  # in-process transformers
    tiny_recipe.hidden_states.backend = "vllm"  # the recipe's engine (local) serves extraction
    summary = run_offline_vllm(Resolved(tiny_recipe, b))
    assert summary["generated"] == len(list((a / "prepared" / "hidden_states").glob("hs_*.safetensors")))
    for f in sorted((a / "prepared" / "hidden_states").glob("hs_*.safetensors")):
        x, y = load_file(str(f)), load_file(str(b / "prepared" / "hidden_states" / f.name))
        assert torch.equal(x["token_ids"], y["token_ids"])
        assert torch.equal(x["hidden_states"], y["hidden_states"])  # same layer tap, same bf16 cast


@pytest.mark.slow  # plans with the built-in verifier, which planning still builds
def test_dry_run_prints_one_command_per_node(tiny_recipe, tmp_path):
    tiny_recipe.hidden_states.backend = "vllm"
    tiny_recipe.train.nnodes = 3
    lines = [line for line in dry_run_lines(Resolved(tiny_recipe, tmp_path, planning=True)) if "generate-offline-data" in line]
    ranks = [shlex.split(line)[shlex.split(line).index("--rank") + 1] for line in lines]
    assert ranks == ["0", "1", "2"] and all("--world-size 3" in line for line in lines)


@pytest.mark.parametrize("command", [["serve", "--role", "hidden-states"], ["hidden-states"], ["train"]],
                         ids=["serve", "offline", "online-train"])
def test_layer_ids_outside_the_verifier_are_refused_before_any_server(command, vllm_cpu_stub, tmp_path):
    """One line naming the field; nothing started (the fast tier fails any test that starts a process)."""
    from typer.testing import CliRunner

    from dspark_kit.cli import app

    sets = ["serve.engine=vllm", "train.device=cpu", "verifier.path=/models/absent", "verifier.num_hidden_layers=28",
            "hidden_states.backend=vllm", "hidden_states.target_layer_ids=[1,2,40]", "regen.enabled=false",
            f"hidden_states.mode={'online' if command == ['train'] else 'offline'}"]
    res = CliRunner().invoke(app, [*command, "-w", str(tmp_path), *[a for s in sets for a in ("--set", s)]])
    assert res.exit_code != 0
    errors = [line for line in res.output.strip().splitlines() if not line.startswith("preflight warning")]
    assert len(errors) == 1 and "hidden_states.target_layer_ids: [40] >= verifier num_hidden_layers 28" in errors[0]
    assert not (tmp_path / "logs").exists() or not list((tmp_path / "logs").glob("*server*"))
