"""eval and tune put confidence-threshold verify budgets beside the fixed K (what adaptive verification trades)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from conftest import TINY_RECIPE, TRAINED_RUN_SETS, set_args

from dspark_kit.stages.evaluate import budget_markdown

pytestmark = pytest.mark.slow


def test_eval_reports_the_budget_trade(trained_run, tmp_path):
    wd = tmp_path / "run"
    shutil.copytree(trained_run, wd, symlinks=True)
    sets = [*TRAINED_RUN_SETS, "regen.enabled=false", "eval.num_prompts=4", "eval.max_new_tokens=24"]
    proc = subprocess.run([sys.executable, "-m", "dspark_kit", "eval", "-r", str(TINY_RECIPE), "-w", str(wd),
                           *set_args(sets)], capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ev = json.loads((wd / "eval" / "eval.json").read_text())
    budget = ev["verify_budget"]
    k = ev["num_speculative_tokens"]
    assert budget["k"] == k and budget["fixed"]["acceptance_length"] == ev["acceptance_length"]
    fixed = budget["fixed"]["mean_verified_per_step"]
    assert k - 0.5 < fixed <= k  # a fixed K verifies every slot but where the token limit cuts the last block
    cuts = [t["mean_verified_per_step"] for t in budget["thresholds"]]
    assert all(c <= fixed for c in cuts) and cuts == sorted(cuts, reverse=True)  # a higher bar verifies fewer
    assert "## Verify budget from the confidence head" in (wd / "eval" / "eval.md").read_text()


def test_budget_markdown_lists_fixed_then_thresholds():
    rows = {"acceptance_length": 3.0, "mean_verified_per_step": 4.0, "tokens_per_verifier_forward": 2.5}
    md = budget_markdown({"k": 4, "fixed": rows, "thresholds": [{"threshold": 0.5, **rows}]})
    assert md[-2].startswith("| fixed K=4 |") and md[-1].startswith("| confidence >= 0.5 |")
    assert budget_markdown(None) == []
