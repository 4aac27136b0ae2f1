"""`dspark-kit import` / `export`: DSpark's own draft layout (as vLLM 0.34.0's qwen3_dspark.py, its
hf_config_override and eagle3_utils read it) <-> the speculators layout the kit trains and serves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from dspark_kit.specdec.anchor import RECORD, anchor_layout, layout_of, served_slots
from dspark_kit.specdec.checkpoints import trained_slots
from dspark_kit.specdec.draft_layouts import (
    LayoutError,
    export_draft,
    import_draft,
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


def _write(path: Path, cfg: dict) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    save_file(tensors(1), str(path / "model.safetensors"))
    return path


# The keys each layout's published configs carry, beyond the flat Qwen3 keys (docs/CONCEPTS.md#draft-layouts):
# DeepSeek's deepseek-ai/dspark_*_block7 and SpecForge's configs/*-dspark.json carry no draft_vocab_size
# (the full vocabulary), SpecForge's no sample_from_anchor; speculators' releases are its config class
# saved whole (every field).
PUBLISHED = {
    "native": {"architectures", "block_size", "markov_rank", "mask_token_id", "target_layer_ids"},
    "specforge": {"architectures", "auto_map", "block_size", "dflash_config"},
}


def native_draft(path: Path, **over) -> Path:
    """Shaped as DeepSeek's releases (deepseek-ai/dspark_*_block7): exactly their keys."""
    return _write(path, {**QWEN3, "architectures": ["Qwen3DSparkModel"], "block_size": 7, "target_layer_ids": [0, 1, 2],
                         "mask_token_id": 9, "markov_rank": 8, **over})


SPECFORGE_BLOCK = {"mask_token_id": 9, "target_layer_ids": [0, 1, 2], "projector_type": "dspark", "markov_rank": 8,
                   "markov_head_type": "gated", "confidence_head_alpha": 1.0, "enable_confidence_head": True,
                   "confidence_head_with_markov": True}


def specforge_draft(path: Path, block: dict | None = None, **over) -> Path:
    """Shaped as SpecForge's configs/*-dspark.json: flat Qwen3 keys, a nested dflash_config, auto_map,
    and no sample_from_anchor."""
    return _write(path, {**QWEN3, "architectures": ["DSparkDraftModel"], "auto_map": {"AutoModel": "dspark.DSparkDraftModel"},
                         "block_size": 7, "dflash_config": {**SPECFORGE_BLOCK, **(block or {})}, **over})


def speculators_release(path: Path, **over) -> Path:
    """Shaped as RedHatAI's speculators DSpark releases: sliding-window layers, an explicit anchor layout."""
    layer = {**QWEN3, "architectures": ["Qwen3ForCausalLM"], "layer_types": ["sliding_attention"],
             "sliding_window": 2048, "use_sliding_window": True}
    return _write(path, {"architectures": ["DSparkDraftModel"], "speculators_model_type": "dspark",
                         "speculators_version": "0.7.0.dev108", "transformer_layer_config": layer,
                         "aux_hidden_state_layer_ids": [1, 2, 3], "block_size": 7, "mask_token_id": 9,
                         "sample_from_anchor": True, "draft_vocab_size": 256, "markov_rank": 8,
                         "markov_head_type": "vanilla", "enable_confidence_head": True,
                         "confidence_head_with_markov": True,
                         "speculators_config": {"algorithm": "dspark", "default_proposal_method": "greedy",
                                                "proposal_methods": [{"proposal_type": "greedy",
                                                                      "speculative_tokens": 7}],
                                                "verifier": {"name_or_path": "zai-org/GLM-5.3",
                                                             "architectures": ["Qwen3ForCausalLM"]}}, **over})


