"""Issue 14: every server the kit starts dies with the kit (SIGTERM, SIGINT or SIGKILL of the kit)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from dspark_kit.engines.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
KIT = [sys.executable, "-m", "dspark_kit"]
SLOW_ENGINE = "serve.extra_args=[\"--token-delay-ms\", \"50\"]"  # keeps regen busy while we kill it


def _env():
    return {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}


def _engine_child(parent: psutil.Process, timeout: float = 600) -> tuple[psutil.Process, int]:
    """The local engine the kit started, and its port, once /health answers (timeout: a hang)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert parent.is_running(), "the kit exited before its engine was up"
        for child in parent.children(recursive=True):
            try:
                cmd = child.cmdline()
            except psutil.Error:
                continue
            if "dspark_kit.engines.local.server" in cmd:
                port = int(cmd[cmd.index("--port") + 1])
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        return child, port
                except httpx.HTTPError:
                    pass
        time.sleep(0.3)
    raise AssertionError("no healthy local engine under the kit")


def _assert_gone(child: psutil.Process, port: int, within: float = 10) -> None:
    deadline = time.time() + within
    while time.time() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5)
        except httpx.HTTPError:
            if not child.is_running() or child.status() == psutil.STATUS_ZOMBIE:
                return
        time.sleep(0.2)
    try:
        child.kill()  # do not leak it into the rest of the suite
    finally:
        raise AssertionError(f"engine on port {port} still running {within}s after its kit died")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
