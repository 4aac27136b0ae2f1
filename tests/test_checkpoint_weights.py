"""The checks vLLM 0.34.0's DSpark model dropped (a bad draft now loads silently there), made by the
kit on every release: each fault planted in an otherwise good checkpoint is refused in one line
naming the fix; and a checkpoint without sample_from_anchor is refused by the CUDA and Ascend
recipes' dry runs on a machine without vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_checkpoints import recipe, write_ckpt
from typer.testing import CliRunner

from dspark_kit.compat.versions import installed
from dspark_kit.specdec.checkpoints import errors, validate_checkpoint

REPO = Path(__file__).resolve().parents[1]
BODY = {"fc.weight": torch.zeros(4, 4), "markov_head.markov_w1.weight": torch.ones(8, 2)}
HEAD = {"confidence_head.proj.weight": torch.zeros(1, 4), "confidence_head.proj.bias": torch.zeros(1)}
DRAFT_HEAD = {"lm_head.weight": torch.zeros(100, 4), "d2t": torch.zeros(100, dtype=torch.long)}


def ckpt(tmp_path: Path, tensors: dict, vocab: int = 256, draft_vocab: int = 256, head: bool | None = True,
         **cfg_over) -> Path:
    path = write_ckpt(tmp_path / "ckpt", "/v", weights=False)
    cfg = json.loads((path / "config.json").read_text())
    cfg |= {"draft_vocab_size": draft_vocab, "transformer_layer_config": {"vocab_size": vocab}, **cfg_over}
    if head is not None:
        cfg["enable_confidence_head"] = head
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def judged(path: Path, target_vocab: int | None = 256) -> list:
    return errors(validate_checkpoint(path, recipe(), 4, "/v", 8, target_vocab))


def test_a_good_draft_has_no_weight_findings(tmp_path: Path):
    assert judged(ckpt(tmp_path, BODY | HEAD)) == []
    reduced = ckpt(tmp_path, BODY | HEAD | DRAFT_HEAD, draft_vocab=100)
    assert judged(reduced) == []


@pytest.mark.parametrize("tensors,missing", [(BODY | HEAD, "lm_head or d2t"),
                                             (BODY | HEAD | {"lm_head.weight": torch.zeros(100, 4)}, "d2t"),
                                             (BODY | HEAD | {"d2t": torch.zeros(100, dtype=torch.long)}, "lm_head")])
def test_a_reduced_vocab_draft_needs_lm_head_and_d2t(tmp_path: Path, tensors, missing):
    (bad,) = judged(ckpt(tmp_path, tensors, draft_vocab=100))
    assert bad.code == "reduced-vocab-weights" and f"has no {missing}:" in bad.message
    assert "re-save" in bad.message and "\n" not in bad.message


def test_reduced_is_judged_against_the_draft_input_vocab_when_the_verifier_is_not_here(tmp_path: Path):
    (bad,) = judged(ckpt(tmp_path, BODY | HEAD, draft_vocab=100), target_vocab=None)
    assert bad.code == "reduced-vocab-weights"


def test_an_expanded_vocab_draft_needs_embed_tokens(tmp_path: Path):
    path = ckpt(tmp_path, BODY | HEAD, vocab=300, draft_vocab=256)
    (bad,) = judged(path)
    assert bad.code == "expanded-vocab-weights" and "embed_tokens" in bad.message and "\n" not in bad.message
    save_file(BODY | HEAD | {"embed_tokens.weight": torch.zeros(300, 4)}, str(path / "model.safetensors"))
    assert judged(path) == []


def test_confidence_head_in_config_needs_its_weights_and_the_reverse(tmp_path: Path):
    (bad,) = judged(ckpt(tmp_path, BODY, head=True))
    assert bad.code == "confidence-head-missing" and '"enable_confidence_head": false' in bad.message
    for head in (False, None):  # vLLM reads a missing key as false
        (bad,) = judged(ckpt(tmp_path, BODY | HEAD, head=head))
        assert bad.code == "confidence-head-unused" and '"enable_confidence_head": true' in bad.message
    assert judged(ckpt(tmp_path, BODY, head=False)) == []


def test_a_missing_sample_from_anchor_is_an_error(tmp_path: Path):
    path = ckpt(tmp_path, BODY | HEAD)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["sample_from_anchor"]
    (path / "config.json").write_text(json.dumps(cfg))
    (bad,) = judged(path)
    assert bad.code == "anchor-missing" and "--sample-from-anchor true|false" in bad.message


@pytest.mark.parametrize("name,layers,mask", [("qwen3-8b-cuda.yaml", (2, 18, 33), 5),
                                              ("qwen3-30b-a3b-ultrachat-ascend.yaml", (1, 12, 23, 34, 45), 151669)])
def test_recipe_dry_runs_refuse_a_checkpoint_without_sample_from_anchor_without_vllm(tmp_path: Path, name,
                                                                                        layers, mask):
    from dspark_kit.cli import app

    assert installed("vllm") is None and installed("vllm-ascend") is None  # planning on a laptop
    r = REPO / "recipes" / name
    import yaml

    verifier = yaml.safe_load(r.read_text())["verifier"]["path"]
    path = write_ckpt(tmp_path / "ckpt", verifier, ids=layers, mask=mask)
    base = ["serve", "-r", str(r), "--role", "spec", "--dry-run", "-w", str(tmp_path / "run"),
            "--checkpoint", str(path)]
    ok = CliRunner().invoke(app, base)
    assert ok.exit_code == 0, ok.output  # the same checkpoint with the key plans
    cfg = json.loads((path / "config.json").read_text())
    del cfg["sample_from_anchor"]
    (path / "config.json").write_text(json.dumps(cfg))
    res = CliRunner().invoke(app, base)
    assert res.exit_code != 0
    assert "anchor-missing" in res.output and "--sample-from-anchor true|false" in res.output
    assert "vllm serve" not in res.stdout


def test_contract_adds_the_weight_checks_vllm_dropped(tmp_path: Path, monkeypatch):
    """`contract`: vLLM 0.34.0 loads a draft with enable_confidence_head and no head weights without a
    word (its probe reports nothing wrong), the kit's own check names it."""
    from dspark_kit.engines import vllm_contract
    from dspark_kit.resolved import Resolved
    from dspark_kit.stages.evaluation.decode_contract import contract_check

    res = Resolved(recipe(), tmp_path / "run", planning=True)
    vocab = res.verifier_config["vocab_size"]  # a full-vocabulary draft of the tiny verifier
    path = ckpt(tmp_path, BODY, vocab=vocab, draft_vocab=vocab, head=True)
    want = vllm_contract.expected_for(res.recipe, res.num_hidden_layers,
                                      res.checkpoint_config if res.checkpoint_exists else None)
    clean = {"config": {"architectures": [vllm_contract.ARCHITECTURE], "sample_from_anchor": True,
                        "dspark_bonus_anchor": False, "block_size": want.block_size,
                        "eagle_aux_hidden_state_layer_ids": want.aux_layer_ids, "mask_token_id": 5},
             "load_weights": {"missing": []}}
    monkeypatch.setattr(vllm_contract, "run_probe", lambda *a, **k: {"vllm": "0.34.0", "results": [clean]})
    (found,) = contract_check(res, [path])["checkpoints"]
    assert [f["code"] for f in found["findings"]] == ["confidence-head-missing"]