@pytest.mark.parametrize("layout", ["native", "sglang"])
@pytest.mark.parametrize("anchor", [True, False])
def test_export_then_import_is_bit_identical(tmp_path: Path, anchor, layout):
    src = kit_checkpoint(tmp_path / "kit", anchor)
    out = export_draft(src, tmp_path / "out", layout)
    assert layout_of(out) == layout
    assert out["architectures"] == ["Qwen3DSparkModel"] and out["model_type"] == "qwen3"
    assert out["target_layer_ids"] == [0, 1, 2]  # aux_hidden_state_layer_ids - 1
    assert out["sample_from_anchor"] is anchor  # explicit: each loader reads a missing key its own way
    if layout == "sglang":  # speculators issue 753: the DSpark keys in both blocks (and at the top)
        for block in ("dflash_config", "dspark_config"):
            assert out[block]["target_layer_ids"] == [0, 1, 2] and out[block]["block_size"] == 4
            assert out[block]["mask_token_id"] == 5 and out[block]["markov_rank"] == 8
        assert "transformer_layer_config" not in out and out["hidden_size"] == 64  # flattened
    import_draft(tmp_path / "out", tmp_path / "back", verifier="/elsewhere")
    for name in ("config.json", "model.safetensors", "config.py"):
        assert (tmp_path / "back" / name).read_bytes() == (src / name).read_bytes(), name


def test_each_layout_is_recognized_by_its_own_markers(tmp_path: Path):
    read = {name: json.loads((make(tmp_path / name) / "config.json").read_text())
            for name, make in (("native", native_draft), ("specforge", specforge_draft),
                               ("speculators", speculators_release))}
    assert {name: layout_of(cfg) for name, cfg in read.items()} == {n: n for n in read}
    assert layout_of({"architectures": ["DSparkDraftModel"], "auto_map": {"AutoModel": "dspark.DSparkDraftModel"}}) \
        == "specforge"  # auto_map alone marks it too
    assert layout_of({"architectures": ["LlamaForCausalLM"]}) is None


def test_import_keeps_every_key_each_layout_carries(tmp_path: Path):
    from speculators.models.dspark.config import DSparkSpeculatorConfig

    for name, make in (("native", native_draft), ("specforge", specforge_draft), ("speculators", speculators_release)):
        original = json.loads((make(tmp_path / name) / "config.json").read_text())
        out, report = import_draft(tmp_path / name, tmp_path / f"{name}-in", verifier="/v", sample_from_anchor=True)
        assert report["layout"] == name and report["notes"] == []
        assert out[RECORD]["config"] == original and out[RECORD]["layout"] == name  # every key, as released
        assert out["aux_hidden_state_layer_ids"] == [1, 2, 3] and out["block_size"] == 7 and out["mask_token_id"] == 9
        assert out["speculators_config"]["verifier"]["name_or_path"] == "/v"
        loaded = DSparkSpeculatorConfig.from_pretrained(str(tmp_path / f"{name}-in"))  # what the kit trains through
        assert loaded.sample_from_anchor is True and loaded.markov_rank == 8
        assert loaded.enable_confidence_head is True and loaded.confidence_head_with_markov is True
        if name == "specforge":  # the Markov and confidence keys come from the nested dflash_config
            assert loaded.markov_head_type == "gated"
            assert "dflash_config" not in out["transformer_layer_config"]
        if name == "speculators":  # the release's sliding-window layers stay as they were
            layer = out["transformer_layer_config"]
            assert layer["layer_types"] == ["sliding_attention"] and layer["sliding_window"] == 2048
            assert loaded.transformer_layer_config.sliding_window == 2048
        assert (tmp_path / f"{name}-in" / "model.safetensors").read_bytes() == \
            (tmp_path / name / "model.safetensors").read_bytes()


def test_published_key_sets_import_with_the_full_vocabulary(tmp_path: Path):
    """Each layout built with exactly its published keys: no draft_vocab_size means the full vocabulary,
    as SpecForge trains (speculators' own default, 32,000 rows, broke SpecForge's drafts on today's main)."""
    from speculators.models.dspark.config import DSparkSpeculatorConfig

    for name, make in (("native", native_draft), ("specforge", specforge_draft)):
        src = make(tmp_path / name)
        cfg = json.loads((src / "config.json").read_text())
        assert set(cfg) - set(QWEN3) == PUBLISHED[name] and "draft_vocab_size" not in cfg
        out, _ = import_draft(src, tmp_path / f"{name}-in", verifier="/v", sample_from_anchor=True)
        assert out["draft_vocab_size"] == QWEN3["vocab_size"]
        assert DSparkSpeculatorConfig.from_pretrained(str(tmp_path / f"{name}-in")).draft_vocab_size == 256


