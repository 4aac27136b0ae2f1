"""RunDir names every file of a run folder's logs/; writers ask it rather than spelling a name."""

from __future__ import annotations

import re
from pathlib import Path

from dspark_kit.rundir import RunDir

PKG = Path(__file__).resolve().parents[1] / "dspark_kit"


def test_log_names_are_the_documented_ones(tmp_path):
    run = RunDir.at(tmp_path)
    logs = tmp_path.resolve() / "logs"
    assert run.train_log == logs / "train.log"
    assert run.stage_log("eval") == logs / "stage-eval.log"
    assert run.server_log("spec") == logs / "spec-server.log"
    assert run.serve_log("chat") == logs / "serve-chat.log"
    readme = (PKG.parent / "docs" / "TOUR.md").read_text()
    for name in ("train.log", "stage-<stage>.log", "<role>-server.log", "serve-<role>.log"):
        assert name in readme, f"docs/TOUR.md's run folder layout should name {name}"


def test_no_module_but_rundir_spells_a_log_name():
    """regen's `<output>.engine.log` sits beside its output (-o anywhere), not in logs/."""
    literal = re.compile(r"""["'][\w{}.-]*\.log["']""")
    spelled = [f"{f.relative_to(PKG)}: {m}" for f in PKG.rglob("*.py") if f.name != "rundir.py"
               for m in literal.findall(f.read_text()) if m.strip("\"'") != ".engine.log"]
    assert not spelled, spelled
