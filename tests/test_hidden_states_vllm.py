"""Offline hidden states via an extraction server: speculators' own generate-offline-data
against our local engine writes the same tensors as the in-process local backend."""

import shlex

import pytest
import torch
from safetensors.torch import load_file

from dspark_kit.resolved import Resolved
from dspark_kit.stages.hidden.hidden_states_vllm import offline_processes
from dspark_kit.stages.steps import run_stage


@pytest.mark.slow
def test_server_backend_matches_local_backend(tmp_path, tiny_recipe, tiny_verifier):
    tiny_recipe.data.limit = 6
    tiny_recipe.regen.enabled = False  # prepare the raw data.source
    a, b = tmp_path / "a", tmp_path / "b"
    for wd in (a, b):
        run_stage("prepare", Resolved(tiny_recipe, wd))
    run_stage("hidden-states", Resolved(tiny_recipe, a))  # in-process transformers
    tiny_recipe.hidden_states.backend = "vllm"  # the recipe's engine (local) serves extraction
    summary = run_stage("hidden-states", Resolved(tiny_recipe, b))
    assert summary["generated"] == len(list((a / "prepared" / "hidden_states").glob("hs_*.safetensors")))
    for f in sorted((a / "prepared" / "hidden_states").glob("hs_*.safetensors")):
        x, y = load_file(str(f)), load_file(str(b / "prepared" / "hidden_states" / f.name))
        assert torch.equal(x["token_ids"], y["token_ids"])
        assert torch.equal(x["hidden_states"], y["hidden_states"])  # same layer tap, same bf16 cast


def test_dry_run_prints_one_command_per_node(tiny_recipe, tmp_path):
    tiny_recipe.hidden_states.backend = "vllm"
    tiny_recipe.train.nnodes = 3
    lines = [line for line in offline_processes(Resolved(tiny_recipe, tmp_path, planning=True))[0] if "generate-offline-data" in line]
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


def _shard_dir(tmp_path, tiny_recipe, rows: int, have: list[int]) -> Resolved:
    import json

    res = Resolved(tiny_recipe, tmp_path, planning=True)
    res.run.hidden_states.mkdir(parents=True)
    (res.run.prepared / "prepare_meta.json").write_text(json.dumps({"summary": {"rows_out": rows}}))
    for i in have:
        (res.run.hidden_states / f"hs_{i}.safetensors").write_bytes(b"x")
    return res


def test_missing_rows_on_one_node_need_no_speculators_import(tmp_path, tiny_recipe, monkeypatch):
    """The check after generate-offline-data: importing speculators for it cost 10 s and more."""
    import sys

    from dspark_kit.stages.hidden.hidden_states_vllm import missing_rows

    monkeypatch.setitem(sys.modules, "speculators.data_generation.offline", None)  # importing it fails
    assert missing_rows(_shard_dir(tmp_path, tiny_recipe, 7, [0, 2, 3, 6]), 1, 0) == [1, 4, 5]


@pytest.mark.slow  # imports speculators
@pytest.mark.parametrize("world, rank", [(1, 0), (2, 0), (2, 1), (3, 2)])
def test_missing_rows_follow_speculators_own_shards(tmp_path, tiny_recipe, world, rank):
    from speculators.data_generation.offline import get_indices_to_process

    from dspark_kit.stages.hidden.hidden_states_vllm import missing_rows

    have = [0, 2, 3, 9]
    res = _shard_dir(tmp_path, tiny_recipe, 11, have)
    assert missing_rows(res, world, rank) == get_indices_to_process(11, None, have, world, rank)
