"""Security properties: no shell strings, loopback by default, opt-in remote code, no leaked secrets."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dspark_kit.resolved import Resolved

PACKAGE = Path(__file__).resolve().parent.parent / "dspark_kit"
SHELL_FUNCS = {("os", "system"), ("os", "popen"), ("os", "execl"), ("os", "execlp"), ("os", "spawnl"),
               ("subprocess", "getoutput"), ("subprocess", "getstatusoutput")}
PROCESS_FUNCS = {"run", "Popen", "call", "check_call", "check_output"}


def _is_built_string(node: ast.AST) -> bool:
    """A literal, f-string, concatenation or .format() -- a command line as one string."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, ast.JoinedStr):
        return True
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mod)):
        return _is_built_string(node.left) or _is_built_string(node.right)
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("format", "join") and _is_built_string(node.func.value))


def shell_violations(source: str, name: str = "<src>") -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        for kw in node.keywords:
            if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                found.append(f"{name}:{node.lineno}: shell={ast.unparse(kw.value)}")
        func = node.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            if (func.value.id, func.attr) in SHELL_FUNCS:
                found.append(f"{name}:{node.lineno}: {func.value.id}.{func.attr}")
            shell_api = func.value.id == "asyncio" and func.attr == "create_subprocess_shell"
            string_cmd = (func.value.id == "subprocess" and func.attr in PROCESS_FUNCS
                          and node.args and _is_built_string(node.args[0]))
            if shell_api or string_cmd:
                found.append(f"{name}:{node.lineno}: {func.value.id}.{func.attr} with a command string")
    return found


def test_the_scanner_catches_shell_use():
    bad = (
        "import os, subprocess\n"
        "subprocess.run('ls -l', shell" "=True)\n"  # split so repo-wide greps find no real use
        "os.system('rm x')\n"
        "subprocess.Popen(f'vllm serve {m}')\n"
        "subprocess.check_output('a ' + b)\n"
        "asyncio.create_subprocess_shell(cmd)\n"
        "subprocess.run(['ls', x])\n"  # fine: an argument list
        "asyncio.create_subprocess_exec(*argv)\n"  # fine too
    )
    lines = {int(v.split(":")[1]) for v in shell_violations(bad)}
    assert lines == {2, 3, 4, 5, 6}


def test_no_shell_strings_in_the_package():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 20  # the scan really covers the package
    found = [v for f in files for v in shell_violations(f.read_text(), str(f.relative_to(PACKAGE.parent)))]
    assert not found, "\n".join(found)


@pytest.mark.slow
def test_servers_bind_loopback_by_default(tiny_recipe, tiny_verifier):
    from dspark_kit.engines.local.server import parse_args
    from dspark_kit.stages.server_plan import server_plan

    assert tiny_recipe.serve.host == "127.0.0.1"
    from dspark_kit.recipe import Recipe

    assert Recipe().serve.host == "127.0.0.1"  # the schema default, not just the shipped recipe
    for role in ("chat", "hidden-states"):
        argv = server_plan(Resolved(tiny_recipe), role, port=8123).argv
        assert argv[argv.index("--host") + 1] == "127.0.0.1", role
    assert parse_args(["--model", "m"]).host == "127.0.0.1"


@pytest.mark.slow
def test_vllm_plans_bind_the_recipe_host(tiny_recipe, tiny_verifier, vllm_cpu_stub):
    from dspark_kit.stages.server_plan import server_plan

    argv = server_plan(Resolved(tiny_recipe, engine="vllm", installed={}), "chat", port=8001).argv
    assert argv[argv.index("--host") + 1] == "127.0.0.1"


@pytest.mark.parametrize("trust", [False, True])
@pytest.mark.slow
def test_trust_remote_code_only_when_the_recipe_says_so(tiny_recipe, tiny_verifier, tmp_path, trust):
    from dspark_kit.stages.server_plan import server_plan
    from dspark_kit.stages.training.train import build_train_args

    tiny_recipe.verifier.trust_remote_code = trust
    tiny_recipe.train.device = "cuda"  # plan the GPU box's vllm serve (here engine vllm is the CPU build)
    train = build_train_args(tiny_recipe, tmp_path, verifier_path=str(tiny_verifier), num_hidden_layers=4, device="cpu",
                             hidden_states_dtype="bfloat16")
    assert ("--trust-remote-code" in train) is trust
    for role in ("chat", "hidden-states"):
        argv = server_plan(Resolved(tiny_recipe, engine="vllm", installed={}), role, port=8001).argv
        assert ("--trust-remote-code" in argv) is trust, role


def test_api_keys_are_redacted_from_argv_and_manifest(tiny_recipe, tmp_path):
    from dspark_kit.stages.manifest import redact_argv, update_manifest

    secret = "sk-very-secret-123"
    argv = ["vllm", "serve", "m", "--api-key", secret, f"--api-key={secret}", "--port", "1"]
    assert secret not in " ".join(redact_argv(argv))
    assert redact_argv(argv)[-2:] == ["--port", "1"]  # nothing else touched
    update_manifest(tmp_path, tiny_recipe, "serve", argv=argv, env={})
    text = (tmp_path / "manifest.json").read_text()
    assert secret not in text and "--api-key" in text
    assert json.loads(text)["stages"]["serve"]["argv"][4] == "***"


@pytest.mark.slow
def test_local_plan_passes_the_key_in_env_not_argv(tiny_recipe, tiny_verifier):
    from dspark_kit.stages.server_plan import server_plan

    plan = server_plan(Resolved(tiny_recipe), "chat", port=8123, api_key="sk-abc")
    assert "sk-abc" not in " ".join(plan.argv)
    assert plan.env == {"DSPARK_KIT_API_KEY": "sk-abc"}


@pytest.mark.slow
def test_local_server_enforces_the_key_and_never_logs_it(tiny_verifier, tmp_path):
    import httpx

    from dspark_kit.engines.ports import free_port

    secret, port = "sk-log-leak-check-42", free_port()
    log = tmp_path / "server.log"
    argv = [sys.executable, "-m", "dspark_kit.engines.local.server", "--model", str(tiny_verifier),
            "--role", "chat", "--port", str(port), "--device", "cpu"]
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "DSPARK_KIT_API_KEY": secret})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 600  # a hang, not a busy machine
        while True:
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-2000:]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert httpx.get(url + "/v1/models", timeout=5).status_code == 401
        wrong = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope"}, timeout=5)
        assert wrong.status_code == 401 and secret not in wrong.text
        assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {secret}"}, timeout=5).status_code == 200
    finally:
        proc.terminate()
        proc.wait(10)
    assert secret not in log.read_text()
