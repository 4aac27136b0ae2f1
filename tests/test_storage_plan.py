"""The storage plan: the bytes offline hidden states take, next to the free space where they go,
in dry runs and preflight (an error when they do not fit), and close to what is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO, TINY_RECIPE, TRAINED_RUN_SETS
from typer.testing import CliRunner

from dspark_kit.cli import app
from dspark_kit.recipe import load_recipe
from dspark_kit.resolved import Resolved
from dspark_kit.resolved import storage_plan as sp
from dspark_kit.specdec.hidden_state_files import header_bytes
from dspark_kit.stages.preflight.checks import run_preflight

SEED = REPO / "recipes" / "qwen3-30b-a3b-ultrachat-ascend.yaml"


def _prepared(wd: Path, tokens: int, rows: int) -> None:
    (wd / "prepared").mkdir(parents=True)
    (wd / "prepared" / "prepare_meta.json").write_text(json.dumps({"summary": {"tokens": tokens, "rows_out": rows}}))


def test_plan_from_the_prepared_rows_is_tokens_x_layers_x_hidden_x_dtype(tmp_path):
    _prepared(tmp_path, tokens=1000, rows=10)
    plan = sp.plan_storage(Resolved(load_recipe(TINY_RECIPE), tmp_path, planning=True))
    # tiny verifier: hidden 128, layers [1, 2, 3] + the last = 4, bf16; + int64 ids, headers
    assert (plan.layers, plan.hidden, plan.dtype) == (4, 128, "bfloat16")
    assert plan.bytes == 1000 * (4 * 128 * 2 + 8) + 10 * header_bytes("bfloat16")
    assert plan.fits and "prepare_meta.json" in plan.basis and "GiB free" in plan.line()


def test_preflight_makes_offline_files_that_do_not_fit_an_error_and_suggests_online(tmp_path, monkeypatch):
    _prepared(tmp_path, tokens=10**6, rows=1000)
    monkeypatch.setattr(sp, "free_bytes", lambda _p: 10**6)
    recipe = load_recipe(TINY_RECIPE)
    errors = [f for f in run_preflight(Resolved(recipe, tmp_path, planning=True), probes=False) if f.code == "storage"]
    assert len(errors) == 1 and errors[0].level == "error" and "hidden_states.mode: online" in errors[0].message
    r = CliRunner().invoke(app, ["preflight", "-r", str(TINY_RECIPE), "-w", str(tmp_path)])
    assert r.exit_code == 1 and "does NOT fit" in r.output and "error storage" in r.output
    recipe.hidden_states.mode = "online"  # nothing written ahead: nothing to fit
    assert not [f for f in run_preflight(Resolved(recipe, tmp_path, planning=True), probes=False)
                if f.code == "storage"]


def test_a_resumed_run_needs_room_for_the_rest_only(tmp_path, monkeypatch):
    _prepared(tmp_path, tokens=1000, rows=10)
    (tmp_path / "prepared" / "hidden_states").mkdir()
    (tmp_path / "prepared" / "hidden_states" / "hs_0.safetensors").write_bytes(b"x" * 300_000)
    plan = sp.plan_storage(Resolved(load_recipe(TINY_RECIPE), tmp_path, planning=True))
    assert plan.written == 300_000 and plan.needed == plan.bytes - 300_000


def test_seed_recipe_plans_what_offline_would_cost_and_says_why_it_trains_online(tmp_path):
    r = CliRunner().invoke(app, ["hidden-states", "-r", str(SEED), "-w", str(tmp_path), "--dry-run"])
    assert r.exit_code == 0, r.output
    line = r.output.splitlines()[0]
    # no verifier or data here: at most 20,000 conversations x 8192 tokens x (5 targets + last) x 2048 x bf16
    assert "163,840,000 tokens x 6 layers x hidden 2048" in line and "TiB" in line
    assert "hidden_states.mode online writes no hidden states ahead" in line
    assert "would not fit" not in line  # online: whether offline files would fit is no question
    plan = sp.plan_storage(Resolved(load_recipe(SEED), tmp_path, planning=True))
    assert plan.bytes == 20_000 * 8192 * (6 * 2048 * 2 + 8) + 20_000 * header_bytes("bfloat16")
    run = CliRunner().invoke(app, ["run", str(SEED), "-w", str(tmp_path), "--dry-run"])
    assert line in run.output


@pytest.mark.slow
def test_estimate_is_within_5_percent_of_the_bytes_written(trained_run, tmp_path):
    """From the prepared rows and, before prepare, from the tokenized source: both within 5%."""
    written = sum(f.stat().st_size for f in (trained_run / "prepared" / "hidden_states").glob("hs_*.safetensors"))
    recipe = load_recipe(TINY_RECIPE, [*TRAINED_RUN_SETS, "regen.enabled=false"])
    after = sp.plan_storage(Resolved(recipe, trained_run, planning=True))
    before = sp.plan_storage(Resolved(recipe, tmp_path / "fresh", planning=True))  # nothing prepared there
    assert "prepare_meta.json" in after.basis and "tokenized as prepare does" in before.basis
    for plan in (after, before):
        print(f"\n[storage] estimate {plan.bytes:,} B vs {written:,} B written ({plan.bytes / written - 1:+.2%}); "
              f"from {plan.basis}")
        assert abs(plan.bytes - written) <= 0.05 * written, (plan.bytes, written, plan.basis)
