"""The decode contract on a 2-layer draft (vLLM's CPU build): vLLM's DSpark proposer drafts block for
block as the kit's decoder with the harness's per-layer k_norm, and without it the comparison fails on
draft layer 1 (vLLM's CPU grouped rms_norm applies layer 0's k_norm row to every layer).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY_RECIPE, TRAINED_RUN_SETS, set_args
from decode_helpers import assert_holds, resolved

from dspark_kit.stages.evaluation.decode_contract import decode_contract, summary_lines

pytestmark = [pytest.mark.vllm_real, pytest.mark.slow, pytest.mark.usefixtures("vllm_cpu_build")]
TWO_LAYERS = "draft.num_layers=2"


@pytest.fixture(scope="module")
def two_layer_run(tmp_path_factory, tiny_verifier) -> Path:
    """A 2-layer draft, trained as the session's run is (the demo recipe, the fixture's data size)."""
    wd = tmp_path_factory.mktemp("two-layer-run")
    cmd = [sys.executable, "-m", "dspark_kit", "run", str(TINY_RECIPE), "--stages", "prepare,hidden-states,train",
           "--workdir", str(wd), *set_args([*TRAINED_RUN_SETS, TWO_LAYERS, "regen.enabled=false"])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return wd


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


