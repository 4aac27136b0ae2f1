"""Golden plans: `--dry-run --json` of every stage, for every shipped recipe, byte for byte.

tests/golden_plans/<recipe>.json holds, per command, what `dspark-kit <command> -r recipes/<recipe>.yaml
--dry-run --json` prints: `run` (every stage's plan, in order), each stage command (report needs a run
folder; `run` holds its plan) and `serve` for each role. A refactor that should change nothing (how
values travel from the recipe to the engine) must leave every byte as it is; a change meant to alter a
plan re-records them and the diff shows what moved:

    UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q tests/test_golden_plans.py

The dry runs are called in-process (CliRunner): planning builds, loads and starts nothing.
What belongs to the machine, not to the code, is pinned (`machine`) or rewritten (`normalise`), and
nothing else is touched.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dspark_kit.cli import app

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden_plans"
RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
STAGE_COMMANDS = ("regen", "prepare", "hidden-states", "train", "eval", "bench")  # report: in `run`
ROLES = ("chat", "hidden-states", "spec")
PORT = 40123  # every port the kit would pick free (serve.port 0) is this one here


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A fixed machine: no GPU or NPU, 16 GiB of RAM, 100 GiB free disk, no vLLM installed, one free
    port. Each is a fact the resolver reads from the machine, pinned where it is read."""
    from dspark_kit import devices
    from dspark_kit.compat import versions
    from dspark_kit.engines import ports
    from dspark_kit.engines import vllm as vllm_engine
    from dspark_kit.resolved import storage_plan

    monkeypatch.setattr(devices, "cuda_available", lambda: False)
    monkeypatch.setattr(devices, "npu_available", lambda: False)
    monkeypatch.setattr(devices, "device_memory_bytes", lambda device: 16 << 30 if device.startswith("cpu") else None)
    monkeypatch.setattr(versions, "installed", lambda name: None)
    monkeypatch.setattr(ports, "free_port", lambda host="127.0.0.1": PORT)
    monkeypatch.setattr(storage_plan, "free_bytes", lambda path: 100 << 30)
    # no vLLM CPU build either (regen.engine fastest asks for its interpreter; a fresh clone's fast tier has none)
    monkeypatch.setattr(vllm_engine, "vllm_cpu_python", lambda: ROOT / ".venv-vllm-absent" / "bin" / "python")
    return tmp_path


def normalise(text: str, work: Path, cache: Path) -> str:
    """The one rewrite of a dry run's text: the places this checkout, its Python, the model cache and
    the test's run folder happen to be become <ROOT>, <PYTHON>, <CACHE> and <WORK>. Nothing else."""
    for path, name in ((work, "<WORK>"), (cache, "<CACHE>"), (Path(sys.executable), "<PYTHON>"), (ROOT, "<ROOT>")):
        text = text.replace(str(path), name)
    return re.sub(r"<PYTHON>3?(?=[\s\"'])", "<PYTHON>", text)


def commands(recipe: str) -> dict[str, list[str]]:
    r = str(ROOT / "recipes" / f"{recipe}.yaml")
    out = {"run": ["run", "-r", r]}
    out |= {s: [s, "-r", r] for s in STAGE_COMMANDS}
    out |= {f"serve --role {role}": ["serve", "-r", r, "--role", role] for role in ROLES}
    return out


def dry_runs(recipe: str, tmp: Path) -> str:
    """Every command's dry run for `recipe`, normalised, as the golden file's text."""
    work, cache = tmp / "work", Path(os.environ.get("DSPARK_KIT_CACHE", tmp / "cache"))
    out = {}
    for name, argv in commands(recipe).items():
        r = CliRunner().invoke(app, [*argv, "-w", str(work), "--dry-run", "--json"])
        out[name] = {"exit_code": r.exit_code,
                     "output": json.loads(r.stdout) if r.exit_code == 0 else r.output.strip().splitlines()}
    assert not work.exists(), "a dry run wrote its run folder"
    return normalise(json.dumps(out, indent=1, sort_keys=False) + "\n", work, cache)


@pytest.mark.parametrize("recipe", RECIPES)
def test_dry_runs_match_the_recorded_plans(recipe, machine):
    text, path = dry_runs(recipe, machine), GOLDEN / f"{recipe}.json"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"no golden plans for {recipe}: record them with UPDATE_GOLDEN=1 (module docstring)"
    assert text == path.read_text(), (f"{recipe}: a dry run differs from {path.relative_to(ROOT)}; if the change is "
                                      "intended, re-record with UPDATE_GOLDEN=1 and review the diff")


def test_every_recorded_recipe_still_ships():
    recorded = sorted(p.stem for p in GOLDEN.glob("*.json"))
    assert recorded == RECIPES, "golden plans of recipes that no longer ship: delete them"


def test_the_comparison_sees_a_changed_plan(machine, monkeypatch):
    """The comparison can fail: another free port for regen's chat server changes the recorded bytes."""
    from dspark_kit.engines import ports

    before = dry_runs("tiny-cpu", machine)
    monkeypatch.setattr(ports, "free_port", lambda host="127.0.0.1": PORT + 1)
    assert dry_runs("tiny-cpu", machine) != before
