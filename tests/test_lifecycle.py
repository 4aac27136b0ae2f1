"""ManagedServer with small real servers (python -c) on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from dspark_kit.engines import ServerPlan
from dspark_kit.engines.lifecycle import ManagedServer, ServerStartError
from dspark_kit.engines.ports import free_port

HEALTH_SERVER = r"""
import http.server, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("child", child.pid, flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
if len(sys.argv) > 2: time.sleep(float(sys.argv[2]))
server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
print("bound after the delay", flush=True)
server.serve_forever()
"""


def _plan(code: str, *args: str, port: int | None = None) -> ServerPlan:
    port = port or free_port()
    return ServerPlan(argv=[sys.executable, "-c", code, str(port), *args], host="127.0.0.1", port=port,
                      env={"DSPARK_TEST_MARKER": "1"})


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); treat it as gone (and one reaped since, too)
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_free_port_is_bindable():
    import socket

    p = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", p))


def _wait_for_log(path, text: str, deadline_s: float = 120) -> None:
    """Until the server's log shows `text`; fails only if it never does (a hang)."""
    deadline = time.monotonic() + deadline_s
    while text not in (path.read_text() if path.exists() else ""):
        assert time.monotonic() < deadline, f"{text!r} never appeared in {path}"
        time.sleep(0.05)


@pytest.mark.slow
def test_healthy_then_stop_kills_the_whole_group(tmp_path):
    log = tmp_path / "server.log"
    with ManagedServer(_plan(HEALTH_SERVER, "0.5"), log) as s:
        s.wait_healthy(120)
        assert "bound after the delay" in log.read_text()  # healthy only once the delayed server answered
        child = int(log.read_text().split("child ")[1].split()[0])
        assert _alive(child)
    assert s.proc.poll() is not None
    deadline = time.time() + 5
    while _alive(child) and time.time() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "forked worker survived stop()"


@pytest.mark.slow
def test_early_exit_quotes_the_log(tmp_path):
    code = "import sys; print('error: --frobnicate is not a flag', flush=True); sys.exit(3)"
    s = ManagedServer(_plan(code), tmp_path / "x.log")
    with pytest.raises(ServerStartError) as e:
        s.wait_healthy(120)
    assert "code 3" in str(e.value) and "--frobnicate is not a flag" in str(e.value)


@pytest.mark.slow
def test_timeout_stops_the_server_and_quotes_the_log(tmp_path):
    code = "import time; print('loading weights 12%', flush=True); time.sleep(600)"
    s = ManagedServer(_plan(code), tmp_path / "x.log", grace_s=1).start()
    _wait_for_log(tmp_path / "x.log", "loading weights 12%")  # a busy machine starts python slowly
    with pytest.raises(ServerStartError) as e:
        s.wait_healthy(1.0)
    assert "not healthy" in str(e.value) and "loading weights 12%" in str(e.value)
    assert s.proc.poll() is not None


@pytest.mark.slow
def test_stop_escalates_to_sigkill_when_signals_are_ignored(tmp_path):
    code = ("import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)")
    s = ManagedServer(_plan(code), tmp_path / "x.log", grace_s=0.4).start()
    _wait_for_log(tmp_path / "x.log", "up")
    assert s.stop() == -signal.SIGKILL  # after the grace, SIGKILL: not the 600 s the server would sleep


@pytest.mark.slow
def test_env_is_passed(tmp_path):
    code = "import os; print('marker=' + os.environ['DSPARK_TEST_MARKER'], flush=True)"
    s = ManagedServer(_plan(code), tmp_path / "x.log").start()
    s.proc.wait(120)
    s.stop()
    assert "marker=1" in (tmp_path / "x.log").read_text()


def test_holds_port_names_the_listener():
    """The identity check's question, answered for this process: a socket it listens on is its
    own; a free port, and one only connected to, are not."""
    import socket

    from dspark_kit.engines.lifecycle import holds_port

    with socket.socket() as listener, socket.socket() as other:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        other.connect(("127.0.0.1", port))  # a connection on the port is not a listener
        assert holds_port(os.getpid(), port) is True
        assert holds_port(os.getpid(), free_port()) is False


# Answers 200 to any GET, as any stray HTTP server would; prints when it listens.
IMPOSTOR = r"""
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *a): pass
srv = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
print("listening", flush=True)
srv.serve_forever()
"""


@pytest.mark.slow
def test_impostor_on_the_port_the_kit_picked_is_refused(tmp_path):
    """serve.hidden_states_port 0: the kit takes a free port when it plans the server; a stranger
    binds it before the server does. Its 200 is refused in one line, and the kit's server stops."""
    import subprocess
    from pathlib import Path

    from dspark_kit.recipe import load_recipe
    from dspark_kit.resolved import Resolved
    from dspark_kit.stages.server_plan import managed_server, server_plan

    tiny = Path(__file__).resolve().parent.parent / "recipes" / "tiny-cpu.yaml"
    res = Resolved(load_recipe(tiny, ["serve.hidden_states_port=0"]), tmp_path / "run")
    plan = server_plan(res, "hidden-states")
    assert plan.port_decision.chosen_at_start
    impostor = subprocess.Popen([sys.executable, "-c", IMPOSTOR, str(plan.port)], stdout=subprocess.PIPE, text=True)
    try:
        assert impostor.stdout.readline().strip() == "listening"
        t0 = time.monotonic()
        with pytest.raises(ServerStartError) as e, managed_server(res, "hidden-states", plan=plan):
            pytest.fail("the kit used the impostor")
        msg = str(e.value)
        print(f"\n[identity] refused after {time.monotonic() - t0:.1f}s: {msg}")
        assert "\n" not in msg and f"127.0.0.1:{plan.port}/health answered, but not from the server" in msg
        assert "another process took the port" in msg
        assert impostor.poll() is None  # not ours: left running
    finally:
        impostor.kill()
        impostor.wait()


# A launcher whose forked worker listens (vLLM's API server can be a child of `vllm serve`).
LAUNCHER = r"""
import subprocess, sys
sys.exit(subprocess.call([sys.executable, "-c", sys.argv[2], sys.argv[1]]))
"""


@pytest.mark.slow
def test_a_descendant_listening_is_the_kits_server(tmp_path):
    port = free_port()
    plan = ServerPlan(argv=[sys.executable, "-c", LAUNCHER, str(port), HEALTH_SERVER], host="127.0.0.1", port=port)
    with ManagedServer(plan, tmp_path / "server.log") as s:
        s.wait_healthy(120)  # a hang, not a busy machine
        assert s.alive()
