"""`eval`, `bench` and `report --dry-run`: each prints its stage's plan with the command's own choices
(its options beyond the recipe) and starts, loads, sends and writes nothing. Fast: the plans are made
from the recipe alone (planning), so the tiny verifier is neither built nor loaded, and the fast tier's
guard (tests/tiers.py) fails any process start, a server included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dspark_kit.cli import app

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "recipes/tiny-cpu.yaml")


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def plan_of(*args: str) -> dict:
    r = invoke(*args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def refuse(monkeypatch, module: str, name: str) -> None:
    """The command's real work: a dry run that reaches it fails the test."""
    import importlib

    def boom(*a, **k):
        raise AssertionError(f"--dry-run reached {module}.{name}")

    monkeypatch.setattr(importlib.import_module(module), name, boom)


def test_eval_dry_run_shows_its_choices_and_loads_nothing(tmp_path, monkeypatch):
    refuse(monkeypatch, "dspark_kit.stages.evaluation.evaluate", "evaluate_checkpoint")
    wd, out, prompts = tmp_path / "run", tmp_path / "evalout", tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Count to three."}\n')
    args = ["eval", "-r", TINY, "-w", str(wd), "--dry-run", "--prompts", str(prompts), "--num-prompts", "3",
            "--context-lengths", "512,1024", "--categories", "tiny", "--out", str(out), "--temperature", "0.5"]
    r = invoke(*args)
    assert r.exit_code == 0, r.output
    text = r.stdout
    assert "# in-process: offline acceptance on cpu (float32)" in text
    assert "temperature 0.5" in text  # --temperature reaches the plan through the recipe
    assert f"--prompts: prompts from {prompts}" in text
    assert f"--out: eval.json, eval.md and the plots go to {out}" in text
    assert f"checkpoint {wd.resolve() / 'checkpoints' / 'checkpoint_best'}" in text and "3 prompts" in text
    assert "context lengths 512, 1024" in text and "per category: tiny" in text
    assert all(line.startswith("# ") for line in text.splitlines())  # notes only: eval runs no command
    plan = plan_of(*args)
    assert plan["stage"] == "eval" and plan["processes"] == []
    assert plan["outputs"] == {"eval": str(out / "eval.json")}
    assert plan["inputs"]["prompts"] == str(prompts)
    assert plan["details"]["num_prompts"] == 3 and plan["details"]["context_lengths"] == [512, 1024]
    assert plan["decisions"]["eval_device"]["value"] == "cpu"
    assert not wd.exists() and not out.exists()
    # without options: the recipe's counts and the run folder
    plan = plan_of("eval", "-r", TINY, "-w", str(wd), "--dry-run")
    assert plan["outputs"] == {"eval": str(wd.resolve() / "eval" / "eval.json")}
    assert "prompts" not in plan["inputs"] and plan["details"]["context_lengths"] == []
    assert not wd.exists()


def test_eval_dry_run_fails_where_the_run_would(tmp_path, monkeypatch):
    bad = invoke("eval", "-r", TINY, "-w", str(tmp_path / "w"), "--dry-run", "--categories", "nope")
    assert bad.exit_code == 2 and "--categories" in bad.output
    missing = tmp_path / "no-such.jsonl"  # the run's own check of --prompts (check_prompts_file)
    gone = invoke("eval", "-r", TINY, "-w", str(tmp_path / "w"), "--dry-run", "--prompts", str(missing))
    assert gone.exit_code == 2 and f"--prompts {missing}: file not found" in gone.output, gone.output
    # a verifier too large for the eval device: `eval` refuses it before loading, so its dry run does too
    from dspark_kit.resolved import Resolved
    from dspark_kit.resolved.rules import Decision

    monkeypatch.setattr(Resolved, "eval_fit", property(lambda self: Decision(False, "needs 80 GiB, cpu has 8 GiB")))
    big = invoke("eval", "-r", TINY, "-w", str(tmp_path / "w"), "--dry-run")
    assert big.exit_code == 2 and "needs 80 GiB" in big.output and "tune --served" in big.output
    assert not (tmp_path / "w").exists()


