"""eval / tune --eval-device, and the refusal of a verifier too large for the eval device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dspark_kit.cli import app
from dspark_kit.recipe import load_recipe
from dspark_kit.resolved import Resolved, ResolveError
from dspark_kit.resolved.rules import eval_fit
from dspark_kit.specdec.verifier import param_count

RECIPE = Path(__file__).parents[1] / "recipes" / "tiny-cpu.yaml"
ASCEND = Path(__file__).parents[1] / "recipes" / "qwen3-30b-a3b-ultrachat-ascend.yaml"
# Qwen3-30B-A3B's config.json, the fields that size it
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "vocab_size": 151936,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
                 "num_experts": 128, "moe_intermediate_size": 768, "tie_word_embeddings": False}
GiB = 2**30


def test_param_count_sizes_dense_and_moe_verifiers():
    assert abs(param_count(QWEN3_30B_A3B) / 1e9 - 30.5) < 0.1  # published: 30.5B
    qwen3_0_6b = {"hidden_size": 1024, "num_hidden_layers": 28, "vocab_size": 151936, "num_attention_heads": 16,
                  "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072, "tie_word_embeddings": True}
    assert abs(param_count(qwen3_0_6b) / 1e9 - 0.6) < 0.01  # published: 0.6B
    assert param_count({"text_config": qwen3_0_6b}) == param_count(qwen3_0_6b)  # multimodal wrappers
    assert param_count(None) is None and param_count({"hidden_size": 8}) is None


def test_eval_fit_rule():
    # the case: 61 GB of bf16 weights on a 64 GB NPU leaves no room to run
    d = eval_fit(param_count(QWEN3_30B_A3B), "bfloat16", "npu", 64 * GiB, "Qwen3-30B-A3B")
    assert d.value is False and "30.5B parameters" in d.source and "64.0 GiB" in d.source
    assert eval_fit(param_count(QWEN3_30B_A3B), "bfloat16", "cuda", 141 * GiB, "x").value is True  # an H200
    assert eval_fit(None, "bfloat16", "npu", 64 * GiB, "/models/x").value is None
    assert eval_fit(10**9, "float32", "npu", None, "x").value is None


def test_device_flag_decides_eval_device_and_dtype(tmp_path):
    r = load_recipe(ASCEND)
    res = Resolved(r, tmp_path, planning=True)
    assert res.eval_device.value == "npu" and res.eval_dtype.value == "bfloat16"  # the recipe's device, bf16
    res = Resolved(r, tmp_path, planning=True, eval_device="cpu")
    assert res.eval_device.value == "cpu" and res.eval_device.source == "--eval-device"
    assert res.eval_dtype.value == "float32"
    assert Resolved(r, tmp_path, planning=True, eval_device="cuda:1").eval_dtype.value == "bfloat16"
    for bad in ("tpu", "cuda:x", "auto:0"):
        with pytest.raises(ResolveError, match="--eval-device"):
            Resolved(r, tmp_path, planning=True, eval_device=bad)


def test_too_large_verifier_is_refused_before_loading(tmp_path, monkeypatch):
    """A fake 30B config and a fake 64 GiB device: eval and tune stop in one line naming served tuning,
    and load nothing."""
    from dspark_kit import devices
    from dspark_kit.specdec import draft_model

    monkeypatch.setattr(Resolved, "verifier_config", property(lambda self: QWEN3_30B_A3B))
    monkeypatch.setattr(devices, "device_memory_bytes", lambda device: 64 * GiB)
    monkeypatch.setattr(draft_model.DSparkDraft, "load", lambda *a, **k: pytest.fail("loaded the draft"))
    monkeypatch.setattr(Resolved, "checkpoint", property(lambda self: tmp_path))
    args = ["-r", str(ASCEND), "-w", str(tmp_path), "--eval-device", "npu"]
    for cmd in (["eval"], ["tune"]):
        res = CliRunner().invoke(app, [*cmd, *args])
        assert res.exit_code == 2, res.output
        line = " ".join(res.output.split())
        assert "30.5B parameters" in line and "64.0 GiB" in line and "dspark-kit tune --served" in line, line
    res = CliRunner().invoke(app, ["eval", "-r", str(RECIPE), "-w", str(tmp_path), "--eval-device", "tpu"])
    assert res.exit_code == 2 and "--eval-device 'tpu'" in res.output


@pytest.mark.slow
def test_eval_device_cpu(own_trained_run, tmp_path):
    res = CliRunner().invoke(app, ["eval", "-r", str(RECIPE), "-w", str(own_trained_run), "--eval-device", "cpu",
                                   "--num-prompts", "2", "--max-new-tokens", "8", "--context-lengths", "",
                                   "--out", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["device"] == "cpu" and summary["dtype"] == "float32" and summary["acceptance_length"] >= 1.0
    assert json.loads((tmp_path / "eval.json").read_text())["device"] == "cpu"


def _eval_plan(recipe: Path, tmp_path: Path) -> str:
    res = CliRunner().invoke(app, ["run", str(recipe), "-w", str(tmp_path / "run"), "--dry-run", "--stages", "eval"])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    return "\n".join(lines[lines.index("# ==> eval") + 1:])


def test_run_plans_eval_where_the_verifier_fits(tmp_path, monkeypatch):
    """`run` chooses: in-process when the verifier fits the eval device, served otherwise, and says why."""
    from dspark_kit import devices

    plan = _eval_plan(RECIPE, tmp_path)  # the tiny verifier on this machine's CPU
    assert plan.startswith("# in-process: offline acceptance on cpu (float32)") and "fits cpu" in plan
    # the seed's recipe planned on a laptop: no config, no NPU here -> decided when it runs
    plan = _eval_plan(ASCEND, tmp_path)
    assert plan.startswith("# decided when it runs") and "verifier size unknown" in plan and "vllm serve" in plan
    # where it runs: 30.5B in bf16 on a 64 GiB NPU -> served, through the recipe's engine
    monkeypatch.setattr(Resolved, "verifier_config", property(lambda self: QWEN3_30B_A3B))
    monkeypatch.setattr(devices, "device_memory_bytes", lambda device: 64 * GiB)
    plan = _eval_plan(ASCEND, tmp_path)
    assert plan.startswith("# served: acceptance through the vllm-ascend engine"), plan
    assert "does not fit npu" in plan and "30.5B parameters" in plan and "--speculative-config" in plan
