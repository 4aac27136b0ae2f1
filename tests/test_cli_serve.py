import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from test_checkpoints import write_ckpt
from typer.testing import CliRunner

from dspark_kit.cli import app
from tests.ctrl_c import default_sigint

runner = CliRunner()


@pytest.fixture
def setup(tmp_path: Path):
    """A recipe with a local 4-layer verifier dir and a checkpoint_best trained on it."""
    verifier = tmp_path / "verifier"
    verifier.mkdir()
    (verifier / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 4,
                                                      "vocab_size": 1024}))
    workdir = tmp_path / "run"
    ckpt = write_ckpt(workdir / "checkpoints" / "0", str(verifier))
    os.symlink("0", workdir / "checkpoints" / "checkpoint_best")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({
        "workdir": str(workdir),
        "verifier": {"path": str(verifier)},
        "draft": {"block_size": 8},
        "hidden_states": {"target_layer_ids": [1, 2, 3]},
        "train": {"device": "cuda"},  # the CUDA command even here (no GPU: auto would plan vLLM's CPU build)
        "serve": {"engine": "vllm", "port": 8123},
    }))
    return recipe, workdir, ckpt, verifier


def run(*args):
    return runner.invoke(app, ["serve", *map(str, args)])


def test_chat_dry_run_prints_the_exact_line(setup):
    recipe, _, _, verifier = setup
    res = run("-r", recipe, "--role", "chat", "--engine", "vllm-ascend", "--set", "serve.devices=4,5", "--dry-run")
    assert res.exit_code == 0, res.output
    line = res.stdout.strip().splitlines()[-1]
    words = shlex.split(line)
    assert words[0] == "ASCEND_RT_VISIBLE_DEVICES=4,5" and "CUDA_VISIBLE_DEVICES=4,5" not in words
    i = words.index("vllm")
    assert words[i:i + 3] == ["vllm", "serve", str(verifier)]
    assert words[words.index("--port") + 1] == "8123"


def test_spec_dry_run_json_resolves_and_validates(setup):
    recipe, _, ckpt, _ = setup
    res = run("-r", recipe, "--role", "spec", "--dry-run", "--json", "--port", "9001")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["checkpoint"] == str(ckpt.resolve()) and out["findings"] == []
    spec = json.loads(out["argv"][out["argv"].index("--speculative-config") + 1])
    # serve.num_speculative_tokens auto = the checkpoint's 8 trained slots (sample_from_anchor)
    assert spec == {"method": "dspark", "model": str(ckpt.resolve()), "num_speculative_tokens": 8}
    assert "trained slots" in out["resolved"]["k"]["source"]
    assert out["base_url"] == "http://127.0.0.1:9001"
    assert out["shell_line"].endswith(shlex.join(out["argv"][-2:]))
    # vllm is not installed here: the plan says which release the serving machine needs
    assert any("vllm is not installed here" in d and ">= 0.27.0" in d for d in out["decisions"])


def test_spec_checkpoint_errors_stop(setup):
    recipe, workdir, _, verifier = setup
    write_ckpt(workdir / "checkpoints" / "1", str(verifier), ids=(1, 2))
    res = run("-r", recipe, "--role", "spec", "--checkpoint", "1", "--dry-run")
    assert res.exit_code == 2
    assert "layer-ids" in res.output and "vllm serve" not in res.stdout
    res = run("-r", recipe, "--role", "spec", "--checkpoint", "5", "--dry-run")
    assert res.exit_code == 2 and "serve.checkpoint 5" in res.output


def test_spec_warnings_print_but_continue(setup):
    recipe, workdir, _, verifier = setup
    write_ckpt(workdir / "checkpoints" / "2", str(verifier), block=8)
    res = run("-r", recipe, "--role", "spec", "--checkpoint", "latest", "--set", "draft.block_size=7", "--dry-run")
    assert res.exit_code == 0, res.output
    assert "block-size" in res.stderr and str((workdir / "checkpoints" / "2").resolve()) in res.stdout
    assert res.stderr.count("block_size 8 != recipe draft.block_size 7") == 1  # once: not again by preflight


def test_checkpoint_and_engine_flags_reach_preflight(setup):
    """Reproduced: in a trained run without checkpoint_best, `serve --checkpoint 1 --engine local` stopped
    with preflight's "serve.checkpoint checkpoint_best ... not found" (preflight re-resolved the recipe's
    own checkpoint and engine), and every checkpoint warning printed twice."""
    recipe, workdir, _, verifier = setup
    (workdir / "checkpoints" / "checkpoint_best").unlink()
    write_ckpt(workdir / "checkpoints" / "1", str(verifier), block=7)  # a warning: trained block 7, recipe 8
    res = run("-r", recipe, "--role", "spec", "--engine", "local", "--checkpoint", "1", "--dry-run")
    assert res.exit_code == 0, res.output
    assert "pitfall" not in res.output and "checkpoint_best" not in res.output
    words = shlex.split(res.stdout.strip().splitlines()[-1])
    assert "dspark_kit.engines.local.server" in words  # the --engine flag, not the recipe's vllm
    assert words[words.index("--draft") + 1] == str((workdir / "checkpoints" / "1").resolve())
    warnings = [ln for ln in res.stderr.splitlines() if ln.startswith("warning:")]
    assert sum("block-size" in w for w in warnings) == 1
    assert len(warnings) == len(set(warnings)), warnings  # each warning once


