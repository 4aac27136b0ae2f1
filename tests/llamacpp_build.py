"""Whether llama.cpp's llama-server (`make llama-cpp`) is there for the tests that run it.

`make test` builds it (as CI does) in the background, beside the other installs and the first
tests: BUILDING exists while that build runs, and a test that needs the server waits for it. When
the build fails, INSTALL_FAILED holds one line; every test that needs the server then fails with
that line and the build log's last lines instead of running. Without the build and without a failed
one (plain `pytest` on a machine that never ran `make llama-cpp`) they skip with one line naming the
fix, except on CI. Mirrors tests/vllm_build.py.
"""

from __future__ import annotations

import fcntl
import time
from pathlib import Path

import pytest

from dspark_kit.specdec.llamacpp_tree import STAMP, llamacpp_dir, server_binary
from tests.vllm_build import on_ci

REPO = Path(__file__).resolve().parent.parent
INSTALL_FAILED = REPO / ".venv.llama-cpp-failed"  # the Makefile's $(LLAMACPP_FAILED)
BUILDING = REPO / ".venv.llama-cpp-building"  # the Makefile's $(LLAMACPP_BUILDING), gone when its build ends
BUILD_LOG = REPO / ".venv.llama-cpp.log"  # the Makefile's $(LLAMACPP_LOG)
WAIT_S = 45 * 60  # a cold build took 9.5 min alone on 2 cores; beside the tests it gets what they leave
STALE_S = 120  # BUILDING with no build holding the folder's lock this long after it was made: left by a killed run


def build_holds_lock(folder: Path) -> bool:
    """Whether scripts/build_llama_cpp.py holds `folder`'s lock (it does for the whole build)."""
    try:
        with open(folder / ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(f, fcntl.LOCK_UN)
    except BlockingIOError:
        return True
    except OSError:  # no folder yet: nothing holds it
        return False
    return False


def wait_for_background_build(building: Path = BUILDING, folder: Path | None = None,
                              timeout_s: float = WAIT_S, poll_s: float = 5.0) -> None:
    """Return once `make test`'s background build has ended (BUILDING gone), or BUILDING is stale;
    fail in one line after timeout_s."""
    folder = folder or llamacpp_dir()
    start = time.monotonic()
    while building.exists():
        try:
            age = time.time() - building.stat().st_mtime
        except FileNotFoundError:
            break
        if age > STALE_S and not build_holds_lock(folder):
            return  # a killed `make test` left it: judge the folder as it is
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"llama.cpp's background build ({building}) still running after {timeout_s / 60:.0f} min; "
                        f"its log: {BUILD_LOG}", pytrace=False)
        time.sleep(poll_s)


def _log_tail(log: Path, n: int = 5) -> str:
    lines = log.read_text(errors="replace").splitlines()[-n:] if log.is_file() else []
    return (" | last lines of its log: " + " / ".join(x.strip() for x in lines)) if lines else ""


def llama_server(marker: Path = INSTALL_FAILED, building: Path = BUILDING) -> Path:
    """llama-server's path, or one line: fail (failed build, or missing on CI) or skip."""
    binary = server_binary()
    wait_for_background_build(building)
    if marker.exists():
        pytest.fail(f"llama.cpp build: {marker.read_text().strip()}; the llama.cpp tests need {binary}"
                    f"{_log_tail(BUILD_LOG)}", pytrace=False)
    if not (llamacpp_dir() / STAMP).exists():
        if on_ci():
            pytest.fail(f"llama-server missing on CI ({binary}): `make test` should have run `make llama-cpp`",
                        pytrace=False)
        pytest.skip(f"llama.cpp's llama-server not built ({binary}): run `make llama-cpp` (`make test` does)")
    return binary
