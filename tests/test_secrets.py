"""Issue 14: a planted API key appears in no output of the kit (stdout, stderr, any file of a run)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_kit.redact import redact_argv, redact_env, redact_obj, redact_text

ROOT = Path(__file__).resolve().parent.parent
KIT = [sys.executable, "-m", "dspark_kit"]
SECRET = "sk-SECRETplanted0123456789"
TOKEN = "plainSecretValue42"  # no sk- prefix: only the flag / env name gives it away


def test_redaction_rules():
    line = (f"DSPARK_KIT_API_KEY={SECRET} HF_TOKEN={TOKEN} TOKENIZERS_PARALLELISM=false python -m x "
            f"--api-key {TOKEN} --token={TOKEN} --max-tokens 5 --mask-token-id 3 --password '{TOKEN}'")
    out = redact_text(line)
    assert SECRET not in out and TOKEN not in out
    for kept in ("TOKENIZERS_PARALLELISM=false", "--max-tokens 5", "--mask-token-id 3"):
        assert kept in out
    assert redact_argv(["--api-key", TOKEN, f"--hf-token={TOKEN}", "--max-num-batched-tokens", "8", SECRET]) == [
        "--api-key", "***", "--hf-token=***", "--max-num-batched-tokens", "8", "***"]
    assert redact_env({"OPENAI_API_KEY": TOKEN, "CUDA_VISIBLE_DEVICES": "0"}) == {
        "OPENAI_API_KEY": "***", "CUDA_VISIBLE_DEVICES": "0"}
    rec = redact_obj({"train": {"extra_args": ["--api-key", TOKEN]}, "draft": {"mask_token_id": 5},
                      "regen": {"max_tokens": 9}, "hf_token": TOKEN})
    assert TOKEN not in str(rec) and rec["draft"]["mask_token_id"] == 5 and rec["regen"]["max_tokens"] == 9


def _kit(*args, cwd, env_extra=None, check=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", **(env_extra or {})}
    r = subprocess.run([*KIT, *args], check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    if check is not None:
        assert r.returncode == check, r.stdout + r.stderr
    return r


def _assert_clean(outputs: list[str], folder: Path):
    for text in outputs:
        assert SECRET not in text and TOKEN not in text, text
    for f in folder.rglob("*"):
        if f.is_file():
            data = f.read_bytes()
            assert SECRET.encode() not in data and TOKEN.encode() not in data, f


@pytest.mark.slow
def test_planted_key_reaches_no_output_of_a_run(tmp_path, vllm_cpu_stub):
    recipe = str(ROOT / "recipes/tiny-cpu.yaml")
    key_args = f'train.extra_args=["--api-key", "{TOKEN}", "--hf-token={SECRET}"]'
    wd = tmp_path / "run"
    outputs = []
    # 1. the engine regen starts fails (verifier dir without a model): the error quotes its command
    broken = tmp_path / "not-a-model"
    broken.mkdir()
    r = _kit("regen", "-r", recipe, "--set", f"verifier.path={broken}", "--set", key_args,
             "-o", str(tmp_path / "failed" / "regen.jsonl"), cwd=tmp_path, env_extra={"DSPARK_KIT_API_KEY": SECRET}, check=1)
    assert "DSPARK_KIT_API_KEY=***" in r.stderr
    outputs += [r.stdout, r.stderr]
    # 2. a stage that records the manifest, with the key in the recipe
    r = _kit("prepare", "-r", recipe, "--set", key_args, "--set", "data.limit=4", "--set", "regen.enabled=false", "--workdir", str(wd),
             cwd=tmp_path, check=0)
    assert (wd / "manifest.json").exists()
    outputs += [r.stdout, r.stderr]
    # 3. every dry run prints its command
    for args in (["train", "--dry-run", "--set", key_args, "--workdir", str(wd)],
                 ["regen", "--dry-run"],
                 ["serve", "--role", "chat", "--dry-run", "--api-key", TOKEN],
                 ["serve", "--role", "chat", "--dry-run", "--json", "--engine", "vllm", "--api-key", TOKEN]):
        r = _kit(args[0], "-r", recipe, *args[1:], cwd=tmp_path, env_extra={"DSPARK_KIT_API_KEY": SECRET},
                 check=0)
        outputs += [r.stdout, r.stderr]
    assert any("***" in o for o in outputs)
    _assert_clean(outputs, tmp_path)


def test_serve_api_key_travels_in_env_never_argv(tiny_recipe):
    from dspark_kit.resolved import Resolved
    from dspark_kit.stages.server_plan import server_plan

    local = server_plan(Resolved(tiny_recipe, planning=True), "chat", port=8123, api_key=TOKEN)  # no build
    assert TOKEN not in " ".join(local.argv) and local.env["DSPARK_KIT_API_KEY"] == TOKEN
    assert TOKEN not in local.shell_line() and "DSPARK_KIT_API_KEY=***" in local.shell_line()


def test_manifest_fields_that_only_mention_tokens_are_kept():
    rec = redact_obj({"token_freq": "/run/prepared/token_freq.pt", "api_key": TOKEN,
                      "env": {"AWS_SECRET_ACCESS_KEY": TOKEN, "PATH": "/bin"}})
    assert rec == {"token_freq": "/run/prepared/token_freq.pt", "api_key": "***",
                   "env": {"AWS_SECRET_ACCESS_KEY": "***", "PATH": "/bin"}}