def test_a_load_failure_while_measuring_is_one_line(tmp_path: Path):
    def measure(_dirs):
        raise RuntimeError("Error(s) in loading state_dict for DSparkDraft:\n\tsize mismatch for markov_w1\n...")

    with pytest.raises(LayoutError) as e:
        import_draft(specforge_draft(tmp_path / "sf"), tmp_path / "in", verifier="/v", measure=measure)
    assert "\n" not in str(e.value) and "does not load as its config.json describes it" in str(e.value)
    assert "size mismatch" not in str(e.value) and not (tmp_path / "in").exists()


def test_a_field_the_kit_does_not_read_is_one_line_naming_it(tmp_path: Path):
    src = specforge_draft(tmp_path / "d", block={"novel_knob": 3}, layer_scale_init=0.5)
    out, report = import_draft(src, tmp_path / "i", verifier="v", sample_from_anchor=False)
    assert len(report["notes"]) == 2 and all("\n" not in n for n in report["notes"])
    assert "config field dflash_config.novel_knob" in report["notes"][1]
    assert "config field layer_scale_init" in report["notes"][0]
    assert out[RECORD]["config"]["dflash_config"]["novel_knob"] == 3  # kept, not dropped


def test_a_specforge_draft_without_its_anchor_layout_needs_a_verifier_or_the_flag(tmp_path: Path):
    src = specforge_draft(tmp_path / "d")
    with pytest.raises(LayoutError, match="--sample-from-anchor true\\|false") as e:
        import_draft(src, tmp_path / "i", verifier="Qwen/Qwen3-8B")
    assert "\n" not in str(e.value) and "no verifier is at hand" in str(e.value) and not (tmp_path / "i").exists()
    out, report = import_draft(src, tmp_path / "i", verifier="v", sample_from_anchor=False)
    assert out["sample_from_anchor"] is False and trained_slots(out) == 6  # the bonus anchor: B - 1
    assert report["anchor"] == {"value": False, "source": "forced (--sample-from-anchor)"}


def test_the_measured_layout_is_the_one_that_accepts_more(tmp_path: Path):
    """The decision over the measurement (the measurement itself, on a trained draft: test_draft_layouts_trained.py)."""
    seen = {}

    def measure(dirs):
        seen.update({v: json.loads((d / "config.json").read_text()) for v, d in dirs.items()})
        return {"true": 1.02, "false": 3.5}

    out, report = import_draft(specforge_draft(tmp_path / "d"), tmp_path / "i", verifier="v", measure=measure)
    assert seen[True]["sample_from_anchor"] is True and seen[False]["sample_from_anchor"] is False
    assert out["sample_from_anchor"] is False and report["anchor"]["source"] == "measured"
    assert out[RECORD]["anchor"]["acceptance"] == {"true": 1.02, "false": 3.5}
    assert anchor_layout(out).problem() is None
    # forced the other way: written as told, and refused (one line) where it would be served
    forced, _ = import_draft(tmp_path / "d", tmp_path / "f", verifier="v", sample_from_anchor=True, measure=measure)
    problem = anchor_layout(forced).problem()
    assert forced["sample_from_anchor"] is True and "\n" not in problem
    assert "measured acceptance 1.020 with it and 3.500 with false" in problem


