"""Every benchmark and script imports and answers --help (they are not run by anything else in CI)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TOOLS = sorted(p for d in ("benchmarks", "scripts") for p in (REPO / d).glob("*.py") if p.name != "common.py")

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("tool", TOOLS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_tool_answers_help(tool: Path):
    proc = subprocess.run([sys.executable, str(tool), "--help"], capture_output=True, text=True, timeout=120,
                          check=False, cwd=tool.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout.lower(), proc.stdout[:500]


# a tiny-size run of the benchmarks that take seconds at that size: they measure, so they must run
TINY_RUNS = {
    "bench_train.py": ["--repeats", "1", "--set", "train.epochs=1", "--set", "data.limit=8",
                       "--set", "train.max_anchors=8"],
    "bench_prepare.py": ["--conversations", "40"],
    "bench_memory.py": ["--seq-lengths", "256", "--anchors", "16", "--steps", "1", "--rows", "24"],
}


@pytest.mark.parametrize("name", sorted(TINY_RUNS))
def test_benchmark_runs_at_a_tiny_size(name: str, tmp_path: Path, tiny_verifier):
    import json

    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / name), *TINY_RUNS[name], "--json", str(out)],
                          capture_output=True, text=True, timeout=900, check=False, cwd=REPO / "benchmarks")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    rows = json.loads(out.read_text())
    assert rows and all(r.get("value") is not None for r in rows), rows
