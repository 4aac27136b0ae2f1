"""Every shipped recipe renders every stage's command (dry runs), on a machine without its hardware."""

import json
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dspark_kit.cli import app
from dspark_kit.recipe import load_recipe

# the tiny recipe plans with the built-in verifier, which planning still builds
RECIPES = [pytest.param(p, marks=pytest.mark.slow) if p.stem == "tiny-cpu" else p
           for p in sorted((Path(__file__).resolve().parent.parent / "recipes").glob("*.yaml"))]


def _run(*args):
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output.strip()


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_dry_runs_render(path, tmp_path):
    recipe = load_recipe(path)
    wd = str(tmp_path)
    train = _run("train", "-r", str(path), "-w", wd, "--dry-run")
    argv = shlex.split(train.splitlines()[-1])
    assert "dspark_kit.compat.train_entry" in argv and argv[argv.index("--speculator-type") + 1] == "dspark"
    assert argv[argv.index("--block-size") + 1] == str(recipe.draft.block_size)
    assert ("torch.distributed.run" in argv) == (recipe.train.nproc > 1 or recipe.train.nnodes > 1)
    for role in ("chat", "hidden-states", "spec"):  # spec plans before training (no checkpoint yet)
        line = _run("serve", "-r", str(path), "--role", role, "-w", wd, "--dry-run").splitlines()[-1]
        engine = recipe.serve.engine
        assert ("vllm serve" in line) == (engine != "local"), line
        assert ("ASCEND_RT_VISIBLE_DEVICES" in line) == (engine == "vllm-ascend")
        if role == "spec" and engine != "local":
            spec = json.loads(shlex.split(line)[shlex.split(line).index("--speculative-config") + 1])
            assert spec["method"] == "dspark" and spec["model"].startswith(wd)
    regen = _run("regen", "-r", str(path), "-o", str(tmp_path / "r.jsonl"), "--dry-run").splitlines()[-1]
    if not recipe.regen.endpoints:  # regen starts the recipe's own engine as its chat server
        assert ("vllm serve" in regen) == (recipe.serve.engine != "local"), regen
