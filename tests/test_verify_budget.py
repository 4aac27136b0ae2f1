"""The verify-budget table (eval and tune): the fixed K, then each confidence threshold. The budgets
themselves are measured in tests/test_served_gate.py, on the eval its run makes."""

from __future__ import annotations

from dspark_kit.stages.evaluation.eval_outputs import budget_markdown


def test_budget_markdown_lists_fixed_then_thresholds():
    rows = {"acceptance_length": 3.0, "mean_verified_per_step": 4.0, "tokens_per_verifier_forward": 2.5}
    md = budget_markdown({"k": 4, "fixed": rows, "thresholds": [{"threshold": 0.5, **rows}]})
    assert md[-2].startswith("| fixed K=4 |") and md[-1].startswith("| confidence >= 0.5 |")
    assert budget_markdown(None) == []
