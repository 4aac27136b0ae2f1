"""Shared fixtures: the tiny verifier and one trained tiny run per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TINY_RECIPE = REPO / "recipes" / "tiny-cpu.yaml"


def pytest_configure(config):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_verifier() -> Path:
    from dspark_kit.tiny import ensure_tiny_verifier

    return ensure_tiny_verifier()


@pytest.fixture()
def tiny_recipe():
    from dspark_kit.recipe import load_recipe

    return load_recipe(TINY_RECIPE)


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, tiny_verifier) -> Path:
    """prepare -> hidden-states -> train on the shipped conversations (real speculators).

    Returns the work dir: prepared/, prepared/hidden_states/, checkpoints/, logs/.
    """
    from dspark_kit.pipeline import run_pipeline
    from dspark_kit.recipe import load_recipe
    from dspark_kit.tiny_data import write_regen_style_jsonl

    wd = tmp_path_factory.mktemp("trained-run")
    recipe = load_recipe(TINY_RECIPE, ["train.epochs=2"])
    write_regen_style_jsonl(wd / "regen.jsonl", 96)
    run_pipeline(recipe, wd, ["prepare", "hidden-states", "train"], log=lambda m: None)
    return wd
