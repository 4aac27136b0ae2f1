"""An honest memory plan for the verifier's vLLM server (specdec/verifier_memory.py, resolved/memory_plan.py):
its weights per device under TP and the config's declared quantization, the KV cache its attention
really keeps (MLA's latent, head_dim when given, hybrid layers), and a runtime margin, against
serve.gpu_memory_utilization of the device. Published configs are test fixtures written from their
published values (tests/fixtures/configs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from dspark_kit.cli import app
from dspark_kit.recipe import load_recipe
from dspark_kit.resolved import Resolved
from dspark_kit.resolved.memory_plan import GIB
from tests.test_init import QWEN3_0_6B, TOKENIZER_FIXTURE, verifier_dir

CONFIGS = Path(__file__).resolve().parent / "fixtures" / "configs"
DSV3 = json.loads((CONFIGS / "deepseek_v3.json").read_text())
GEMMA3 = json.loads((CONFIGS / "gemma3_4b_it.json").read_text())


def test_deepseek_v3_on_eight_141_gib_devices_is_refused_at_init_with_the_arithmetic(tmp_path, monkeypatch):
    """init splits 8 devices 4 + 4 (extraction server at TP 4): 671B parameters in fp8 are 157.5 GiB per
    device, over 0.9 x 141 GiB; today's main printed 'fits'. The fixes weigh TP 8 and offline extraction."""
    monkeypatch.chdir(tmp_path)
    folder = verifier_dir(tmp_path / "dsv3", TOKENIZER_FIXTURE, DSV3)
    out = tmp_path / "r.yaml"
    r = CliRunner().invoke(app, ["init", "--verifier", str(folder), "-o", str(out), "--target-device", "cuda",
                                 "--num-devices", "8", "--device-memory-gib", "141"])
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and not out.exists(), r.output
    line = lines[0]
    for needle in ("server-memory", "TP 4", "671,025,397,760 parameters, every expert", "verifier weights 157.5 GiB",
                   "fp8 1 B + a float32 scale per 128x128 block", "MLA latent (512 + rope 64)",
                   "126.9 GiB (serve.gpu_memory_utilization 0.9 x 141.0 GiB)",
                   "serve.tensor_parallel_size 8 (8 devices:", "hidden_states.mode offline"):
        assert needle in line, (needle, line)


def _recipe(tmp_path: Path, folder: Path, **serve) -> Resolved:
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({
        "verifier": {"path": str(folder)}, "train": {"device": "cuda", "device_memory_gib": 141, "nproc": 1},
        "hidden_states": {"mode": "offline", "backend": "vllm"},
        "serve": {"engine": "vllm", "max_model_len": 8192, **serve}}))
    return Resolved(load_recipe(path), tmp_path / "run", planning=True)


def test_deepseek_v3_at_tp8_fits_with_fp8_counted_as_fp8(tmp_path):
    from dspark_kit.stages.preflight.memory import memory_findings

    folder = verifier_dir(tmp_path / "dsv3", TOKENIZER_FIXTURE, DSV3)
    res = _recipe(tmp_path, folder, tensor_parallel_size=8)
    server = res.memory_plan.server
    weights = {t.name: t.bytes for t in server.terms}
    assert weights["verifier weights"] / GIB == pytest.approx(79.3, abs=0.1)
    assert weights["KV cache"] == 8192 * 61 * (512 + 64) * 2  # one sequence of the MLA latent, bf16
    assert server.fits and not [f for f in memory_findings(res) if f.code == "server-memory"]
    tp4 = _recipe(tmp_path, folder, tensor_parallel_size=4)
    assert not tp4.memory_plan.server.fits
    assert [f.code for f in memory_findings(tp4)] == ["server-memory"]


def test_the_declared_quantization_sets_the_bytes_per_weight():
    from dspark_kit.specdec.verifier_memory import weight_parts

    fp8, _ = weight_parts(DSV3, "bfloat16", 8)
    bf16, _ = weight_parts({k: v for k, v in DSV3.items() if k != "quantization_config"}, "bfloat16", 8)
    assert bf16 / fp8 == pytest.approx(2, rel=0.01)
    _, lines = weight_parts({**QWEN3_0_6B, "quantization_config": {"quant_method": "awq", "bits": 4}}, "bfloat16", 1)
    assert "awq 4 bits" in lines[-1]


def test_kv_reads_mla_head_dim_and_hybrid_layers():
    from dspark_kit.specdec.verifier_memory import kv_per_token, server_parts

    assert kv_per_token(DSV3, "bfloat16", 4, 8192)[0] == 61 * 576 * 2  # MLA, not 128 heads x 56
    # head_dim given (16 heads of 128 on hidden 1024): 28 layers x k,v x 8 kv heads x 128 x 2 B
    assert kv_per_token(QWEN3_0_6B, "bfloat16", 1, 4096)[0] == 28 * 2 * 8 * 128 * 2
    assert kv_per_token(QWEN3_0_6B, "bfloat16", 16, 4096)[0] == 28 * 2 * 1 * 128 * 2  # kv heads replicated
    hybrid = {**QWEN3_0_6B, "num_hidden_layers": 8, "layer_types": ["linear_attention"] * 3 + ["full_attention"]
              + ["linear_attention"] * 3 + ["full_attention"]}
    per, how = kv_per_token(hybrid, "bfloat16", 1, 4096)
    assert per == 2 * 2 * 8 * 128 * 2 and "6 linear-attention layers" in how
    parts = {p.name: p.bytes for p in server_parts(DSV3, "bfloat16", 8, 8192, 1, "cuda")}
    assert set(parts) == {"verifier weights", "KV cache", "runtime margin"} and parts["runtime margin"] > GIB


def test_gemma3_published_config_goes_through_init_and_preflight(tmp_path, monkeypatch):
    """Nested text_config with no vocab_size, num_attention_heads or head_dim: read as transformers
    reads them (Gemma3TextConfig's defaults: 262,208 rows, 8 heads of 256 on hidden 2560)."""
    from dspark_kit.specdec.verifier_facts import language_model_config
    from dspark_kit.stages.preflight.checks import run_preflight

    lm = language_model_config(GEMMA3)
    assert (lm["vocab_size"], lm["num_attention_heads"], lm["head_dim"], lm["hidden_size"]) == (262208, 8, 256, 2560)
    monkeypatch.chdir(tmp_path)
    folder = verifier_dir(tmp_path / "gemma3", TOKENIZER_FIXTURE, GEMMA3)
    out = tmp_path / "g.yaml"
    r = CliRunner().invoke(app, ["init", "--verifier", str(folder), "-o", str(out), "--target-device", "cuda",
                                 "--num-devices", "2", "--device-memory-gib", "80"])
    assert r.exit_code == 0, r.output
    assert "8 heads x 256" in r.output and "draft vocab 262,208" in r.output, r.output
    # tied embedding (the class's default) and the vision tower vLLM loads beside it: 3.9B + 0.4B, the
    # published "4B" model's 4.3B
    assert "3,879,895,040 parameters" in r.output and "vision tower ~411,070,464" in r.output, r.output
    res = Resolved(load_recipe(out, require_run_keys=True), tmp_path / "run", planning=True)
    errors = [f for f in run_preflight(res, probes=False) if f.level == "error"]
    assert errors == [], errors
    assert res.memory_plan.server.fits
