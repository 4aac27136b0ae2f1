"""What prepare reads: DIR/regen.jsonl when regen is part of the recipe, else the data source.

Eval reads the same rows to find the conversations behind speculators' validation split.
"""

from __future__ import annotations

from dspark_kit.data.prepare_input import CHANGED, WHERE, input_rows  # noqa: F401 - re-exported for prepare
from dspark_kit.resolved import Resolved


def prepare_source(res: Resolved) -> str:
    """What prepare reads: DIR/regen.jsonl when regen is part of the recipe, else data.source."""
    return str(res.run.regen_jsonl) if res.recipe.regen.enabled else res.recipe.data.source


def missing_source(res: Resolved) -> str | None:
    """A dry run's warning when data.source is a local path (made absolute when the recipe was read)
    that is not there: the plan is printed, the run would fail on it (regen reads it, and prepare
    directly or through regen's rows)."""
    from pathlib import Path

    source = res.recipe.data.source
    if not Path(source).is_absolute() or Path(source).exists():
        return None
    return (f"# warning: data.source {source}: no such file or folder here; the run fails on it: fix the path "
            "(--set data.source=PATH)")


def prepare_input_rows(res: Resolved):
    """(rows, total, rows the reader could not use, source) prepare reads for this recipe and run
    folder (data/prepare_input.py `input_rows`)."""
    return input_rows(res.recipe, res.run)
