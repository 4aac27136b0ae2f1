"""The decode contract, by vLLM's own DSpark code (its CPU build): vLLM's verifier and DSpark proposer
decode held-out prompts with the session's trained draft and with a 2-layer draft, block for block as
the kit's SpecGenerator; five faults planted in vLLM's path each fail with one line naming the stage;
without the per-layer k_norm workaround the 2-layer comparison fails (the check can see vLLM's CPU
grouped rms_norm bug).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY_RECIPE, TRAINED_RUN_SETS, set_args
from typer.testing import CliRunner

from dspark_kit.cli import app
from dspark_kit.recipe import load_recipe
from dspark_kit.resolved import Resolved
from dspark_kit.stages.evaluation.decode_contract import decode_contract, summary_lines

pytestmark = [pytest.mark.vllm_real, pytest.mark.slow, pytest.mark.usefixtures("vllm_cpu_build")]
TWO_LAYERS = "draft.num_layers=2"
FAULT_CODES = {"sample-from-anchor": ("decode-anchor", "sample_from_anchor"),
               "markov-zero": ("decode-markov", "markov_head"),
               "mask-token": ("decode-mask-token", "mask_token_id"),
               "aux-layers": ("decode-context", "aux_hidden_state_layer_ids"),
               "confidence-no-markov": ("decode-confidence", "confidence_head_with_markov")}


@pytest.fixture(scope="module")
def two_layer_run(tmp_path_factory, tiny_verifier) -> Path:
    """A 2-layer draft, trained as the session's run is (the demo recipe, the fixture's data size)."""
    wd = tmp_path_factory.mktemp("two-layer-run")
    cmd = [sys.executable, "-m", "dspark_kit", "run", str(TINY_RECIPE), "--stages", "prepare,hidden-states,train",
           "--workdir", str(wd), *set_args([*TRAINED_RUN_SETS, TWO_LAYERS, "regen.enabled=false"])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return wd


def resolved(workdir: Path, *sets: str) -> Resolved:
    return Resolved(load_recipe(TINY_RECIPE, [*TRAINED_RUN_SETS, "regen.enabled=false", *sets]), workdir)


def assert_holds(report: dict) -> None:
    assert report["finding"] is None, "\n".join(summary_lines(report))
    assert report["tokens_equal"] and report["blocks_equal"] and report["acceptance_equal"], report["prompts"]
    assert all(p["blocks"] > 0 and p["blocks_equal"] == p["blocks"] for p in report["prompts"])
    assert report["max_logit_deviation"] <= report["tolerance"]
    names = [name for name, _ in report["patches"]]
    assert any("_prepare_dflash_inputs_kernel" in n for n in names) and any("_normalize_context_k" in n for n in names)


def test_demo_checkpoint_drafts_block_for_block_and_planted_faults_fail_in_one_line(trained_run):
    report = decode_contract(resolved(trained_run), num_prompts=4, max_new_tokens=24, faults=tuple(FAULT_CODES))
    assert_holds(report)
    assert report["draft_layers"] == 1 and report["num_prompts"] == 4
    assert report["acceptance_length"]["vllm"] > 1.5  # trained: the comparison sees accepted blocks
    # sampled drafting: without a top-k every token is a candidate, with one exactly k, as the kit's
    [full, topk] = report["sampled"]
    assert full["topk"] is None and set(full["candidates_per_slot"]) == {960}
    assert topk["topk"] == 8 and set(topk["candidates_per_slot"]) == {8}
    assert all(s["candidates_equal"] and s["logits_equal"] for s in report["sampled"]), report["sampled"]
    for name, (code, key) in FAULT_CODES.items():
        finding = report["faults"][name]
        assert finding is not None, f"{name}: the comparison did not see it"
        assert finding.code == code and key in finding.message and "\n" not in finding.message, (name, finding)


def test_two_layer_draft_holds_and_fails_without_the_knorm_workaround(two_layer_run):
    res = resolved(two_layer_run, TWO_LAYERS)
    report = decode_contract(res, num_prompts=4, max_new_tokens=24, sampled=False)
    assert_holds(report)
    assert report["draft_layers"] == 2
    raw = decode_contract(res, num_prompts=2, max_new_tokens=8, sampled=False, knorm_workaround=False)
    finding = raw["finding"]  # vLLM's CPU grouped rms_norm: layer 1 normalized with layer 0's row
    assert finding is not None and finding.code == "decode-context-k", summary_lines(raw)
    assert "draft layer 1" in finding.message and "_normalize_context_k" in finding.message
    assert not raw["blocks_equal"] and not any("_normalize_context_k" in n for n, _ in raw["patches"])


def test_cli_decode_prints_the_figures_and_the_patches(trained_run):
    args = ["contract", "-r", str(TINY_RECIPE), "-w", str(trained_run), *set_args(TRAINED_RUN_SETS),
            "--decode", "--num-prompts", "2", "--max-new-tokens", "8"]
    ok = CliRunner().invoke(app, args)
    assert ok.exit_code == 0, ok.output
    assert "tokens equal, blocks equal" in ok.stdout and "acceptance length equal" in ok.stdout
    assert "_prepare_dflash_inputs_kernel" in ok.stdout and "prompt 1:" in ok.stdout
    out = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)
    assert out["ok"] is True and out["decode"][0]["blocks_equal"] is True and out["decode"][0]["finding"] is None


def test_an_incompatible_vllm_is_one_line(trained_run, tmp_path):
    """What a vLLM whose DSpark functions moved prints: the probe names what is missing, the kit one line."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho '{\"vllm\": \"9.9.0\", \"incompatible\": "
                    "\"vllm.v1.worker.gpu.spec_decode.dspark.speculator has no DSparkSpeculator\"}'\n")
    fake.chmod(0o755)
    report = decode_contract(resolved(trained_run), num_prompts=1, max_new_tokens=4, python=fake)
    f = report["finding"]
    assert f.code == "decode-incompatible" and "\n" not in f.message
    assert "vLLM 9.9.0" in f.message and "has no DSparkSpeculator" in f.message
