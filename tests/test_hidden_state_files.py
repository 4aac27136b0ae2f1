"""hidden_states.dtype fp8: hs-connectors' fp8 files (float8_e4m3fn, a float32 scale per token),
accepted only where they can work, counted by the storage plan, written by the kit in the
connector's own format and read back by hs-connectors' FP8Transfer (what speculators' trainer
reads them with). Training on them, the round trip through speculators' ArrowDataset and vLLM's
CPU build: tests/test_hidden_states_fp8.py, tests/test_vllm_real_fp8.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY_RECIPE
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from dspark_kit.cli import app
from dspark_kit.recipe import RecipeError, load_recipe
from dspark_kit.resolved import Resolved
from dspark_kit.resolved import storage_plan as sp
from dspark_kit.specdec import hidden_state_files as hsf
from dspark_kit.stages.preflight.checks import run_preflight

SEED = REPO / "recipes" / "qwen3-30b-a3b-ultrachat-ascend.yaml"
FP8 = ["hidden_states.dtype=fp8"]


def _prepared(wd: Path, tokens: int, rows: int) -> None:
    (wd / "prepared").mkdir(parents=True)
    (wd / "prepared" / "prepare_meta.json").write_text(json.dumps({"summary": {"tokens": tokens, "rows_out": rows}}))


# ---- where fp8 is accepted -----------------------------------------------------------------


def test_fp8_is_a_recipe_value_and_the_trainer_reads_it_with_hs_connectors_fp8_backend(tmp_path):
    from dspark_kit.stages.training.train import build_train_args

    recipe = load_recipe(TINY_RECIPE, FP8)
    assert Resolved(recipe, tmp_path, planning=True).hidden_states_out_dtype.value == "fp8"
    args = build_train_args(recipe, tmp_path, verifier_path="v", num_hidden_layers=4, device="cpu",
                            hidden_states_dtype="fp8")
    assert args[args.index("--hidden-states-backend") + 1] == "fp8"
    plain = build_train_args(load_recipe(TINY_RECIPE), tmp_path, verifier_path="v", num_hidden_layers=4, device="cpu",
                             hidden_states_dtype="bfloat16")
    assert "--hidden-states-backend" not in plain  # speculators' default: the file backend
    # what speculators train builds from that flag (train/cli.py: registry[...].from_train_args): the
    # dequantizing reader of the files in the prepared data's hidden_states folder
    from argparse import Namespace

    from hs_connectors import FP8Transfer, HiddenStatesBackend

    transfer = HiddenStatesBackend.registry["fp8"].from_train_args(Namespace(hidden_states_path=None), str(tmp_path))
    assert isinstance(transfer, FP8Transfer) and transfer.hidden_states_path == tmp_path / "hidden_states"


def test_fp8_with_the_mooncake_transport_is_one_line_naming_the_key_and_the_fix():
    with pytest.raises(RecipeError) as e:
        load_recipe(TINY_RECIPE, [*FP8, "hidden_states.transport=mooncake", "hidden_states.mode=online"])
    msg = str(e.value)
    assert "\n" not in msg and "hidden_states.dtype: fp8" in msg
    assert "hidden_states.transport: file" in msg and "hidden_states.dtype: bfloat16" in msg


def test_installed_hs_connectors_has_the_fp8_connector_and_a_missing_one_is_named(monkeypatch):
    import importlib.util

    hsf.fp8_unavailable.cache_clear()
    assert hsf.fp8_unavailable() is None  # hs-connectors 0.9.0 is installed with speculators
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "hs_connectors.fp8_hidden_states_connector" else real(name, *a))
    hsf.fp8_unavailable.cache_clear()
    try:
        why = hsf.fp8_unavailable()
    finally:
        monkeypatch.undo()
        hsf.fp8_unavailable.cache_clear()
    assert why and "no fp8 hidden-states connector" in why and "hs-connectors>=0.9.0" in why


def test_fp8_without_the_connector_stops_plans_and_preflight_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(hsf, "fp8_unavailable", lambda: "the installed hs-connectors 0.8.0 has no fp8 connector")
    res = Resolved(load_recipe(TINY_RECIPE, FP8), tmp_path, planning=True)
    with pytest.raises(RecipeError) as e:
        res.hidden_states_out_dtype  # noqa: B018
    assert "\n" not in str(e.value) and str(e.value).startswith("hidden_states.dtype: fp8")
    assert "hidden_states.dtype: bfloat16" in str(e.value) and "hs-connectors>=0.9.0" in str(e.value)
    plan = sp.plan_storage(res)  # nothing sized in a dtype this machine cannot write; the line says why
    assert plan.bytes is None and "unknown here: the file dtype; hidden_states.dtype: fp8" in plan.line()
    found = [f for f in run_preflight(res, probes=False) if f.code == "hidden-states-dtype"]
    assert len(found) == 1 and found[0].level == "error" and "0.8.0" in found[0].message
    r = CliRunner().invoke(app, ["train", "-r", str(TINY_RECIPE), "-w", str(tmp_path), "--set", FP8[0],
                                 "--set", "verifier.num_hidden_layers=4", "--dry-run"])
    assert r.exit_code != 0 and "hidden_states.dtype: fp8" in r.output
    assert not [f for f in run_preflight(Resolved(load_recipe(TINY_RECIPE), tmp_path, planning=True), probes=False)
                if f.code == "hidden-states-dtype"]


# ---- the storage plan counts fp8 -----------------------------------------------------------


def test_plan_counts_one_byte_per_value_plus_a_float32_scale_per_token(tmp_path):
    _prepared(tmp_path, tokens=1000, rows=10)
    fp8 = sp.plan_storage(Resolved(load_recipe(TINY_RECIPE, FP8), tmp_path, planning=True))
    bf16 = sp.plan_storage(Resolved(load_recipe(TINY_RECIPE), tmp_path, planning=True))
    # tiny verifier: 4 exported layers x hidden 128; fp8 files hold three tensors (a bigger header)
    assert fp8.bytes == 1000 * (4 * 128 * 1 + 4 + 8) + 10 * hsf.header_bytes("fp8")
    assert bf16.bytes == 1000 * (4 * 128 * 2 + 8) + 10 * hsf.header_bytes("bfloat16")
    assert 0.5 < fp8.bytes / bf16.bytes < 0.52
    assert "x fp8 (1 B) + ids, a float32 scale per token and headers" in fp8.line()


def test_seed_recipe_in_fp8_takes_1_8_of_its_3_7_tib(tmp_path):
    fp8 = sp.plan_storage(Resolved(load_recipe(SEED, FP8), tmp_path, planning=True))
    bf16 = sp.plan_storage(Resolved(load_recipe(SEED), tmp_path, planning=True))
    assert sp.human(bf16.bytes) == "3.7 TiB" and sp.human(fp8.bytes) == "1.8 TiB"
    assert fp8.bytes == 20_000 * 8192 * (6 * 2048 + 4 + 8) + 20_000 * hsf.header_bytes("fp8")
    r = CliRunner().invoke(app, ["hidden-states", "-r", str(SEED), "-w", str(tmp_path), "--dry-run", "--set", FP8[0]])
    assert r.exit_code == 0 and "offline would take ~1.8 TiB" in r.output, r.output


@pytest.mark.parametrize("dtype", ["fp8", "bfloat16", "float32"])
@pytest.mark.parametrize("seq", [1, 37, 600])
def test_plan_is_the_bytes_a_file_takes(tmp_path, dtype, seq):
    """offline_bytes against real files of the format, from one token to a long row: the plan
    is never short and over by at most the header allowance."""
    path = tmp_path / "hs_0.safetensors"
    save_file(hsf.file_tensors(torch.randn(seq, 6, 64), torch.arange(seq), dtype), str(path))
    over = sp.offline_bytes(seq, 1, 6, 64, dtype) - path.stat().st_size
    assert 0 <= over < 100, over


# ---- the format: the connector's, read back by speculators' transfer -------------------------


def test_kit_fp8_file_is_the_connectors_format_and_fp8transfer_reads_it_back(tmp_path):
    """The keys, dtypes and shapes FP8HiddenStatesConnector's docstring gives; hs-connectors'
    FP8Transfer (speculators train --hidden-states-backend fp8) hands back bf16 within fp8's
    precision: 3 mantissa bits, so 1/16 of a value at most, relative to its token's largest."""
    from hs_connectors import FP8Transfer

    states = torch.randn(50, 4, 128) * torch.logspace(-2, 2, 50).reshape(50, 1, 1)  # scales differ per token
    save_file(hsf.file_tensors(states, torch.arange(50), "fp8"), str(tmp_path / "hs_3.safetensors"))
    raw = load_file(str(tmp_path / "hs_3.safetensors"))
    assert raw["hidden_states"].dtype == torch.float8_e4m3fn and raw["hidden_states"].shape == (50, 4, 128)
    assert raw["hidden_states_scales"].dtype == torch.float32 and raw["hidden_states_scales"].shape == (50, 1, 1)
    assert raw["token_ids"].dtype == torch.int64 and hsf.dtype_of(raw) == "fp8"
    back = FP8Transfer(tmp_path).get_cached(3)
    assert sorted(back) == ["hidden_states", "token_ids"] and back["hidden_states"].dtype == torch.bfloat16
    per_token_max = states.abs().amax(dim=(1, 2), keepdim=True)
    err = ((back["hidden_states"].float() - states).abs() / per_token_max).max().item()
    assert err <= 1 / 16, err
    assert torch.equal(hsf.readable(raw)["hidden_states"], back["hidden_states"])  # the kit reads it the same way


