"""The fast tier's guards (tests/tiers.py) hold: these tests are fast, so the guards are on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tiers


def test_a_fast_test_cannot_start_python_but_may_ask_git():
    with pytest.raises(pytest.fail.Exception, match="starts a process .python.* not marked slow"):
        subprocess.run([sys.executable, "-c", "pass"], check=False)
    assert subprocess.run(["git", "--version"], capture_output=True, check=False).returncode == 0


def _noop():
    pass


@pytest.mark.parametrize("start", ["fork", "spawn", "forkserver", "os.fork", "pool"])
def test_a_fast_test_cannot_start_a_process_any_other_way(start):
    import concurrent.futures
    import multiprocessing

    with pytest.raises(pytest.fail.Exception, match="starts a process .* not marked slow"):
        if start == "os.fork":
            pid = os.fork()
            if pid == 0:  # only if the guard failed to stop the fork
                os._exit(0)
            os.waitpid(pid, 0)
        elif start == "pool":
            with concurrent.futures.ProcessPoolExecutor(1) as pool:
                pool.submit(_noop).result()
        else:
            p = multiprocessing.get_context(start).Process(target=_noop)
            p.start()
            p.join()


def test_a_fast_test_sees_an_empty_model_cache_and_cannot_build_the_tiny_verifier():
    from dspark_kit.data.tiny_verifier import ensure_tiny_verifier

    assert Path(os.environ["DSPARK_KIT_CACHE"]) == tiers.empty_cache()
    with pytest.raises(pytest.fail.Exception, match="builds or loads the tiny verifier"):
        ensure_tiny_verifier()


class FakeItem:
    def __init__(self, fixturenames, slow=False):
        self.fixturenames, self.nodeid, self._slow = fixturenames, "tests/test_x.py::test_y", slow

    def get_closest_marker(self, name):
        return object() if name == "slow" and self._slow else None


@pytest.mark.parametrize("fixture", sorted(tiers.EXPENSIVE_FIXTURES))
def test_an_expensive_fixture_fails_a_test_not_marked_slow_before_it_runs(fixture):
    with pytest.raises(pytest.fail.Exception, match=f"uses {fixture} .* not marked slow"):
        next(tiers.pytest_runtest_setup(FakeItem(["tmp_path", fixture])))


def test_a_slow_test_may_use_them_and_runs_unguarded():
    guarded = tiers.PROCESS_GUARD.nodeid
    assert guarded is not None  # this test itself is fast: guarded
    tiers.PROCESS_GUARD.nodeid = None  # as outside any test
    try:
        setup = tiers.pytest_runtest_setup(FakeItem(["tiny_verifier", "trained_run"], slow=True))
        next(setup)  # no failure; the fixtures would run here
        assert tiers.PROCESS_GUARD.nodeid is None
        with pytest.raises(StopIteration):
            setup.send(None)
    finally:
        tiers.PROCESS_GUARD.nodeid = guarded


def test_every_group_started_first_is_a_test_module_here():
    """A renamed module in conftest.HEAVY_FIRST would silently fall back to file order (a long tail)."""
    from tests.conftest import HEAVY_FIRST, TRAINED_RUN_GROUP

    here = Path(__file__).parent
    missing = [g for g in HEAVY_FIRST if g != TRAINED_RUN_GROUP and not (here / g).is_file()]
    assert not missing, f"conftest.HEAVY_FIRST names no test module: {missing}"
    assert len(set(HEAVY_FIRST)) == len(HEAVY_FIRST)
