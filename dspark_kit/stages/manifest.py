"""`<workdir>/manifest.json`: what ran, with which code, on what, how.

Resolved recipe, per-stage argv and summaries, package versions, project git
SHA + dirty flag, host, devices and seeds. Secrets (API keys) are redacted
before anything is written.
"""

from __future__ import annotations

import json
import platform
import socket
import subprocess
import time
from pathlib import Path

from dspark_kit import atomic
from dspark_kit.recipe import Recipe
from dspark_kit.redact import redact_argv, redact_obj
from dspark_kit.resolved import Resolved
from dspark_kit.rundir import RunDir

__all__ = ["git_info", "load_manifest", "redact_argv", "update_manifest"]


def git_info(repo: Path | None = None) -> dict:
    repo = repo or Path(__file__).resolve().parents[2]

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                                  timeout=10, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    sha = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"sha": sha, "dirty": bool(status) if status is not None else None}


def load_manifest(workdir: Path) -> dict:
    f = RunDir.at(workdir).manifest
    return json.loads(f.read_text()) if f.exists() else {}


def update_manifest(workdir: Path, recipe: Recipe, stage: str | None = None, *, resolved: Resolved | None = None,
                    **stage_fields) -> dict:
    """`resolved`: the command's decisions (K, window, devices, dtypes) with their sources."""
    from dspark_kit.devices import describe

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    m = load_manifest(workdir)
    m["recipe"] = recipe.model_dump(mode="json")
    m.setdefault("created", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    m["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    m["git"] = git_info()
    m["host"] = {"hostname": socket.gethostname(), "platform": platform.platform()}
    if resolved is not None:
        m["resolved"] = resolved.summary()
    if "devices" not in m:
        m["devices"] = describe(resolved.train_device.value if resolved is not None else "auto")  # else: this machine
    m["seeds"] = {"train": recipe.train.seed, "regen": recipe.regen.seed, "serve": recipe.serve.seed}
    if stage:
        entry = m.setdefault("stages", {}).setdefault(stage, {})
        if "argv" in stage_fields:
            stage_fields["argv"] = redact_argv(list(stage_fields["argv"]))
        entry.update(stage_fields)
    m = redact_obj(json.loads(json.dumps(m, default=str)))  # the recipe's extra_args, env, argv: no secrets
    atomic.write_text(RunDir.at(workdir).manifest, json.dumps(m, indent=2, default=str))
    return m
