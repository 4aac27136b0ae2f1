"""The fast tier stays fast: what a test not marked `slow` may not do (hooks used by conftest.py).

`make test-fast` runs `pytest -m "not slow"` and must finish in about a minute on 2 busy cores,
on a clean clone as on a warm machine. A test not marked `slow`:
- may not request an expensive fixture (EXPENSIVE_FIXTURES, directly or through another fixture):
  it errors at setup, naming the fixture;
- may not start a process: subprocess (and so run/check_output/asyncio's subprocesses), os.fork
  (and so multiprocessing's fork start method, ProcessPoolExecutor), os.posix_spawn/system/exec*
  and multiprocessing's spawn and forkserver start methods fail it, except for the few quick
  non-Python tools in QUICK_TOOLS;
- sees an empty model cache (DSPARK_KIT_CACHE) and may not build the tiny verifier, so a test
  that quietly resolves or loads it fails here whether or not this machine has it cached.
Everything else about a test's tier is its own marker: `@pytest.mark.slow`.
"""

from __future__ import annotations

import multiprocessing.util
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest

# Fixtures that build or load the tiny verifier, train, or start servers. A fixture that takes
# one of them is covered too (the check reads the test's whole fixture closure); one that does
# such work without them belongs here.
EXPENSIVE_FIXTURES = frozenset({"tiny_verifier", "trained_run", "vllm_cpu_build", "smollm2_verifier"})
# Executables a fast test may run: quick system tools, no Python import behind them (the
# manifest asks git for the commit, platform.processor() asks uname, tests/test_makefile.py
# runs make).
QUICK_TOOLS = frozenset({"git", "make", "uname"})


def is_slow(item: pytest.Item) -> bool:
    return item.get_closest_marker("slow") is not None


def expensive_fixtures(item: pytest.Item) -> list[str]:
    return sorted(EXPENSIVE_FIXTURES & set(getattr(item, "fixturenames", ())))


def _program(args) -> str:
    first = args if isinstance(args, (str, bytes, os.PathLike)) else next(iter(args), "")
    return Path(os.fsdecode(first)).name


# The audit events (sys.addaudithook, Python's public hook) raised before a process starts.
PROCESS_EVENTS = frozenset({"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn",
                            "os.system", "os.exec"})


class ProcessGuard:
    """The audit hook: while `nodeid` is set, a process start fails that test. An audit hook cannot be
    removed, so it is added once and switched by `nodeid`."""

    def __init__(self):
        self.nodeid: str | None = None
        self.installed = False

    def __call__(self, event: str, args) -> None:
        if self.nodeid is None or event not in PROCESS_EVENTS:
            return
        what = _program(args[1]) if event == "subprocess.Popen" else event
        if event == "subprocess.Popen" and what in QUICK_TOOLS:
            return
        self.refuse(what)

    def refuse(self, what: str) -> None:
        nodeid, self.nodeid = self.nodeid, None  # pytest.fail's own work must not trip the guard
        try:
            pytest.fail(f"{nodeid} starts a process ({what}) but is not marked slow: add @pytest.mark.slow",
                        pytrace=False)
        finally:
            self.nodeid = nodeid


PROCESS_GUARD = ProcessGuard()


@contextmanager
def no_process(nodeid: str):
    """No process may start but QUICK_TOOLS while the block runs."""
    if not PROCESS_GUARD.installed:
        sys.addaudithook(PROCESS_GUARD)
        PROCESS_GUARD.installed = True
    # multiprocessing's spawn and forkserver start methods raise no audit event: both start
    # their interpreter through spawnv_passfds
    real_spawn = multiprocessing.util.spawnv_passfds

    def refuse_spawn(path, args, passfds):
        PROCESS_GUARD.refuse("multiprocessing")
        return real_spawn(path, args, passfds)

    PROCESS_GUARD.nodeid, multiprocessing.util.spawnv_passfds = nodeid, refuse_spawn
    try:
        yield
    finally:
        PROCESS_GUARD.nodeid, multiprocessing.util.spawnv_passfds = None, real_spawn


@contextmanager
def no_verifier_build(nodeid: str, empty_cache: Path):
    """An empty DSPARK_KIT_CACHE, and building the tiny verifier into it fails the test."""
    from dspark_kit.data import tiny_verifier

    def refuse(*args, **kw):
        pytest.fail(f"{nodeid} builds or loads the tiny verifier but is not marked slow: add "
                    "@pytest.mark.slow (and take the `tiny_verifier` fixture)", pytrace=False)

    real, old_cache = tiny_verifier._unpack_or_build, os.environ.get("DSPARK_KIT_CACHE")
    tiny_verifier._unpack_or_build = refuse  # unpacking the shipped files or building them
    os.environ["DSPARK_KIT_CACHE"] = str(empty_cache)
    try:
        yield
    finally:
        tiny_verifier._unpack_or_build = real
        if old_cache is None:
            os.environ.pop("DSPARK_KIT_CACHE", None)
        else:
            os.environ["DSPARK_KIT_CACHE"] = old_cache


_EMPTY_CACHE: list[Path] = []


def empty_cache() -> Path:
    if not _EMPTY_CACHE:
        _EMPTY_CACHE.append(Path(tempfile.mkdtemp(prefix="dspark-kit-fast-tier-cache-")))
    return _EMPTY_CACHE[0]


@contextmanager
def fast_tier(item: pytest.Item):
    if is_slow(item):
        yield
        return
    with no_process(item.nodeid), no_verifier_build(item.nodeid, empty_cache()):
        yield


# --- hooks (conftest.py imports these names, which registers them) ---------------------------

def pytest_sessionfinish(session):
    if _EMPTY_CACHE:
        shutil.rmtree(_EMPTY_CACHE.pop(), ignore_errors=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    used = [] if is_slow(item) else expensive_fixtures(item)
    if used:  # before any fixture runs: the fixture may take minutes
        pytest.fail(f"{item.nodeid} uses {', '.join(used)} (builds, trains or serves) but is not "
                    "marked slow: add @pytest.mark.slow", pytrace=False)
    with fast_tier(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with fast_tier(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    with fast_tier(item):
        return (yield)
