"""Issue 14: `run --dry-run` prints every selected stage's plan in order and runs nothing."""

from __future__ import annotations

import re
from pathlib import Path

from typer.testing import CliRunner

from dspark_kit.cli import app
from dspark_kit.stages.steps import STAGES

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "recipes/tiny-cpu.yaml")


def _no_port(text: str) -> str:
    return re.sub(r"--port \d+", "--port N", text)


def test_run_dry_run_prints_each_stage_plan_and_touches_nothing(tmp_path):
    wd = tmp_path / "run"
    r = CliRunner().invoke(app, ["run", TINY, "--dry-run", "--workdir", str(wd)])
    assert r.exit_code == 0, r.output
    headers = [ln[len("# ==> "):] for ln in r.output.splitlines() if ln.startswith("# ==> ")]
    assert headers == STAGES
    # the same lines the per-stage dry runs print
    train = CliRunner().invoke(app, ["train", "-r", TINY, "--dry-run", "--workdir", str(wd)])
    regen = CliRunner().invoke(app, ["regen", "-r", TINY, "--dry-run"])
    assert train.exit_code == regen.exit_code == 0
    assert train.output.strip() in r.output
    assert _no_port(regen.output.strip()) in _no_port(r.output)
    assert "--role spec" in r.output and "checkpoint_best" in r.output
    assert not wd.exists()


def test_run_dry_run_follows_stages_and_from(tmp_path):
    r = CliRunner().invoke(app, ["run", TINY, "--dry-run", "--workdir", str(tmp_path / "w"),
                                 "--stages", "prepare,train,bench", "--from", "train", "--json"])
    assert r.exit_code == 0, r.output
    import json

    lines = json.loads(r.output)["dry_run"]
    assert [ln for ln in lines if ln.startswith("# ==> ")] == ["# ==> train", "# ==> bench"]
    bad = CliRunner().invoke(app, ["run", TINY, "--dry-run", "--stages", "nope"])
    assert bad.exit_code == 2 and "unknown" in bad.output


def test_run_takes_the_recipe_positionally_or_with_r(tmp_path, monkeypatch):
    """`run X` and `run -r X` are the same (every other command takes -r); two different files is an error.
    Also: `workdir: ~/...` is the home directory (before: ./~/... under the current directory)."""
    import json

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("name: a\nworkdir: ~/runs/a\n")
    b.write_text("name: b\nworkdir: runs/b\n")

    def workdir(*args: str) -> str:
        r = CliRunner().invoke(app, ["run", *args, "--dry-run", "--stages", "report", "--json"])
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)["workdir"]

    home_a = str((tmp_path / "home" / "runs" / "a").resolve())
    assert workdir(str(a)) == workdir("-r", str(a)) == workdir(str(a), "-r", str(a)) == home_a
    assert workdir("--recipe", str(b)) == str((tmp_path / "runs" / "b").resolve())
    both = CliRunner().invoke(app, ["run", str(a), "-r", str(b), "--dry-run"])
    assert both.exit_code == 2 and "recipe given twice" in both.output