def test_bench_dry_run_starts_no_server_and_sends_nothing(tmp_path, monkeypatch):
    refuse(monkeypatch, "dspark_kit.stages.serving.bench", "bench_endpoint")
    wd = tmp_path / "run"
    args = ["bench", "-r", TINY, "-w", str(wd), "--dry-run", "--endpoint", "http://10.0.0.9:8123/",
            "--num-prompts", "5", "--concurrency", "2", "--label", "ckpt1", "--categories", "tiny"]
    r = invoke(*args)
    assert r.exit_code == 0, r.output
    text = r.stdout
    assert "no server started" in text and "http://10.0.0.9:8123 (--endpoint" in text
    assert "5 prompts (builtin), 2 in flight" in text and "per category: tiny" in text
    assert str(wd.resolve() / "bench" / "bench_ckpt1.json") in text
    assert all(line.startswith("# ") for line in text.splitlines())  # the spec server's command is not there
    plan = plan_of(*args)
    assert plan["stage"] == "bench" and plan["processes"] == []  # the pipeline's bench plan starts a spec server
    assert plan["inputs"] == {"server": "http://10.0.0.9:8123"}
    assert plan["outputs"] == {"bench": str(wd.resolve() / "bench" / "bench_ckpt1.json")}
    assert plan["details"]["num_prompts"] == 5 and plan["details"]["concurrency"] == 2
    # no --endpoint: the recipe's serve.host:port; the tiny recipe's port 0 is only known once a server starts
    default = invoke("bench", "-r", TINY, "-w", str(wd), "--dry-run")
    assert default.exit_code == 0, default.output
    assert "serve.host:port" in default.stdout and "serve.port is 0" in default.stdout
    assert "bench_tiny-cpu.json" in default.stdout
    assert not wd.exists()
    both = invoke("bench", "--compare", "a.json", "--dry-run")
    assert both.exit_code == 2 and "--dry-run" in both.output
    # a label that cannot name the result file: the dry run refuses it as the run would (one rule: bench_load)
    bad = invoke("bench", "-r", TINY, "-w", str(wd), "--dry-run", "--label", "a/b")
    assert bad.exit_code == 2 and "--label 'a/b'" in bad.output, bad.output


def test_report_dry_run_names_what_it_reads_and_writes_nothing(tmp_path, monkeypatch):
    refuse(monkeypatch, "dspark_kit.stages.reporting.report", "build_report")
    wd, out = tmp_path / "run", tmp_path / "r.md"
    wd.mkdir()
    r = invoke("report", str(wd), "-r", TINY, "--dry-run")
    assert r.exit_code == 0, r.output
    assert f"# in-process: report -> {wd / 'report' / 'report.md'}" in r.stdout
    assert f"reads {wd / 'logs'} (tensorboard)" in r.stdout and f"{wd / 'bench'}/*.json" in r.stdout
    plan = plan_of("report", "-r", TINY, "-w", str(wd), "--dry-run", "--out", str(out))
    assert plan["stage"] == "report" and plan["processes"] == []
    assert plan["outputs"] == {"report": str(out), "plots": str(wd / "report")}
    assert list(wd.iterdir()) == [] and not out.exists()
    # RUN_DIR alone plans it, as it runs: no recipe read (none at the default path from another folder)
    monkeypatch.chdir(tmp_path)
    alone = invoke("report", str(wd), "--dry-run")
    assert alone.exit_code == 0 and f"report -> {wd / 'report' / 'report.md'}" in alone.stdout, alone.output
    from dspark_kit.stages.plan import DECIDED

    assert DECIDED["report"] == ()  # report_plan takes no decided values; one would go through StagePlan.of
    # what the run refuses, the dry run refuses: a missing run folder, two different ones
    missing = invoke("report", str(tmp_path / "nope"), "-r", TINY, "--dry-run")
    assert missing.exit_code == 2 and "not a directory" in missing.output
    two = invoke("report", str(wd), "-w", str(tmp_path), "-r", TINY, "--dry-run")
    assert two.exit_code == 2 and "given twice" in two.output


@pytest.mark.parametrize("command", ["eval", "bench", "report"])
def test_help_says_what_dry_run_prints(command):
    r = invoke(command, "--help")
    assert r.exit_code == 0 and "--dry-run prints" in " ".join(r.output.split())


def test_dry_runs_warn_on_a_missing_data_source(tmp_path, monkeypatch):
    """prepare, regen and run --dry-run still print their plan for a data.source that is not there, and
    say in it that the run fails on it (today's main planned without a word)."""
    monkeypatch.chdir(tmp_path)
    missing = tmp_path / "nope.jsonl"
    for command in (["prepare"], ["regen"], ["run"], ["prepare", "--set", "regen.enabled=false"]):
        r = invoke(*command, "-r", TINY, "--set", "data.source=nope.jsonl", "--dry-run")
        assert r.exit_code == 0, r.output
        warned = [ln for ln in r.output.splitlines() if ln.startswith("# warning: data.source")]
        assert warned and str(missing) in warned[0] and "--set data.source=" in warned[0], (command, r.output)
    missing.write_text("")
    r = invoke("prepare", "-r", TINY, "--set", "data.source=nope.jsonl", "--dry-run")
    assert "# warning" not in r.output
    r = invoke("prepare", "-r", TINY, "--dry-run")  # a builtin source: nothing to warn about
    assert r.exit_code == 0 and "# warning" not in r.output
