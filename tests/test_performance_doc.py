"""docs/PERFORMANCE.md is written whole by `make bench-perf` (benchmarks/run_all.py): every heading
and every line outside the figures is the generator's, so a hand-written section has nowhere to
hide (the analyses live in docs/PERFORMANCE_ANALYSES.md)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PERF = REPO / "docs" / "PERFORMANCE.md"


def _generator():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import run_all
    finally:
        sys.path.pop(0)
    return run_all


def headings(text: str) -> list[str]:
    return re.findall(r"^#+ .*$", text, re.MULTILINE)


def test_the_file_is_what_the_generator_writes():
    run_all = _generator()
    written, now = PERF.read_text(), run_all.markdown([], 60.0)
    assert headings(written) == headings(now)
    # the text after the table: the generator's, word for word, bar the missed goals it lists
    tail = lambda text: text[text.index("## How to read these figures"):]
    assert tail(written) == tail(now)
    assert "PERFORMANCE_ANALYSES.md" in written and (REPO / "docs" / "PERFORMANCE_ANALYSES.md").is_file()
    assert not hasattr(run_all, "kept_notes")  # a rerun keeps nothing of the old file
