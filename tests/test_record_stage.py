"""One record of a finished stage (pipeline.record_stage): a stage command writes state.json and
the manifest as `run` does, so `dspark-kit train` then `dspark-kit run` on the same folder does not
train again, as a resumed `run` does not.

The train stage here is a stand-in with the real one's name, sections and key (what the record
reads): the CLI, the registry, the fingerprints and the record are the real ones; the fast tier may
not train (the slow tests/test_run_resume.py trains for real).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dspark_kit.cli import app
from dspark_kit.stages import steps
from dspark_kit.stages.plan import StagePlan

TINY = Path(__file__).resolve().parents[1] / "recipes" / "tiny-cpu.yaml"


@pytest.fixture
def fake_train(monkeypatch):
    """REGISTRY["train"] replaced by a stage that counts its runs and writes a checkpoint folder."""
    runs: list[str] = []
    real = steps.REGISTRY["train"]

    def plan(res):
        return StagePlan("train", ["# fake trainer"], outputs={"checkpoints": str(res.run.checkpoints)})

    def run(res, plan, reporter):
        runs.append(str(res.run.root))
        (res.run.checkpoints / "0").mkdir(parents=True, exist_ok=True)
        return {"accept_len_epoch": 2.5}

    monkeypatch.setitem(steps.REGISTRY, "train", steps.Stage(real.name, real.sections, run, plan, real.key))
    return runs


def _kit(*args: str):
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def test_a_standalone_train_then_run_does_not_train_again(tmp_path, fake_train):
    wd = str(tmp_path / "run")
    first = _kit("train", "-r", str(TINY), "-w", wd)
    assert first.exit_code == 0, first.output
    assert fake_train == [str(Path(wd).resolve())]
    state = json.loads((Path(wd) / "state.json").read_text())
    assert state["train"]["status"] == "done" and state["train"]["figure"] == 2.5
    manifest = json.loads((Path(wd) / "manifest.json").read_text())
    assert "train" in manifest["stages"]

    again = _kit("run", str(TINY), "-w", wd, "--stages", "train", "--json")
    assert again.exit_code == 0, again.output
    rows = {r["stage"]: r["status"] for r in json.loads(again.stdout)["stages"]}
    assert rows == {"train": "skipped (unchanged)"} and len(fake_train) == 1

    changed = _kit("run", str(TINY), "-w", wd, "--stages", "train", "--set", "train.epochs=9", "--json")
    assert changed.exit_code == 0, changed.output
    assert {r["stage"]: r["status"] for r in json.loads(changed.stdout)["stages"]} == {"train": "done"}
    assert len(fake_train) == 2  # a changed train section reruns it, whoever ran it first


def test_a_failed_standalone_stage_is_recorded_failed(tmp_path, monkeypatch):
    real = steps.REGISTRY["train"]

    def run(res, plan, reporter):
        raise RuntimeError("trainer exited with 1")

    monkeypatch.setitem(steps.REGISTRY, "train", steps.Stage(
        real.name, real.sections, run, lambda res: StagePlan("train", []), real.key))
    wd = tmp_path / "run"
    r = _kit("train", "-r", str(TINY), "-w", str(wd))
    assert r.exit_code == 1 and "train: trainer exited with 1" in r.output
    assert json.loads((wd / "state.json").read_text())["train"]["status"] == "failed"


@pytest.fixture
def fake_eval(monkeypatch):
    """evaluate_checkpoint (what the command and the stage both call) replaced by one that counts its
    calls; the eval stage's own registry entry and the record stay the real ones."""
    from dspark_kit.stages.evaluation import evaluate

    calls: list[dict] = []

    def measured(res, **kwargs):
        calls.append(kwargs)
        res.run.eval.mkdir(parents=True, exist_ok=True)
        return {"acceptance_length": 2.75, "per_position_acceptance": [0.9, 0.5], "tokens_per_verifier_forward": 2.7,
                "files": {"json": str(res.run.eval_json)}}

    monkeypatch.setattr(evaluate, "evaluate_checkpoint", measured)
    monkeypatch.setattr("dspark_kit.stages.evaluation.eval_outputs.markdown", lambda s: "eval")
    return calls


@pytest.mark.slow
def test_a_standalone_eval_as_the_stage_is_recorded_and_one_with_its_own_prompts_is_not(tmp_path, fake_eval,
                                                                                       tiny_verifier):
    wd = tmp_path / "run"
    own = tmp_path / "mine.jsonl"
    own.write_text('{"prompt": "hi"}\n')
    r = _kit("eval", "-r", str(TINY), "-w", str(wd), "--prompts", str(own), "--json")
    assert r.exit_code == 0, r.output
    state_file = wd / "state.json"
    assert not state_file.exists() or "eval" not in json.loads(state_file.read_text())  # not the stage's eval

    r = _kit("eval", "-r", str(TINY), "-w", str(wd), "--json")
    assert r.exit_code == 0, r.output
    state = json.loads((wd / "state.json").read_text())
    assert state["eval"]["status"] == "done" and state["eval"]["figure"] == 2.75
    again = _kit("run", str(TINY), "-w", str(wd), "--stages", "eval", "--json")
    assert again.exit_code == 0, again.output
    assert {r["stage"]: r["status"] for r in json.loads(again.stdout)["stages"]} == {"eval": "skipped (unchanged)"}
    assert len(fake_eval) == 2
