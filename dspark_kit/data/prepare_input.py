"""The rows prepare reads: DIR/regen.jsonl when regen is part of the recipe, else the data source
as is. Eval reads the same rows to find the conversations behind speculators' validation split
(measure/eval_prompts.py), the resolver's storage estimate to size them.

Layer 1 like its package: the recipe and the run folder in, rows out.
"""

from __future__ import annotations

from dspark_kit.recipe import Recipe
from dspark_kit.rundir import RunDir


def input_rows(recipe: Recipe, run: RunDir):
    """(rows, total, rows the reader could not use, source): DIR/regen.jsonl when regen is part of
    the recipe (a missing one is an error, not a silent fall-back to the raw data), else the
    recipe's data source as is."""
    from collections import Counter

    f = run.regen_jsonl
    if recipe.regen.enabled:
        if not f.exists():
            raise ValueError(f"{f} not found: run regen first (dspark-kit regen -w {run.root}), "
                             "or set regen.enabled=false to prepare data.source as is")
        from dspark_kit.jsonl import read_jsonl_numbered

        rows = ({**row, WHERE: f"{f}:{n}"} if isinstance(row, dict) else _located(row, f"{f}:{n}")
                for n, row in read_jsonl_numbered(f))
        return rows, sum(1 for line in f.open("rb") if line.strip()), Counter(), str(f)
    from dspark_kit.data.sources import iter_records, source_size

    # the rows as read (prepare normalizes them, keeps their `tools`, names their format, and writes
    # each dropped or changed one, with where it was read, to its errors file); streamed: a 200k-row
    # source is never held. metadata.idx: the row's index, as regen's, for a thinking mixture's draw
    # (data/template_rows.row_thinking) when the row records no mode of its own
    rows = ({**rec.row, "id": f"{recipe.data.source}#{i}", "metadata": _with_idx(rec.row.get("metadata"), i),
             WHERE: rec.where, CHANGED: list(rec.changes)}
            if isinstance(rec.row, dict) else _located(rec.row, rec.where)
            for i, rec in iter_records(recipe.data))
    return rows, source_size(recipe.data), Counter(), recipe.data.source


# keys prepare reads off a row and does not train: where it was read, what reading changed
WHERE, CHANGED = "_where", "_changed"


def _located(row, where: str):
    """A row that is no object (a BadLine, a list): a BadLine that says where it was read."""
    from dataclasses import replace

    from dspark_kit.jsonl import BadLine

    if isinstance(row, BadLine):
        return row if row.where else replace(row, where=where)
    return BadLine("", f"row must be an object, got {type(row).__name__}", where=where)


def _with_idx(meta, idx: int) -> dict:
    """A source row's metadata with its index in the source (a row's own idx is kept)."""
    return {"idx": idx, **meta} if isinstance(meta, dict) else {"idx": idx}