def test_non_fp8_files_are_unchanged_by_the_format(tmp_path):
    states = torch.randn(5, 3, 8)
    for dtype in ("bfloat16", "float32"):
        t = hsf.file_tensors(states, torch.arange(5), dtype)
        assert sorted(t) == ["hidden_states", "token_ids"] and hsf.dtype_of(t) == dtype
        assert torch.equal(hsf.readable(t)["hidden_states"], states.to(getattr(torch, dtype)))


# ---- through an extraction server: generate-offline-data cannot validate fp8 ---------------------


def test_offline_through_a_server_checks_fp8_files_itself(tmp_path):
    """speculators' check_hidden_states takes torch.aminmax of the raw tensor, which torch has no
    float8 kernel for: generate-offline-data runs without --validate-outputs for fp8 and the kit
    checks the files it wrote, dequantized; a bad one is removed and named."""
    from datasets import Dataset
    from speculators.data_generation.offline import check_hidden_states

    from dspark_kit.stages.hidden.hidden_states_vllm import check_written, offline_command

    fp8_file = hsf.file_tensors(torch.randn(3, 4, 8), torch.tensor([5, 6, 7]), "fp8")
    with pytest.raises(NotImplementedError, match="aminmax"):  # why the flag is off for fp8
        check_hidden_states(fp8_file, [5, 6, 7])
    sets = ["verifier.path=/models/absent", "serve.engine=vllm", "hidden_states.backend=vllm"]
    bf16 = Resolved(load_recipe(TINY_RECIPE, sets), tmp_path, planning=True)
    res = Resolved(load_recipe(TINY_RECIPE, [*sets, *FP8]), tmp_path, planning=True)
    assert "--validate-outputs" in offline_command(bf16, "http://h:1")
    assert "--validate-outputs" not in offline_command(res, "http://h:1")

    Dataset.from_dict({"input_ids": [[5, 6, 7], [1, 2]]}).save_to_disk(str(res.run.prepared))
    res.run.hidden_states.mkdir()
    save_file(fp8_file, str(res.run.hidden_states / "hs_0.safetensors"))
    save_file(hsf.file_tensors(torch.randn(2, 4, 8), torch.tensor([1, 9]), "fp8"), str(res.run.hidden_states / "hs_1.safetensors"))
    check_written(res, [0], "http://h:1")  # the row's ids, finite once dequantized
    with pytest.raises(RuntimeError, match="row 1 of .* not a valid fp8 file"):
        check_written(res, [0, 1], "http://h:1")
    assert not (res.run.hidden_states / "hs_1.safetensors").exists()  # a rerun writes it again
