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
