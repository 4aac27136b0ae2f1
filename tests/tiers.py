"""The fast tier stays fast: what a test not marked `slow` may not do (hooks used by conftest.py).

`make test-fast` runs `pytest -m "not slow"` and must finish in about a minute on 2 busy cores,
on a clean clone as on a warm machine. A test not marked `slow`:
- may not request an expensive fixture (EXPENSIVE_FIXTURES, directly or through another fixture):
  it errors at setup, naming the fixture;
- may not start a process: subprocess.Popen (and so run/check_output/asyncio's subprocesses)
  fails it, except for the few quick non-Python tools in QUICK_TOOLS;
- sees an empty model cache (DSPARK_KIT_CACHE) and may not build the tiny verifier, so a test
  that quietly resolves or loads it fails here whether or not this machine has it cached.
Everything else about a test's tier is its own marker: `@pytest.mark.slow`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest

# Fixtures that build or load the tiny verifier, train, or start servers. A fixture that takes
# one of them is covered too (the check reads the test's whole fixture closure); one that does
# such work without them belongs here.
EXPENSIVE_FIXTURES = frozenset({"tiny_verifier", "trained_run", "vllm_cpu_build"})
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


@contextmanager
def no_process(nodeid: str):
    """subprocess.Popen refuses to start anything but QUICK_TOOLS while the block runs."""
    real = subprocess.Popen._execute_child

    def refuse(self, args, *rest, **kw):
        if _program(args) not in QUICK_TOOLS:
            pytest.fail(f"{nodeid} starts a process ({_program(args)}) but is not marked slow: "
                        "add @pytest.mark.slow", pytrace=False)
        return real(self, args, *rest, **kw)

    subprocess.Popen._execute_child = refuse
    try:
        yield
    finally:
        subprocess.Popen._execute_child = real


@contextmanager
def no_verifier_build(nodeid: str, empty_cache: Path):
    """An empty DSPARK_KIT_CACHE, and building the tiny verifier into it fails the test."""
    from dspark_kit.data import tiny_verifier

    def refuse(*args, **kw):
        pytest.fail(f"{nodeid} builds or loads the tiny verifier but is not marked slow: add "
                    "@pytest.mark.slow (and take the `tiny_verifier` fixture)", pytrace=False)

    real, old_cache = tiny_verifier.build_tokenizer, os.environ.get("DSPARK_KIT_CACHE")
    tiny_verifier.build_tokenizer = refuse  # the first step of a build
    os.environ["DSPARK_KIT_CACHE"] = str(empty_cache)
    try:
        yield
    finally:
        tiny_verifier.build_tokenizer = real
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