def test_anchor_layout_per_layout_and_a_missing_key():
    assert served_slots({"block_size": 7}, "native") == 7  # vLLM's DSpark runtime: missing = true
    assert served_slots({"block_size": 7}, "speculators") == 6  # its speculators loader: missing = false
    assert anchor_layout({"block_size": 7}, "native").slots == 7  # DeepSeek's layout: anchor-first by definition
    for layout in ("speculators", "specforge", "sglang"):
        assert anchor_layout({"block_size": 7}, layout).slots is None  # trained layout unknown: no guess
    for layout in ("native", "speculators", "specforge", "sglang"):
        assert anchor_layout({"block_size": 7, "sample_from_anchor": True}, layout).slots == 7
        assert anchor_layout({"block_size": 7, "sample_from_anchor": False}, layout).slots == 6
    assert anchor_layout({"dspark_block_size": 5, "sample_from_anchor": True}).slots == 5
    assert anchor_layout({"dflash_config": {"block_size": 5}, "sample_from_anchor": False}).slots == 4


def test_dflash_config_and_dspark_keys_take_precedence_as_in_vllm(tmp_path: Path):
    cfg = json.loads((native_draft(tmp_path / "d", dflash_config={"target_layer_ids": [4, 5], "mask_token_id": 3},
                                   dspark_target_layer_ids=[7]) / "config.json").read_text())
    out = to_speculators(cfg, "v", sample_from_anchor=True)
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
    import_draft(speculators_release(tmp_path / "r"), tmp_path / "once", verifier="v")
    with pytest.raises(LayoutError, match="already imported"):
        import_draft(tmp_path / "once", tmp_path / "twice", verifier="v")
    with pytest.raises(LayoutError, match="expected 'dspark'"):
        export_draft(native_draft(tmp_path / "d"), tmp_path / "y")
    with pytest.raises(LayoutError, match="exists"):
        export_draft(kit, tmp_path / "d")
    with pytest.raises(LayoutError, match="one of native, sglang"):
        export_draft(kit, tmp_path / "z", "specforge")


def test_cli_round_trip(tmp_path: Path):
    from dspark_kit.cli import app

    kit = kit_checkpoint(tmp_path / "kit")
    for layout in ("native", "sglang"):
        out = CliRunner().invoke(app, ["export", str(kit), str(tmp_path / layout), "--layout", layout])
        assert out.exit_code == 0, out.output
        assert f"({layout} layout): block 4, sample_from_anchor true: 4 draft tokens" in out.stdout
        back = CliRunner().invoke(app, ["import", str(tmp_path / layout), str(tmp_path / f"b-{layout}"),
                                        "--verifier", "/v"])
        assert back.exit_code == 0, back.output
        assert (tmp_path / f"b-{layout}" / "config.json").read_bytes() == (kit / "config.json").read_bytes()
    again = CliRunner().invoke(app, ["import", str(tmp_path / "native"), str(tmp_path / "b-native"), "--verifier", "/v"])
    assert again.exit_code != 0 and "exists" in again.output
    sf = specforge_draft(tmp_path / "sf")
    refused = CliRunner().invoke(app, ["import", str(sf), str(tmp_path / "sfi"), "--verifier", "Qwen/Qwen3-8B"])
    assert refused.exit_code != 0 and "--sample-from-anchor" in refused.output
    told = CliRunner().invoke(app, ["import", str(sf), str(tmp_path / "sfi"), "--verifier", "Qwen/Qwen3-8B",
                                    "--sample-from-anchor", "false"])
    assert told.exit_code == 0, told.output
    assert "(specforge layout)" in told.stdout and "sample_from_anchor false: 6 draft tokens" in told.stdout


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


