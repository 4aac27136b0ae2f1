"""The suite's table, files and report sections (measure.suite_report) from planted records."""

from __future__ import annotations

import json
import os

from dspark_kit.measure.suite_metrics import RequestRecord, with_intervals
from dspark_kit.measure.suite_report import (
    compare_markdown,
    report_parts,
    suite_markdown,
    write_suite_outputs,
)


def summary() -> dict:
    recs = [RequestRecord("gsm8k#1", [3, 3], [3, 1], [[0.9, 0.8, 0.7], [0.9, 0.75, 0.2]]),
            RequestRecord("gsm8k#2", [3, 2], [0, 2], [[0.3, 0.5, 0.5], [0.8, 0.6]])]
    fig = with_intervals(recs, 3, 20)
    return {"suite": "mine", "suite_source": "builtin", "checkpoint": "ckpt", "verifier": "v",
            "num_speculative_tokens": 3, "draft_window_size": None, "has_confidence_head": True, "device": "cpu",
            "dtype": "float32", "limit": 2, "seed": 0, "max_new_tokens": 8, "temperatures": [0.0], "mode": "in-process",
            "benchmarks": [{"benchmark": "gsm8k", "source": "file", "count": 2, "ids": ["gsm8k#1", "gsm8k#2"],
                            "rows_total": 2, "turns": 1, "results": {"0": fig}}],
            "pooled": {"0": fig}, "requests": {"gsm8k": {"0": [r.as_dict() for r in recs]}}}


def test_table_files_and_report(tmp_path):
    s = summary()
    md = suite_markdown(s)
    assert "| gsm8k | 2 | 2.500 [" in md  # tau = 1 + 6 / 4
    assert "| 0.75 0.50 0.25 | 0.75 0.67 1.00 | 2.0 | 0.219 [" in md  # per position, conditional, drafts, ECE
    assert "| 0.833 [" in md  # AUC
    out = tmp_path / "eval" / "suite-mine"
    files = write_suite_outputs(s, out)
    saved = json.loads((out / "eval.json").read_text())
    assert saved["table"][0]["tau"] == 2.5 and saved["table"][0]["ece"] == saved["benchmarks"][0]["results"]["0"][
        "calibration"]["ece"]
    assert os.path.getsize(files["tau_png"]) > 0 and os.path.getsize(files["reliability_png"]) > 0
    parts = report_parts(tmp_path / "eval", tmp_path / "eval" / "window_tune.json", lambda p: os.path.relpath(p, tmp_path))
    assert parts[0].startswith("## Benchmark suite mine") and "### T = 0" in parts[1]
    assert any("eval_reliability.png" in p for p in parts)


def test_the_pooled_row_closes_each_table():
    s = summary()
    s["benchmarks"].append({**s["benchmarks"][0], "benchmark": "mbpp"})
    rows = [line for line in suite_markdown(s).splitlines() if line.startswith("| ") and "---" not in line]
    assert [r.split(" | ")[0] for r in rows] == ["| benchmark", "| gsm8k", "| mbpp", "| all (pooled)"]


def test_compare_table():
    md = compare_markdown({"a": "A", "b": "B", "statistic": "tau", "rows": [
        {"benchmark": "gsm8k", "temperature": 1.0, "prompts": 8, "a": 2.0, "b": 2.5, "difference": 0.5,
         "interval": [0.2, 0.8]}]})
    assert "| gsm8k | 1 | 8 | 2.000 | 2.500 | 0.500 | [0.20, 0.80] |" in md
