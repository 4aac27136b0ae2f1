"""`dspark-kit import` / `export`: DSpark's own draft layout (as vLLM 0.34.0's qwen3_dspark.py, its
hf_config_override and eagle3_utils read it) <-> the speculators layout the kit trains and serves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from dspark_kit.specdec.checkpoints import trained_slots
from dspark_kit.specdec.draft_layouts import (
    LayoutError,
    export_draft,
    import_draft,
    slots,
    to_speculators,
)

QWEN3 = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 256,
         "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "rope_theta": 1000000.0}


def tensors(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"fc.weight": torch.randn(64, 192, generator=g), "hidden_norm.weight": torch.randn(64, generator=g),
            "layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=g),
            "markov_head.markov_w1.weight": torch.randn(256, 8, generator=g),
            "confidence_head.proj.weight": torch.randn(1, 72, generator=g).to(torch.bfloat16)}


def kit_checkpoint(path: Path, anchor: bool = True) -> Path:
    """Saved as the trainer saves one: speculators' DSpark config through save_pretrained."""
    from speculators.models.dspark.config import DSparkSpeculatorConfig
    from transformers import Qwen3Config

    cfg = DSparkSpeculatorConfig(
        transformer_layer_config=Qwen3Config(**{k: v for k, v in QWEN3.items() if k != "model_type"}),
        draft_vocab_size=256, block_size=4, aux_hidden_state_layer_ids=[1, 2, 3], mask_token_id=5,
        sample_from_anchor=anchor, markov_rank=8,
        speculators_config={"algorithm": "dspark", "default_proposal_method": "greedy",
                            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 4 if anchor else 3}],
                            "verifier": {"name_or_path": "/models/tiny", "architectures": ["Qwen3ForCausalLM"]}})
    cfg.save_pretrained(str(path))
    save_file(tensors(), str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def native_draft(path: Path, **over) -> Path:
    """Shaped as vLLM reads a released Qwen3 DSpark draft (no speculators keys)."""
    path.mkdir(parents=True)
    cfg = {**QWEN3, "architectures": ["DSparkDraftModel"], "block_size": 7, "target_layer_ids": [0, 1, 2],
           "mask_token_id": 9, "draft_vocab_size": 256, "markov_rank": 8, "markov_head_type": "vanilla",
           "enable_confidence_head": True, "confidence_head_with_markov": True, **over}
    (path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    save_file(tensors(1), str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("anchor", [True, False])
def test_export_then_import_is_bit_identical(tmp_path: Path, anchor):
    src = kit_checkpoint(tmp_path / "kit", anchor)
    native = export_draft(src, tmp_path / "native")
    assert native["architectures"] == ["Qwen3DSparkModel"] and native["model_type"] == "qwen3"
    assert native["target_layer_ids"] == [0, 1, 2]  # aux_hidden_state_layer_ids - 1
    assert native["sample_from_anchor"] is anchor  # explicit: the native default would be true
    import_draft(tmp_path / "native", tmp_path / "back", verifier="/elsewhere")
    for name in ("config.json", "model.safetensors", "config.py"):
        assert (tmp_path / "back" / name).read_bytes() == (src / name).read_bytes(), name


def test_import_writes_sample_from_anchor_as_trained_and_k_per_layout(tmp_path: Path):
    out = import_draft(native_draft(tmp_path / "d"), tmp_path / "i", verifier="Qwen/Qwen3-8B")
    assert out["sample_from_anchor"] is True  # absent in the native config: DSpark's runtime reads true
    assert out["aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert out["speculators_model_type"] == "dspark" and out["block_size"] == 7 and out["mask_token_id"] == 9
    assert out["speculators_config"]["verifier"]["name_or_path"] == "Qwen/Qwen3-8B"
    assert trained_slots(out) == 7  # served K=7 on block 7, as vLLM's DSpark e2e test serves these drafts
    assert (tmp_path / "i" / "model.safetensors").read_bytes() == (tmp_path / "d" / "model.safetensors").read_bytes()
    # speculators itself reads the imported config (the kit trains and evaluates through it)
    from speculators.models.dspark.config import DSparkSpeculatorConfig

    loaded = DSparkSpeculatorConfig.from_pretrained(str(tmp_path / "i"))
    assert loaded.sample_from_anchor is True and loaded.transformer_layer_config.hidden_size == 64

    bonus = import_draft(native_draft(tmp_path / "b", sample_from_anchor=False), tmp_path / "bi", verifier="v")
    assert bonus["sample_from_anchor"] is False and trained_slots(bonus) == 6


def test_k_semantics_differ_only_in_the_missing_keys_default():
    assert slots({"block_size": 7}, "native") == 7  # DSpark runtime: missing = sample from the anchor
    assert slots({"block_size": 7}, "speculators") == 6  # vLLM's speculators loader: missing = false
    for layout in ("native", "speculators"):
        assert slots({"block_size": 7, "sample_from_anchor": True}, layout) == 7
        assert slots({"block_size": 7, "sample_from_anchor": False}, layout) == 6
    assert slots({"dspark_block_size": 5}, "native") == 5


def test_dflash_config_and_dspark_keys_take_precedence_as_in_vllm(tmp_path: Path):
    cfg = json.loads((native_draft(tmp_path / "d", dflash_config={"target_layer_ids": [4, 5], "mask_token_id": 3},
                                   dspark_target_layer_ids=[7]) / "config.json").read_text())
    out = to_speculators(cfg, "v")
    assert out["aux_hidden_state_layer_ids"] == [5, 6] and out["mask_token_id"] == 3
    assert "dflash_config" not in out["transformer_layer_config"]


@pytest.mark.parametrize("over,words", [({"block_size": None}, "no block_size"),
                                        ({"mask_token_id": None}, "no mask_token_id"),
                                        ({"target_layer_ids": None}, "no target_layer_ids")])
def test_import_refuses_an_incomplete_draft_in_one_line(tmp_path: Path, over, words):
    with pytest.raises(LayoutError, match=words) as e:
        import_draft(native_draft(tmp_path / "d", **over), tmp_path / "i", verifier="v")
    assert "\n" not in str(e.value) and not (tmp_path / "i").exists()


def test_layouts_are_not_mixed_up(tmp_path: Path):
    kit = kit_checkpoint(tmp_path / "kit")
    with pytest.raises(LayoutError, match="already in the speculators layout"):
        import_draft(kit, tmp_path / "x", verifier="v")
    with pytest.raises(LayoutError, match="expected 'dspark'"):
        export_draft(native_draft(tmp_path / "d"), tmp_path / "y")
    with pytest.raises(LayoutError, match="exists"):
        export_draft(kit, tmp_path / "d")


def test_cli_round_trip(tmp_path: Path):
    from dspark_kit.cli import app

    kit = kit_checkpoint(tmp_path / "kit")
    out = CliRunner().invoke(app, ["export", str(kit), str(tmp_path / "n")])
    assert out.exit_code == 0, out.output
    assert "block 4, sample_from_anchor true: 4 draft tokens" in out.stdout
    back = CliRunner().invoke(app, ["import", str(tmp_path / "n"), str(tmp_path / "b"), "--verifier", "/v"])
    assert back.exit_code == 0, back.output
    assert (tmp_path / "b" / "config.json").read_bytes() == (kit / "config.json").read_bytes()
    again = CliRunner().invoke(app, ["import", str(tmp_path / "n"), str(tmp_path / "b"), "--verifier", "/v"])
    assert again.exit_code != 0 and "exists" in again.output


# ---- train.init_from: fine-tune an imported (or earlier) draft ------------------------------

def init_recipe(init_from: Path, **draft):
    from dspark_kit.recipe import recipe_from_dict

    return recipe_from_dict({"draft": {"block_size": 4, "num_layers": 3, **draft},
                             "hidden_states": {"target_layer_ids": [1, 2, 3]},
                             "train": {"init_from": str(init_from)}})


def train_args(recipe, tmp_path):
    from dspark_kit.stages.training.train import build_train_args

    return build_train_args(recipe, tmp_path / "run", verifier_path="/v", num_hidden_layers=4, device="cpu",
                            hidden_states_dtype="bfloat16")


def test_init_from_trains_from_the_drafts_weights_without_shaping_flags(tmp_path: Path):
    kit = kit_checkpoint(tmp_path / "kit")
    args = train_args(init_recipe(kit, attention="sliding", full_attention_indices=[0]), tmp_path)
    assert args[args.index("--from-pretrained") + 1] == str(kit)
    for flag in ("--num-layers", "--draft-arch", "--sliding-window", "--full-attention-indices"):
        assert flag not in args  # speculators refuses them beside --from-pretrained
    assert args[args.index("--block-size") + 1] == "4" and "--target-layer-ids" in args


@pytest.mark.parametrize("over,words", [({"block_size": 7}, "block_size 4 != draft.block_size 7"),
                                        ({"mask_token_id": 6}, "mask_token_id 5 != draft.mask_token_id 6")])
def test_init_from_a_draft_that_does_not_fit_is_one_line(tmp_path: Path, over, words):
    kit = kit_checkpoint(tmp_path / "kit")
    with pytest.raises(ValueError, match=words) as e:
        train_args(init_recipe(kit, **over), tmp_path)
    assert "\n" not in str(e.value) and str(e.value).startswith("train.init_from")


def test_init_from_a_native_draft_says_import_it_first(tmp_path: Path):
    with pytest.raises(ValueError, match="dspark-kit import"):
        train_args(init_recipe(native_draft(tmp_path / "d")), tmp_path)
