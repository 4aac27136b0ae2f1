"""The decode contract, by vLLM's own DSpark code (its CPU build): vLLM's verifier and DSpark proposer
decode held-out prompts with the session's trained draft block for block as the kit's SpecGenerator;
five faults planted in vLLM's path each fail with one line naming the stage; a vLLM the harness
cannot drive is one line (the 2-layer draft: test_vllm_real_decode_layers.py).
"""

from __future__ import annotations

import json

import pytest
from conftest import TINY_RECIPE, TRAINED_RUN_SETS, set_args
from decode_helpers import assert_holds, resolved
from typer.testing import CliRunner

from dspark_kit.cli import app
from dspark_kit.stages.evaluation.decode_contract import decode_contract, summary_lines

pytestmark = [pytest.mark.vllm_real, pytest.mark.slow, pytest.mark.usefixtures("vllm_cpu_build")]
FAULT_CODES = {"sample-from-anchor": ("decode-anchor", "sample_from_anchor"),
               "markov-zero": ("decode-markov", "markov_head"),
               "mask-token": ("decode-mask-token", "mask_token_id"),
               "aux-layers": ("decode-context", "aux_hidden_state_layer_ids"),
               "confidence-no-markov": ("decode-confidence", "confidence_head_with_markov")}


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
    text = "\n".join(summary_lines(report))  # what `contract --decode` prints
    assert "tokens equal, blocks equal" in text and "acceptance length equal" in text and "prompt 3:" in text
    assert "_prepare_dflash_inputs_kernel" in text and "error" not in text
    for name, (code, key) in FAULT_CODES.items():
        finding = report["faults"][name]
        assert finding is not None, f"{name}: the comparison did not see it"
        assert finding.code == code and key in finding.message and "\n" not in finding.message, (name, finding)


def test_cli_decode_json(trained_run):
    args = ["contract", "-r", str(TINY_RECIPE), "-w", str(trained_run), *set_args(TRAINED_RUN_SETS),
            "--decode", "--num-prompts", "2", "--max-new-tokens", "8", "--json"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    [decoded] = out["decode"]
    assert out["ok"] is True and decoded["finding"] is None and decoded["blocks_equal"] is True
    assert decoded["num_prompts"] == 2 and decoded["max_new_tokens"] == 8 and decoded["patches"]


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
