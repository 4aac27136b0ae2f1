"""scripts/gpu_smoke.sh: argument and workdir handling, wheel install, step runner -- no GPU."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_smoke.sh"


@pytest.fixture()
def smoke(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_smoke", REPO / "scripts" / "gpu_smoke.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for step in module.STEPS:
        monkeypatch.delenv(f"SMOKE_TIMEOUT_{step.upper()}", raising=False)
    monkeypatch.delenv("SMOKE_TESTS", raising=False)
    return module


def _env(cuda: bool):
    modules = {name: "1.0" for name in ("torch", "speculators", "dspark_kit")}
    return lambda _env: {"python": "3.x", "modules": modules, "dspark_kit_from": str(REPO),
                         "cuda": cuda, "gpu": "Fake GPU" if cuda else None}  # fmt: skip


def _report(wd: Path) -> dict:
    return json.loads((wd / "gpu_smoke.json").read_text())


def test_check_creates_a_missing_workdir_and_writes_the_plan(smoke, monkeypatch, tmp_path):
    monkeypatch.setattr(smoke, "probe_env", _env(cuda=False))
    wd = tmp_path / "not" / "there" / "yet"
    assert smoke.main(["--check", str(wd)]) == 0
    report = _report(wd)
    assert report["mode"] == "check" and set(report["plan"]) == set(smoke.STEPS)
    assert (
        "train.device=cuda" in report["plan"]["run"] and "--probe-device cuda" in report["plan"]["doctor"]
    )


def test_no_gpu_exits_3_after_writing_the_report_into_a_new_workdir(smoke, monkeypatch, tmp_path):
    monkeypatch.setattr(smoke, "probe_env", _env(cuda=False))
    wd = tmp_path / "fresh"
    assert smoke.main([str(wd)]) == 3
    assert _report(wd)["error"] == "no CUDA GPU visible"


def test_bad_arguments_are_usage_errors(smoke, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        smoke.main(["--steps", "doctor,nope", str(tmp_path)])
    assert e.value.code == 2 and "nope" in capsys.readouterr().err
    assert smoke.main(["--check", "--wheels", str(tmp_path / "missing"), str(tmp_path / "wd")]) == 2


def test_a_missing_module_is_named_and_stops_before_any_step(smoke, monkeypatch, tmp_path):
    info = {**_env(cuda=True)(None), "modules": {"speculators": "MISSING: ModuleNotFoundError: x"}}
    monkeypatch.setattr(smoke, "probe_env", lambda _env: info)
    assert smoke.main([str(tmp_path / "wd")]) == 2
    assert "speculators" in _report(tmp_path / "wd")["missing"]


@pytest.mark.slow
def test_steps_run_with_limits_and_every_figure_lands_in_the_report(smoke, monkeypatch, tmp_path):
    doctor_json = json.dumps({"probes": [{"name": "pos0-decay", "ok": True, "detail": "d"}]})
    fake = {
        "doctor": [sys.executable, "-c", f"print({doctor_json!r})"],
        "tests": [sys.executable, "-c", "import time; time.sleep(30)"],
    }
    monkeypatch.setattr(smoke, "probe_env", _env(cuda=True))
    monkeypatch.setattr(smoke, "plan", lambda wd, steps, tests: {s: fake[s] for s in steps})
    monkeypatch.setattr(smoke, "xdist_args", lambda env: [])
    monkeypatch.setenv("SMOKE_TIMEOUT_TESTS", "2")
    wd, out = tmp_path / "wd", tmp_path / "out"
    assert smoke.main(["--steps", "doctor,tests", "--out", str(out), str(wd)]) == 1
    steps = _report(wd)["steps"]
    assert steps["doctor"]["status"] == "ok" and steps["doctor"]["all_ok"]
    assert steps["doctor"]["probes"] == {"pos0-decay": "ok"}
    assert steps["tests"]["status"] == "failed (timeout)" and steps["tests"]["seconds"] < 20
    assert _report(out) == _report(wd)
    assert (out / "smoke_doctor.log").exists() and (out / "smoke_tests.log").exists()


def _wheel(folder: Path, name: str) -> Path:
    """A minimal pure-python wheel (one module) that pip installs offline."""
    dist = f"{name}-0.1.dist-info"
    path = folder / f"{name}-0.1-py3-none-any.whl"
    files = {
        f"{name}.py": "VALUE = 42\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{f},,\n" for f in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for f, text in {**files, f"{dist}/RECORD": record}.items():
            z.writestr(f, text)
    return path


@pytest.mark.slow
def test_wheels_go_to_the_site_once_and_children_import_them(smoke, tmp_path):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    site.mkdir()
    _wheel(wheels, "smokepkg")
    _wheel(wheels, "dspark_kit")  # ours: never installed, the checkout is on PYTHONPATH
    first = smoke.install_wheels(wheels, site)
    assert (
        first["wheels"] == 1
        and (site / "smokepkg.py").exists()
        and not (site / "dspark_kit.py").exists()
    )
    assert smoke.install_wheels(wheels, site)["installed"] == "already"
    env = smoke.child_env(site)
    assert env["PYTHONPATH"].split(":")[:2] == [str(site), str(REPO)]
    code = "import smokepkg, dspark_kit; print(smokepkg.VALUE, dspark_kit.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "42" and out.stdout.split()[1].startswith(str(REPO))


@pytest.mark.slow
def test_the_shell_entry_point_checks_a_missing_workdir(tmp_path):
    """End to end, real imports: the bug was `smoke_run.json: No such file or directory`."""
    wd = tmp_path / "a" / "b"
    proc = subprocess.run(["bash", str(SCRIPT), "--check", str(wd)], capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = _report(wd)
    assert report["env"]["dspark_kit_from"].startswith(str(REPO))
    assert not [m for m, v in report["env"]["modules"].items() if str(v).startswith("MISSING")]


def test_figures_read_the_run_eval_and_pytest_outputs(smoke, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "checkpoint_best").mkdir(parents=True)
    (run / "eval").mkdir()
    (run / "state.json").write_text(json.dumps({
        "train": {"status": "done", "fingerprint": "x", "seconds": 41.5, "figure": 1.8},
        "eval": {"status": "failed", "fingerprint": "y", "started": 1.0},
    }))  # fmt: skip
    argv = ["python", "-m", "dspark_kit.compat.train_entry", "--draft-attn-impl", "simple_flex_attention"]
    (run / "manifest.json").write_text(json.dumps({"stages": {"train": {"argv": argv}}}))
    (run / "checkpoints" / "checkpoint_best" / "val_metrics.json").write_text(
        json.dumps({"accept_len_epoch": 1.9, "loss_epoch": 2.5, "lr": 0.1})
    )
    (run / "eval" / "eval.json").write_text(json.dumps({"acceptance_length": 1.7}))
    log = tmp_path / "step.log"
    log.write_text("stage eval\nRuntimeError: boom\n")
    fig = smoke.figures("run", "", tmp_path, log)
    assert fig["stages"]["train"] == {"status": "done", "seconds": 41.5, "figure": 1.8}
    assert fig["stages"]["eval"]["status"] == "failed"
    assert fig["train_flags"] == {
        "--draft-attn-impl": "simple_flex_attention",
        "--loss-implementation": "(speculators default)",
    }
    assert fig["val"] == {"accept_len_epoch": 1.9, "loss_epoch": 2.5}
    assert fig["last_error"] == "RuntimeError: boom"
    ev = smoke.figures("eval", 'noise {"x": 1}\n@@{"acceptance_length": 1.75}\n', tmp_path, log)
    assert ev == {"cuda": {"acceptance_length": 1.75}, "cpu_acceptance_length": 1.7}
    log.write_text("....F\n=== short test summary info ===\nFAILED tests/test_x.py::test_y - boom\n"
                   "1 failed, 40 passed, 2 skipped in 12.34s\n")  # fmt: skip
    tests = smoke.figures("tests", "", tmp_path, log)
    assert tests == {
        "counts": {"failed": 1, "passed": 40, "skipped": 2},
        "failed": ["tests/test_x.py::test_y"],
    }
