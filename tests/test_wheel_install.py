"""The kit installs anywhere: its wheel, installed into a fresh venv, runs a shipped recipe by name
from a folder outside the checkout (`dspark-kit run tiny-cpu --stages regen,prepare`).

Lean: the wheel is built without build isolation (with a setuptools this interpreter can import,
new enough for pyproject's license field) and installed with --no-deps; the fresh venv reaches
the heavy dependencies (torch, transformers, ...) through a .pth line naming the site-packages
they are in here, so nothing is downloaded. The venv's own site-packages holds the wheel's
dspark_kit and comes first: the checkout is on no path the run sees.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
LICENSE_FIELD_SETUPTOOLS = Version("77")  # `license = "Apache-2.0"` (PEP 639)


def _builder_path() -> str | None:
    """Where a setuptools new enough to build the wheel lives (None: let pip fetch one)."""
    found = [d for d in importlib.metadata.distributions() if (d.metadata["Name"] or "").lower() == "setuptools"
             and Version(d.version) >= LICENSE_FIELD_SETUPTOOLS]
    return str(found[0].locate_file("")) if found else None


def _dependency_paths() -> list[str]:
    """This interpreter's site-packages folders (where torch, transformers, typer... are), not the checkout."""
    return [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()
            and not Path(p).resolve().is_relative_to(REPO.resolve() / "dspark_kit")]


def _run(argv: list[str], cwd: Path, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert out.returncode == 0, f"{argv}: {out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out


def test_the_wheel_runs_a_shipped_recipe_from_outside_the_checkout(tmp_path):
    wheels, venv, elsewhere = tmp_path / "wheels", tmp_path / "venv", tmp_path / "elsewhere"
    elsewhere.mkdir()
    source = tmp_path / "source"  # the checkout's files (tracked or not ignored), so the build writes nothing here
    listed_files = _run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO).stdout.splitlines()
    for name in listed_files:
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    builder = _builder_path()
    env = {**os.environ, "PYTHONPATH": builder} if builder else dict(os.environ)
    isolation = ["--no-build-isolation"] if builder else []
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", str(wheels), str(source)],
         cwd=tmp_path, env=env)
    (wheel,) = wheels.glob("dspark_kit-*.whl")

    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    python = venv / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                     cwd=tmp_path).stdout.strip())
    (site / "zz_dependencies.pth").write_text("\n".join(_dependency_paths()) + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)],
         cwd=tmp_path)
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    where = _run([str(python), "-c", "import dspark_kit; print(dspark_kit.__file__)"], cwd=elsewhere, env=clean)
    assert Path(where.stdout.strip()).is_relative_to(site), where.stdout  # the wheel's copy, not the checkout

    kit = venv / "bin" / "dspark-kit"
    listed = _run([str(kit), "recipe", "list", "--json"], cwd=elsewhere, env=clean)
    names = {r["name"]: r["path"] for r in json.loads(listed.stdout)}
    assert "tiny-cpu" in names and Path(names["tiny-cpu"]).is_relative_to(site), names

    run = _run([str(kit), "run", "tiny-cpu", "--stages", "regen,prepare", "--set", "data.limit=8", "--json"],
               cwd=elsewhere, env=clean, timeout=900)
    rows = {r["stage"]: r["status"] for r in json.loads(run.stdout)["stages"]}
    assert rows == {"regen": "done", "prepare": "done"}, run.stdout
    assert (elsewhere / "runs" / "tiny-cpu" / "prepared").is_dir()  # the recipe's workdir, from this folder
