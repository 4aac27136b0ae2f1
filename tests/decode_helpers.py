"""Shared by the decode-contract tests (test_vllm_real_decode*.py)."""

from __future__ import annotations

from pathlib import Path

from conftest import TINY_RECIPE, TRAINED_RUN_SETS

from dspark_kit.recipe import load_recipe
from dspark_kit.resolved import Resolved
from dspark_kit.stages.evaluation.decode_contract import summary_lines


def resolved(workdir: Path, *sets: str) -> Resolved:
    return Resolved(load_recipe(TINY_RECIPE, [*TRAINED_RUN_SETS, "regen.enabled=false", *sets]), workdir)


def assert_holds(report: dict) -> None:
    assert report["finding"] is None, "\n".join(summary_lines(report))
    assert report["tokens_equal"] and report["blocks_equal"] and report["acceptance_equal"], report["prompts"]
    assert all(p["blocks"] > 0 and p["blocks_equal"] == p["blocks"] for p in report["prompts"])
    assert report["max_logit_deviation"] <= report["tolerance"]
    names = [name for name, _ in report["patches"]]
    assert any("_prepare_dflash_inputs_kernel" in n for n in names) and any("_normalize_context_k" in n for n in names)
