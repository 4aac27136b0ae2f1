"""Online hidden states: training asks a real local extraction server; no hs files are made."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

TINY_RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "tiny-cpu.yaml"


@pytest.mark.slow
def test_tiny_recipe_trains_online(tmp_path, tiny_verifier):
    """With a verifier.served_name, as the seed recipe has: the extraction server must still list
    the verifier's path first, the model speculators' trainer checks /v1/models for."""
    cmd = [sys.executable, "-m", "dspark_kit", "run", str(TINY_RECIPE), "--workdir", str(tmp_path),
           "--stages", "prepare,hidden-states,train", "--json",
           "--set", "hidden_states.mode=online", "--set", "train.epochs=1", "--set", "data.limit=32",
           "--set", "regen.enabled=false", "--set", "verifier.served_name=tiny-chat"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stages = {s["stage"]: s for s in json.loads(proc.stdout)["stages"]}
    assert stages["train"]["figure"] > 1.0  # val accept_len from a real validation pass
    assert not list((tmp_path / "prepared" / "hidden_states").glob("hs_*.safetensors"))
    argv = json.loads((tmp_path / "manifest.json").read_text())["stages"]["train"]["argv"]
    assert argv[argv.index("--on-missing") + 1] == "generate"
    assert argv[argv.index("--vllm-endpoint") + 1].startswith("http://127.0.0.1:")
    train_log = (tmp_path / "logs" / "train.log").read_text()
    assert "/v1/completions" in train_log  # the trainer's dataloader really asked the server
    assert (tmp_path / "checkpoints" / "checkpoint_best" / "model.safetensors").exists()
