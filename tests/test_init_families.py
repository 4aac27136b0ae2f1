"""`init` on config-only folders shaped like the families' real models (their published config.json
values) with the tiny family tokenizers: each writes a recipe whose preflight passes, with the layer
ids, mask token, reasoning mode and draft architecture from the family's rules, each said where from.

Tokenizer-only (built from the corpus in under a second): no model loads."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from dspark_kit.cli import app
from dspark_kit.data import families as F
from dspark_kit.data.reasoning_formats import NONE
from dspark_kit.data.tiny_builder import DEFAULT_SPEC, build_tokenizer

# published config.json values (the keys the kit reads, and the MoE terms)
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": 48, "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
    "rope_theta": 1000000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 151643,
    "eos_token_id": 151645,
}  # fmt: skip
LLAMA_3_1_8B_INSTRUCT = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
}  # fmt: skip
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "num_hidden_layers": 24, "hidden_size": 2880,
    "intermediate_size": 2880, "num_local_experts": 32, "num_experts_per_tok": 4, "experts_per_token": 4,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 201088,
    "max_position_embeddings": 131072, "initial_context_length": 4096, "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "attention_bias": True, "swiglu_limit": 7.0,
    "rope_theta": 150000, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                           "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                           "truncate": False},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu", "rms_norm_eps": 1e-05,
    "router_aux_loss_coef": 0.9, "output_router_logits": False, "use_cache": True, "eos_token_id": 200002,
    "pad_token_id": 199999,
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
}  # fmt: skip
CASES = {"qwen3-30b-a3b": (QWEN3_30B_A3B, "qwen3-moe", [1, 12, 23, 34, 45]),
         "llama-3.1-8b-instruct": (LLAMA_3_1_8B_INSTRUCT, "llama3", [1, 8, 15, 22, 29]),
         "gpt-oss-20b": (GPT_OSS_20B, "gpt-oss", [1, 6, 11, 16, 21])}


@functools.cache
def _tokenizer_files(name: str, root: Path) -> Path:
    out = root / f"tok-{name}"
    tok = build_tokenizer(DEFAULT_SPEC, F.FAMILIES[name])
    tok.mask_token = None  # as the real models' tokenizers come: no mask token
    tok.save_pretrained(out)
    return out


# gpt-oss's 201,088-token tokenizer loads in seconds each time init and preflight read it: slow tier
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == "gpt-oss-20b" else c
                                  for c in sorted(CASES)])
def test_init_on_a_real_shaped_config_folder_writes_a_recipe_whose_preflight_passes(case, tmp_path):
    from transformers import AutoTokenizer

    from dspark_kit.recipe import load_recipe
    from dspark_kit.resolved import Resolved
    from dspark_kit.specdec.verifier_facts import param_count
    from dspark_kit.stages.preflight.checks import run_preflight

    config, family_name, layers = CASES[case]
    family = F.FAMILIES[family_name]
    verifier = tmp_path / case
    verifier.mkdir()
    for f in _tokenizer_files(family_name, tmp_path).iterdir():
        (verifier / f.name).write_bytes(f.read_bytes())
    (verifier / "config.json").write_text(json.dumps(config))
    out = tmp_path / f"{case}.yaml"
    r = CliRunner().invoke(app, ["init", "--verifier", str(verifier), "--target-device", "cuda", "-o", str(out)])
    assert r.exit_code == 0, r.output
    data = yaml.safe_load(out.read_text())
    tok = AutoTokenizer.from_pretrained(verifier)
    assert data["hidden_states"]["target_layer_ids"] == layers and str(layers) in r.output
    assert data["draft"]["arch"] == family.draft_arch
    mask = data["draft"]["mask_token_id"]
    assert 0 <= mask < config["vocab_size"] and "draft.mask_token_id" in r.output
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                                       tokenize=True, return_dict=False)
    assert mask not in rendered  # not a token the family's template writes
    assert data["verifier"]["thinking"] is (family.reasoning is not NONE) and "verifier.thinking" in r.output
    assert "memory:" in r.output and "shape from the verifier's config.json" in r.output
    # the draft layer gets the verifier's dense intermediate_size (speculators' rule), not an expert's
    assert f"intermediate {config['intermediate_size']}" in r.output
    if family.model_extra.get("num_experts"):  # every expert counted in the server's weights
        assert param_count(config) > 30e9 and f"{param_count(config):,} parameters, every expert" in r.output
    findings = run_preflight(Resolved(load_recipe(out, require_run_keys=True), tmp_path / "run"), probes=False)
    assert [f for f in findings if f.level == "error"] == [], findings


def test_init_on_the_tiny_llama3_picks_its_reserved_token_and_the_recipe_agrees(tmp_path):
    """The shipped tiny Llama-3 files (tokenizer and config only are read): a full vocabulary, so the
    mask is the first reserved special token, the id recipes/tiny-llama3-cpu.yaml pins."""
    from dspark_kit.data.tiny_verifier import shipped_dir

    out = tmp_path / "r.yaml"
    r = CliRunner().invoke(app, ["init", "--verifier", str(shipped_dir(F.LLAMA3)), "--target-device", "cpu",
                                 "-o", str(out)])
    assert r.exit_code == 0, r.output
    comment = next(ln for ln in out.read_text().splitlines() if ln.strip().startswith("mask_token_id:"))
    shipped = yaml.safe_load((Path(__file__).resolve().parent.parent / "recipes/tiny-llama3-cpu.yaml").read_text())
    assert yaml.safe_load(out.read_text())["draft"]["mask_token_id"] == shipped["draft"]["mask_token_id"]
    assert "the reserved special token <|reserved_special_token_0|>" in comment
