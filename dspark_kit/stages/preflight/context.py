"""What every preflight check reads: the `_Context` (the resolution plus the checkpoint found), the
pitfall-tagged finding (`pitfall`, `label`) and the small readers the checks share (`_read_json`,
`_regen_rows`).

A floor of stages/ like its package: may import stages/plan.py and the layers below (findings,
recipe, resolved/, specdec/, data/); never a stage folder, never checks.py or a check module.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

from dspark_kit.findings import Finding
from dspark_kit.recipe import Recipe, RecipeError
from dspark_kit.resolved import Resolved
from dspark_kit.rundir import RunDir


def label(f: Finding) -> str:
    """What a finding is, for one line: its pitfall number, else its code."""
    return f"pitfall {f.pitfall}" if f.pitfall is not None else f.code


def pitfall(number: int, level: str, message: str) -> Finding:
    """A preflight finding: the shared Finding tagged with its pitfall number."""
    return Finding(level, f"pitfall-{number}", message, number)


@dataclass
class _Context:
    res: Resolved
    checkpoint: Path | None = None
    checkpoint_config: dict | None = None

    @property
    def recipe(self) -> Recipe:
        return self.res.recipe

    @property
    def run(self) -> RunDir:
        return self.res.run

    @property
    def verifier_path(self) -> str:
        return self.res.verifier_path

    @property
    def verifier_config(self) -> dict | None:
        """Resolved's: a local config.json or the HF cache (a verifier that lives only in a
        model cache keeps the hidden-size check)."""
        return self.res.verifier_config

    @property
    def num_layers(self) -> int | None:
        """The resolver's N: the verifier's config, else the recipe's verifier.num_hidden_layers."""
        try:
            return self.res.num_hidden_layers
        except RecipeError:
            return None


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _regen_rows(path: Path, limit: int = 2000) -> list[dict]:
    from dspark_kit.jsonl import BadLine, read_jsonl

    if not path.is_file():
        return []
    return list(itertools.islice((r for r in read_jsonl(path) if not isinstance(r, BadLine)), limit))