@pytest.mark.slow
def test_killing_regen_ends_its_engine(tmp_path, sig):
    proc = subprocess.Popen([*KIT, "regen", "-r", str(ROOT / "recipes/tiny-cpu.yaml"), "-o",
                             str(tmp_path / "regen.jsonl"), "--set", SLOW_ENGINE, "--json"],
                            env=_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        child, port = _engine_child(psutil.Process(proc.pid))
        proc.send_signal(sig)
        proc.wait(30)
        _assert_gone(child, port)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
@pytest.mark.slow
def test_killing_serve_ends_its_server(tmp_path, sig):
    port = free_port()
    proc = subprocess.Popen([*KIT, "serve", "--role", "chat", "-r", str(ROOT / "recipes/tiny-cpu.yaml"),
                             "--port", str(port), "--workdir", str(tmp_path)],
                            env=_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        child, found = _engine_child(psutil.Process(proc.pid))
        assert found == port
        proc.send_signal(sig)
        proc.wait(30)
        _assert_gone(child, port)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_server_run_by_hand_is_not_tied_to_a_parent(monkeypatch):
    from dspark_kit.engines.local import server as local_server

    monkeypatch.delenv("DSPARK_KIT_PARENT_PID", raising=False)
    before = {t.name for t in __import__("threading").enumerate()}
    local_server.watch_parent()
    assert "parent-watch" not in {t.name for t in __import__("threading").enumerate()} - before


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
@pytest.mark.slow
def test_killing_the_kit_during_training_ends_the_trainer(tmp_path, sig):
    script = tmp_path / "kit.py"
    script.write_text(
        "import sys\n"
        "from pathlib import Path\n"
        "from dspark_kit.engines import LaunchPlan\n"
        "from dspark_kit.stages.training.train import run_training\n"
        "plan = LaunchPlan([sys.executable, '-c', 'import time; print(\"step\", flush=True); time.sleep(120)'], {})\n"
        f"run_training(plan, Path({str(tmp_path / 'train.log')!r}))\n")
    proc = subprocess.Popen([sys.executable, str(script)], env=_env(), stderr=subprocess.PIPE)
    try:
        assert proc.stderr.readline().strip() == b"step"  # the trainer runs and its output is teed
        trainer = psutil.Process(proc.pid).children()[0]
        proc.send_signal(sig)
        proc.wait(30)
        trainer.wait(10)  # raises TimeoutExpired if the trainer outlived the kit
    finally:
        if proc.poll() is None:
            proc.kill()


# ---- the one stop policy (dspark_kit.processes.stop): SIGTERM to the group, grace, SIGKILL ----

FAMILY = r"""
import os, signal, subprocess, sys, time
deaf = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); " if sys.argv[1] == "ignore" else ""
if deaf:  # this process says it got SIGTERM, and stays
    signal.signal(signal.SIGTERM, lambda *_: print("got SIGTERM", flush=True))
stay = deaf + "import time; time.sleep(600)"
grandchild = subprocess.Popen([sys.executable, "-c", stay])  # in the group
# torchrun's workers: a session of their own, out of the group's reach
escaped = subprocess.Popen([sys.executable, "-c", stay], start_new_session=True)
print(grandchild.pid, escaped.pid, flush=True)
time.sleep(600)
"""


def _start_family(mode: str):
    from dspark_kit.processes import start

    proc = start([sys.executable, "-c", FAMILY, mode], dict(os.environ), stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2, "the family never started"
    return proc, [psutil.Process(p) for p in pids]


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _reap(proc, family) -> None:
    """Whatever a failed assertion left running."""
    for p in family:
        if not _gone(p):
            p.kill()
    if proc.poll() is None:
        proc.kill()


@pytest.mark.slow
def test_stop_kills_a_child_that_ignores_sigterm_after_the_grace_and_its_whole_family():
    from dspark_kit.processes import stop

    proc, family = _start_family("ignore")
    try:
        assert stop(proc, grace_s=1.5) == -signal.SIGKILL  # SIGTERM was ignored: killed
        assert "got SIGTERM" in proc.stdout.read()  # SIGTERM came first, and the process outlived it
        assert all(_gone(p) for p in family), "a grandchild outlived stop()"
    finally:
        _reap(proc, family)


@pytest.mark.slow
def test_stop_sends_sigterm_first_and_a_willing_child_exits_within_the_grace():
    from dspark_kit.processes import stop

    proc, family = _start_family("obey")
    try:
        # ended by SIGTERM: had the grace run out, stop would have sent SIGKILL and said so
        assert stop(proc, grace_s=30) == -signal.SIGTERM
        assert all(_gone(p) for p in family)  # the grandchildren got SIGTERM too, the escaped one included
    finally:
        _reap(proc, family)


COUNTING = r"""
import os, signal, subprocess, sys, time
out = sys.argv[1]
def count(tag):
    def handler(signum, frame):
        with open(out, "a") as f:
            f.write(tag + "\n")
        if tag == "leader":  # torchrun's agent: forwards SIGTERM to its worker, then waits for it
            worker.send_signal(signal.SIGTERM)
            worker.wait()
        time.sleep(0.3)  # a second SIGTERM now would land inside the handler (speculators' deadlock)
        os._exit(0)
    return handler
if len(sys.argv) > 2:  # the worker
    signal.signal(signal.SIGTERM, count("worker"))
    print("ready", flush=True)
    time.sleep(600)
worker = subprocess.Popen([sys.executable, __file__, out, "worker"], start_new_session=True, stdout=subprocess.PIPE)
worker.stdout.readline()
signal.signal(signal.SIGTERM, count("leader"))
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_each_process_gets_sigterm_once_when_the_kit_is_stopped(tmp_path):
    """The kit's own signal handler signals the group, then stop() runs: before, the leader got two
    SIGTERMs and the escaped worker (torchrun's, whose agent forwards) three, and speculators'
    handler deadlocks on a second one (1 stop in 6 lost its interrupted save)."""
    from dspark_kit.processes import _signal_live, start, stop

    script, out = tmp_path / "family.py", tmp_path / "signals.txt"
    script.write_text(COUNTING)
    proc = start([sys.executable, str(script), str(out)], dict(os.environ), stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        worker = psutil.Process(proc.pid).children()[0]
        _signal_live(signal.SIGTERM)  # what the kit's handler does on SIGTERM / Ctrl-C
        stop(proc, grace_s=20)
        assert sorted(out.read_text().split()) == ["leader", "worker"]  # once each
        assert _gone(worker)
    finally:
        _reap(proc, [])


@pytest.mark.slow
def test_a_logged_commands_lines_reach_its_log_as_they_are_printed(tmp_path):
    """run_logged's log is live: a line is in the file while the command still runs (a user's
    `tail -f`, and tests that act on a trainer's line, e.g. test_train_interrupt's SIGTERM)."""
    import threading

    from dspark_kit.processes import run_logged

    log, go = tmp_path / "cmd.log", tmp_path / "go"
    waits = f"import os, time\nprint('first line')\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)"
    result: list = []
    t = threading.Thread(target=lambda: result.append(run_logged([sys.executable, "-c", waits], dict(os.environ), log)))
    t.start()
    try:
        deadline = time.monotonic() + 60
        while "first line" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.05)
        seen = "first line" in log.read_text()
    finally:
        go.touch()
        t.join(60)
    assert seen, "the line reached the log only when the command ended"
    assert result == [(0, None)]
