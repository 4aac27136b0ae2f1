"""After a stage that writes a checkpoint, the next stage resolves afresh: no decision read from the
run folder before training (K, the draft's top-k, adaptive verification, ...) outlives it.

Before: training cleared a hand-kept list of six cached names; `draft_topk`, which also reads the
checkpoint's config (its draft vocabulary), was not on it, so a run that trained and then served
with serve.draft_topk set kept the value judged against the verifier's vocabulary.
Fast: the train stage's run is replaced by what it leaves behind (a checkpoint in the run folder,
as speculators writes it), and the next stage only asks the resolver; nothing is built or started.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from dspark_kit.progress import StageDisplay
from dspark_kit.recipe.load import recipe_from_dict
from dspark_kit.resolved import Resolved, ResolveError
from dspark_kit.stages import steps
from dspark_kit.stages.pipeline import run_pipeline
from dspark_kit.stages.plan import StagePlan

VERIFIER_VOCAB, DRAFT_VOCAB, TOPK = 1000, 256, 500


def _recipe(tmp_path):
    verifier = tmp_path / "verifier"
    verifier.mkdir()
    (verifier / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": VERIFIER_VOCAB,
        "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4}))
    return recipe_from_dict({"name": "afresh", "verifier": {"path": str(verifier)}, "train": {"device": "cpu"},
                             "serve": {"engine": "vllm", "draft_topk": TOPK}})


def _trained(res, plan, reporter):
    """What the train stage leaves behind: epoch 0 and checkpoint_best, with the draft's vocabulary."""
    epoch = res.run.checkpoints / "0"
    epoch.mkdir(parents=True)
    (epoch / "config.json").write_text(json.dumps({"speculators_model_type": "dspark", "draft_vocab_size": DRAFT_VOCAB,
                                                   "block_size": 4}))
    (epoch / "model.safetensors").write_bytes(b"")
    (res.run.checkpoints / "checkpoint_best").symlink_to("0")
    return {"accept_len_epoch": None}


def test_the_stage_after_training_judges_top_k_against_the_trained_draft(tmp_path, monkeypatch):
    res = Resolved(_recipe(tmp_path), tmp_path / "run", installed={"vllm": "0.28.0"})
    before = res.draft_topk  # asked before training (a plan shown first): the verifier's vocabulary
    assert before.value == TOPK and "0.28.0" in before.source
    seen: list = []

    def serve_plan(res_of_stage):
        try:
            seen.append(res_of_stage.draft_topk)
        except ResolveError as e:
            seen.append(str(e))
        return StagePlan("serve", [], decisions={})

    monkeypatch.setitem(steps.REGISTRY, "train", replace(steps.REGISTRY["train"], run=_trained,
                                                         plan=lambda r: StagePlan("train", [], decisions={})))
    monkeypatch.setitem(steps.REGISTRY, "serve", replace(steps.REGISTRY["serve"], plan=serve_plan,
                                                         run=lambda r, plan, reporter: {"engine": r.engine}))
    with StageDisplay(verbose=True) as display:
        run_pipeline(res, ["train", "serve"], display=display)
    assert len(seen) == 1
    assert isinstance(seen[0], str), f"serve was planned with the pre-training top-k: {seen[0]}"
    assert f"serve.draft_topk {TOPK}: outside 1..{DRAFT_VOCAB}" in seen[0]
    assert "draft_vocab_size" in seen[0]


def test_a_fresh_resolution_keeps_the_commands_choices(tmp_path):
    res = Resolved(_recipe(tmp_path), tmp_path / "run", engine="vllm", checkpoint="latest", window="off",
                   eval_device="cpu", installed={"vllm": "0.28.0"})
    again = res.afresh()
    assert again is not res and again.recipe is res.recipe and again.run.root == res.run.root
    assert (again.engine, again.checkpoint_choice, again.window_choice, again.eval_device_choice, again.planning) == (
        "vllm", "latest", "off", "cpu", False)
    assert again.installed_version() == "0.28.0"
    with pytest.raises(AttributeError):
        res.checkpoints_changed  # noqa: B018 - the hand-kept list is gone