def test_init_from_a_reduced_vocabulary_draft_keeps_its_own_token_mapping(tmp_path: Path):
    """speculators' --from-pretrained replaces the draft's d2t/t2d with the data's (built from the new
    rows' token counts) after loading its weights, so its lm_head rows would stand for other tokens:
    the kit passes the draft's own mapping, which run() writes from its weights."""
    import numpy as np
    import torch
    from speculators.train.cli import parse_vocab_mappings

    from dspark_kit.rundir import RunDir
    from dspark_kit.specdec.checkpoints import write_init_vocab

    kit = kit_checkpoint(tmp_path / "kit")
    d2t = torch.tensor([3, 0, 7, 1], dtype=torch.int64)  # draft row -> target id offset, as speculators saves
    t2d = torch.zeros(300, dtype=torch.bool)
    t2d[[0, 3, 7, 11]] = True
    save_file({**tensors(), "d2t": d2t, "t2d": t2d}, str(kit / "model.safetensors"), metadata={"format": "pt"})
    args = train_args(init_recipe(kit), tmp_path)
    vocab = RunDir.at(tmp_path / "run").init_vocab
    assert args[args.index("--d2t-path") + 1] == str(vocab / "d2t.npy")
    assert args[args.index("--t2d-path") + 1] == str(vocab / "t2d.npy")
    write_init_vocab(kit, vocab)
    assert np.array_equal(np.load(vocab / "d2t.npy"), d2t.numpy()) and np.load(vocab / "t2d.npy").dtype == bool

    class Args:  # what speculators' CLI reads these files with: its own loader, not the data's cache
        d2t_path, t2d_path, draft_vocab_size = str(vocab / "d2t.npy"), str(vocab / "t2d.npy"), 4
        data_path = str(tmp_path / "no-data")
    got_d2t, got_t2d, size = parse_vocab_mappings(Args)
    assert size == 4 and got_d2t.equal(d2t) and got_t2d.equal(t2d)
    with pytest.raises(ValueError, match=r"its draft vocabulary has 256 tokens != draft.draft_vocab_size 128; "
                                         r"set draft.draft_vocab_size: 256"):
        train_args(init_recipe(kit, draft_vocab_size=128), tmp_path)
    assert "--d2t-path" not in train_args(init_recipe(kit_checkpoint(tmp_path / "full")), tmp_path)  # none in weights


def test_init_from_a_native_draft_says_import_it_first(tmp_path: Path):
    with pytest.raises(ValueError, match="dspark-kit import"):
        train_args(init_recipe(native_draft(tmp_path / "d")), tmp_path)


@pytest.mark.parametrize("make", [native_draft, specforge_draft, speculators_release])
def test_init_from_fine_tunes_an_imported_draft_of_each_layout_in_its_layout(tmp_path: Path, make):
    """The imported draft is what speculators' --from-pretrained loads; its anchor layout and the import's
    record are in the config the trainer saves each epoch (speculators' config round trip)."""
    from speculators.models.dspark.config import DSparkSpeculatorConfig

    imported = tmp_path / "imported"
    import_draft(make(tmp_path / "d", block_size=4), imported, verifier="/v", sample_from_anchor=False)
    args = train_args(init_recipe(imported, mask_token_id=9), tmp_path)
    assert args[args.index("--from-pretrained") + 1] == str(imported)
    DSparkSpeculatorConfig.from_pretrained(str(imported)).save_pretrained(str(tmp_path / "epoch0"))
    saved = json.loads((tmp_path / "epoch0" / "config.json").read_text())
    assert saved["sample_from_anchor"] is False and trained_slots(saved) == 3
    assert saved[RECORD]["layout"] == layout_of(json.loads((tmp_path / "d" / "config.json").read_text()))


def test_an_unknown_verifiers_architectures_are_left_empty_not_guessed(tmp_path: Path):
    """A hub id with no config.json here: the speculators record says nothing of the verifier's
    architecture (speculators' own default), instead of naming a Qwen3 for a Llama or gpt-oss."""
    out, _ = import_draft(native_draft(tmp_path / "ds"), tmp_path / "in", verifier="meta-llama/Llama-3.1-8B-Instruct",
                          sample_from_anchor=True)
    assert out["speculators_config"]["verifier"] == {"name_or_path": "meta-llama/Llama-3.1-8B-Instruct",
                                                     "architectures": []}
    named, _ = import_draft(native_draft(tmp_path / "ds2"), tmp_path / "in2", verifier="/v",
                            verifier_architectures=["LlamaForCausalLM"], sample_from_anchor=True)
    assert named["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