def test_a_bug_while_starting_surfaces_with_its_traceback(setup, monkeypatch):
    """Expected start failures are one line with their cause; anything else (a bug) keeps its
    traceback instead of becoming "did not become healthy", and the server is stopped either way."""
    from dspark_kit.engines.lifecycle import ManagedServer, ServerStartError

    recipe = setup[0]
    stopped = []
    monkeypatch.setattr(ManagedServer, "start", lambda self: self)
    monkeypatch.setattr(ManagedServer, "stop", lambda self: stopped.append(1))

    def bug(self, timeout):
        raise KeyError("a bug in the health check")

    monkeypatch.setattr(ManagedServer, "wait_healthy", bug)
    res = run("-r", recipe, "--role", "chat", "--port", "9")
    assert isinstance(res.exception, KeyError) and "did not become healthy" not in res.output
    assert stopped

    def exited(self, timeout):
        raise ServerStartError("server exited with code 1 before becoming healthy; log ends with: CUDA OOM")

    monkeypatch.setattr(ManagedServer, "wait_healthy", exited)
    res = run("-r", recipe, "--role", "chat", "--port", "9")
    assert res.exit_code == 1 and "did not become healthy" in res.output and "CUDA OOM" in res.output


@pytest.mark.parametrize("args,message", [
    (["--role", "leader"], "--role"),
    (["--role", "chat", "--engine", "sglang"], "--engine"),
    (["--role", "chat", "--checkpoint", "latest"], "--checkpoint"),
    (["--role", "chat", "--set", "serve.port=70000"], "serve.port"),
])
def test_bad_input_is_one_line_error(setup, args, message):
    recipe = setup[0]
    res = run("-r", recipe, *args, "--dry-run")
    assert res.exit_code == 2 and message in res.output


def test_local_engine_dispatch(setup):
    recipe = setup[0]
    res = run("-r", recipe, "--role", "chat", "--engine", "local", "--port", "8999", "--dry-run")
    assert res.exit_code == 0, res.output
    assert "dspark_kit.engines.local.server" in res.stdout and "--port 8999" in res.stdout


FAKE_VLLM = """#!{python}
import sys, http.server
args = sys.argv[1:]
host, port = args[args.index("--host") + 1], int(args[args.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer((host, port), H).serve_forever()
"""


@pytest.mark.slow
def test_serve_starts_waits_healthy_and_stops_on_ctrl_c(setup, tmp_path: Path):
    """A stand-in `vllm` on PATH (a real HTTP server on 127.0.0.1): start, health, URL, Ctrl-C, clean stop."""
    recipe, workdir, _, _ = setup
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "vllm"
    fake.write_text(FAKE_VLLM.format(python=sys.executable))
    fake.chmod(0o755)
    from dspark_kit.engines.ports import free_port

    port = free_port()
    # PYTHONFAULTHANDLER: if serve ever hangs on Ctrl-C, SIGABRT below makes it print every
    # thread's stack, and the failure shows where it was stuck.
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONFAULTHANDLER": "1"}
    # Ctrl-C as in a terminal (tests/ctrl_c.py: a suite started with `&` inherits SIGINT ignored; this test once hung on CI)
    proc = subprocess.Popen([sys.executable, "-m", "dspark_kit", "serve", "-r", str(recipe), "--role", "chat",
                             "--port", str(port), "--set", "serve.startup_timeout=30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            cwd=Path(__file__).parents[1], text=True,
                            preexec_fn=default_sigint)  # noqa: PLW1509 - only resets SIGINT
    try:
        url = proc.stdout.readline().strip()
        assert url == f"http://127.0.0.1:{port}", proc.stderr.read() if proc.poll() is not None else url
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=45)  # stop() itself gives up after 25 s (SIGINT 10, SIGTERM 5, SIGKILL)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            pytest.fail("serve did not exit 45 s after Ctrl-C; its stacks:\n" + proc.communicate(timeout=30)[1][-6000:])
        assert code == 0, proc.stderr.read()
        deadline = time.time() + 5
        while time.time() < deadline:  # the server is gone after a clean stop
            try:
                httpx.get(url + "/health", timeout=0.5)
            except httpx.TransportError:
                break
            time.sleep(0.1)
        else:
            pytest.fail("server still answering after serve exited")
        assert (workdir / "logs" / "serve-chat.log").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
