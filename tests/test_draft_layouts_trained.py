"""The published draft layouts end to end, on the session's trained tiny draft: written in each
layout (DeepSeek's, speculators', SpecForge's, and SGLang's export), imported back, and evaluated;
a SpecForge draft's anchor layout measured on import; the other layout forced is refused at
preflight. The layout-only cases (every key, notes, round trips) are tests/test_draft_layouts.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import TINY_RECIPE, TRAINED_RUN_SETS
from typer.testing import CliRunner

from dspark_kit.recipe import load_recipe
from dspark_kit.resolved import Resolved
from dspark_kit.specdec.anchor import RECORD, layout_of
from dspark_kit.specdec.checkpoints import resolve_checkpoint
from dspark_kit.specdec.draft_layouts import export_draft, import_draft

pytestmark = pytest.mark.slow

# the DSpark keys SpecForge nests in dflash_config (and leaves sample_from_anchor out)
NESTED = ("mask_token_id", "target_layer_ids", "markov_rank", "markov_head_type", "enable_confidence_head",
          "confidence_head_with_markov")


def as_specforge(native_dir: Path, dest: Path) -> Path:
    """A kit export rewritten with exactly the keys SpecForge's configs/*-dspark.json carry: DSparkDraftModel,
    auto_map, the flat Qwen3 keys and block_size, the DSpark keys in a dflash_config with projector_type
    dspark; no sample_from_anchor, no draft_vocab_size (the full vocabulary), no target_hidden_size."""
    from transformers import Qwen3Config

    from tests.test_draft_layouts import PUBLISHED

    native = json.loads((native_dir / "config.json").read_text())
    assert native["draft_vocab_size"] == native["vocab_size"]  # the kit's tiny draft: the full vocabulary
    qwen3 = set(Qwen3Config().to_dict()) - {"architectures"}
    cfg = {k: v for k, v in native.items() if k in qwen3}
    cfg |= {"architectures": ["DSparkDraftModel"], "auto_map": {"AutoModel": "dspark.DSparkDraftModel"},
            "block_size": native["block_size"],
            "dflash_config": {**{k: native[k] for k in NESTED}, "projector_type": "dspark",
                              "confidence_head_alpha": 1.0}}
    assert set(cfg) - qwen3 == PUBLISHED["specforge"], set(cfg) - qwen3
    dest.mkdir(parents=True)
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    shutil.copyfile(native_dir / "model.safetensors", dest / "model.safetensors")
    return dest


@pytest.fixture(scope="module")
def setup(trained_run, tmp_path_factory):
    res = Resolved(load_recipe(TINY_RECIPE, [*TRAINED_RUN_SETS, "regen.enabled=false"]), trained_run)
    ckpt = resolve_checkpoint(res.run.checkpoints)
    d = tmp_path_factory.mktemp("layouts")
    released = {"native": export_draft(ckpt, d / "native") and d / "native",
                "sglang": export_draft(ckpt, d / "sglang", "sglang") and d / "sglang",
                "speculators": ckpt}
    released["specforge"] = as_specforge(d / "native", d / "specforge")
    from dspark_kit.data.tiny_corpus import write_eval_prompts

    prompts = write_eval_prompts(d / "prompts.jsonl", n=4)
    return res, ckpt, released, prompts, d


def eval_figures(res: Resolved, ckpt: Path, out: Path) -> dict:
    from dspark_kit.stages.evaluation.evaluate import evaluate_checkpoint

    r = Resolved(res.recipe, res.run.root, checkpoint=str(ckpt))
    s = evaluate_checkpoint(r, num_prompts=3, max_new_tokens=24, categories=[], out_dir=out)
    return {k: s[k] for k in ("acceptance_length", "acceptance_rate", "per_position_acceptance", "num_drafts",
                              "num_speculative_tokens")}


def test_each_layout_imported_evaluates_as_the_original_to_the_digit(setup):
    from dspark_kit.specdec.anchor_measure import measure_layouts, read_chats

    res, ckpt, released, prompts, d = setup
    original = eval_figures(res, ckpt, d / "eval-original")
    assert original["acceptance_length"] > 1.5  # a draft that drafts: the comparison means something
    chats = read_chats(prompts)
    for layout, src in released.items():
        assert layout_of(json.loads((src / "config.json").read_text())) == layout
        dest = d / f"imported-{layout}"
        out, report = import_draft(src, dest, res.verifier_path,
                                   measure=lambda dirs: measure_layouts(dirs, res.verifier_path, chats))
        assert report["layout"] == layout and report["notes"] == [], report
        assert out["sample_from_anchor"] is True  # as trained (SpecForge's: measured, below)
        assert (dest / "model.safetensors").read_bytes() == (ckpt / "model.safetensors").read_bytes()
        assert eval_figures(res, dest, d / f"eval-{layout}") == original, layout


def test_a_specforge_draft_is_imported_in_the_measured_layout_and_the_other_is_refused(setup):
    from dspark_kit.cli import app

    res, _, released, prompts, d = setup
    src = released["specforge"]
    run = CliRunner().invoke(app, ["import", str(src), str(d / "sf-measured"), "--verifier", res.verifier_path,
                                   "--prompts", str(prompts)])
    assert run.exit_code == 0, run.output
    measured = json.loads((d / "sf-measured" / "config.json").read_text())[RECORD]["anchor"]
    true, false = measured["acceptance"]["true"], measured["acceptance"]["false"]
    assert measured["source"] == "measured" and measured["value"] is True and true > false  # trained true
    assert f"acceptance length {true:.3f} with sample_from_anchor true, {false:.3f} with false" in run.stdout
    assert res.checkpoint_findings(d / "sf-measured") == []

    forced = CliRunner().invoke(app, ["import", str(src), str(d / "sf-forced"), "--verifier", res.verifier_path,
                                      "--prompts", str(prompts), "--sample-from-anchor", "false"])
    assert forced.exit_code == 0, forced.output
    assert "was forced but accepts less" in forced.output
    (bad,) = [f for f in res.checkpoint_findings(d / "sf-forced") if f.code == "anchor-measured"]
    assert bad.level == "error" and "\n" not in bad.message
    assert f"measured acceptance {false:.3f} with it and {true:.3f} with true" in bad.message

    # no verifier at hand (a hub id, not a local path): refused in one line naming the flag
    none = CliRunner().invoke(app, ["import", str(src), str(d / "sf-none"), "--verifier", "Qwen/Qwen3-8B"])
    assert none.exit_code != 0 and "--sample-from-anchor true|false" in none.output
    assert not (d / "sf-none").exists()


def test_a_released_draft_fine_tunes_on_ones_own_rows_in_its_layout(setup):
    """train.init_from: the SpecForge draft, imported (its layout measured), fine-tuned for an epoch on
    the run's prepared rows by the real trainer; the new checkpoint keeps the layout and the import's
    record, and its weights moved."""
    from safetensors.torch import load_file

    from dspark_kit.cli import app

    res, _, released, prompts, d = setup
    imported = d / "ft-imported"
    run = CliRunner().invoke(app, ["import", str(released["specforge"]), str(imported), "--verifier",
                                   res.verifier_path, "--prompts", str(prompts)])
    assert run.exit_code == 0, run.output
    wd = d / "ft-run"
    wd.mkdir()
    shutil.copytree(res.run.root / "prepared", wd / "prepared")  # one's own rows, with their hidden states
    sets = [*TRAINED_RUN_SETS, "regen.enabled=false", "train.epochs=1", f"train.init_from={imported}"]
    train = CliRunner().invoke(app, ["train", "-r", str(TINY_RECIPE), "-w", str(wd),
                                     *(a for s in sets for a in ("--set", s))])
    assert train.exit_code == 0, train.output
    tuned = resolve_checkpoint(wd / "checkpoints")
    cfg = json.loads((tuned / "config.json").read_text())
    assert cfg["sample_from_anchor"] is True and cfg[RECORD]["layout"] == "specforge"
    assert cfg[RECORD]["anchor"]["source"] == "measured"
    before, after = load_file(str(imported / "model.safetensors")), load_file(str(tuned / "model.safetensors"))
    assert any(not before[k].equal(after[k]) for k in before if k in after), "fine-tuning changed nothing"
    assert eval_figures(Resolved(load_recipe(TINY_RECIPE, sets), wd), tuned, d / "eval-tuned")["acceptance_length"] > 1.5
