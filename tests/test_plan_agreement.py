"""Preflight and the dry runs apply the same rules: a planted mistake is refused by both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dspark_kit.cli import app

CUDA = Path(__file__).resolve().parents[1] / "recipes" / "qwen3-8b-cuda.yaml"  # verifier.num_hidden_layers 36


def trained_checkpoint(workdir: Path) -> None:
    """A checkpoint as speculators saves it (block 8, 8 trained slots), for the recipe's verifier."""
    import torch
    from safetensors.torch import save_file

    ckpt = workdir / "checkpoints" / "0"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text(json.dumps({
        "speculators_model_type": "dspark", "block_size": 8, "mask_token_id": 151669, "sample_from_anchor": True,
        "aux_hidden_state_layer_ids": [2, 18, 33],
        "speculators_config": {"verifier": {"name_or_path": "Qwen/Qwen3-8B"},
                               "proposal_methods": [{"speculative_tokens": 8}]}}))
    save_file({"w": torch.zeros(1)}, str(ckpt / "model.safetensors"))
    (workdir / "checkpoints" / "checkpoint_best").symlink_to("0")


MISTAKES = {
    "layer id out of range": (["hidden_states.target_layer_ids=[2,18,40]"], ["train", "--dry-run"]),
    "K above the slots": (["serve.num_speculative_tokens=9", "draft.block_size=12"],
                          ["serve", "--role", "spec", "--dry-run"]),
    "window below a KV block": (["serve.engine=vllm-ascend", "serve.draft_window_size=64",
                                 "serve.assume_window_support=true"], ["serve", "--role", "spec", "--dry-run"]),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_preflight_and_the_dry_run_refuse_the_same_mistake(mistake, tmp_path):
    sets, command = MISTAKES[mistake]
    trained_checkpoint(tmp_path)
    common = ["-r", str(CUDA), "-w", str(tmp_path), *(a for s in sets for a in ("--set", s))]
    runner = CliRunner()
    dry = runner.invoke(app, [*command, *common])
    pre = runner.invoke(app, ["preflight", *common])
    assert dry.exit_code != 0, f"{mistake}: the dry run took it\n{dry.output}"
    assert pre.exit_code != 0, f"{mistake}: preflight took it\n{pre.output}"
    # and without the mistake both pass (the plant is what they refuse)
    clean = ["-r", str(CUDA), "-w", str(tmp_path)]
    assert runner.invoke(app, [*command, *clean]).exit_code == 0
    assert runner.invoke(app, ["preflight", *clean]).exit_code == 0
