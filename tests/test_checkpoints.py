import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dspark_kit.recipe import recipe_from_dict
from dspark_kit.specdec.checkpoints import (
    CheckpointError,
    complete_epochs,
    errors,
    resolve_checkpoint,
    trained_slots,
    validate_checkpoint,
)

N_LAYERS = 4


def write_ckpt(path: Path, verifier: str, *, block=8, slots=None, mask=5, ids=(1, 2, 3),
               kind="dspark", weights=True) -> Path:
    """A checkpoint laid out like speculators 0.9.0 saves one (config keys as it writes them)."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["DSparkDraftModel"],
        "aux_hidden_state_layer_ids": list(ids),
        "block_size": block,
        "mask_token_id": mask,
        "sample_from_anchor": True,
        "speculators_model_type": kind,
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": slots or block}],
            "verifier": {"architectures": ["Qwen3ForCausalLM"], "name_or_path": verifier},
        },
    }
    (path / "config.json").write_text(json.dumps(cfg))
    if weights:
        save_file({"fc.weight": torch.zeros(4, 4), "markov_head.markov_w1.weight": torch.ones(8, 2)},
                  str(path / "model.safetensors"))
    return path


def recipe(**draft):
    return recipe_from_dict({"draft": {"block_size": 8, **draft},
                             "hidden_states": {"target_layer_ids": [1, 2, 3]}})


@pytest.fixture
def save_path(tmp_path: Path) -> Path:
    sp = tmp_path / "checkpoints"
    for e in (0, 1, 2):
        write_ckpt(sp / str(e), "/v")
    (sp / "3").mkdir()  # epoch 3 still being written: no weights yet
    (sp / "3" / "config.json").write_text("{}")
    os.symlink("1", sp / "checkpoint_best")
    os.symlink("0", sp / "epoch0_end")
    return sp


def test_resolve_names_epochs_and_paths(save_path: Path, tmp_path: Path):
    assert complete_epochs(save_path) == [0, 1, 2]
    assert resolve_checkpoint(save_path) == (save_path / "1").resolve()  # checkpoint_best -> 1
    assert resolve_checkpoint(save_path, "latest") == (save_path / "2").resolve()  # 3 is incomplete
    assert resolve_checkpoint(save_path, "epoch0_end") == (save_path / "0").resolve()
    assert resolve_checkpoint(save_path, 2) == (save_path / "2").resolve()
    assert resolve_checkpoint(save_path, "2") == (save_path / "2").resolve()
    assert resolve_checkpoint(tmp_path, str(save_path / "0")) == (save_path / "0").resolve()
    # a checkpoint directory passed as the base is served as is
    assert resolve_checkpoint(save_path / "2") == (save_path / "2").resolve()
    assert resolve_checkpoint(save_path).is_absolute()


def test_resolve_errors_list_what_exists(save_path: Path, tmp_path: Path):
    with pytest.raises(CheckpointError, match=r"serve.checkpoint 7: .* available in .*0, 1, 2, checkpoint_best"):
        resolve_checkpoint(save_path, 7)
    with pytest.raises(CheckpointError, match="no complete epoch"):
        resolve_checkpoint(tmp_path / "empty", "latest")
    with pytest.raises(CheckpointError, match="does not exist; train first"):
        resolve_checkpoint(tmp_path / "nothing")


K = 7  # the K the resolver decided (the reference run's block 8 - 1)


def test_trained_slots_prefers_recorded_tokens():
    assert trained_slots({"block_size": 8, "speculators_config": {"proposal_methods": [
        {"speculative_tokens": 8}]}}) == 8
    assert trained_slots({"block_size": 8, "sample_from_anchor": False}) == 7
    assert trained_slots({}) is None


def test_valid_checkpoint_has_no_findings(tmp_path: Path):
    verifier = tmp_path / "verifier"
    verifier.mkdir()
    ck = write_ckpt(tmp_path / "0", str(verifier))
    assert validate_checkpoint(ck, recipe(), N_LAYERS, str(verifier), K) == []


@pytest.mark.parametrize("kwargs,rk,code", [
    ({"kind": "dflash"}, {}, "not-dspark"),
    ({"block": 4}, {}, "k-above-slots"),  # K = 7 > 4 slots
    ({"mask": None}, {}, "mask-missing"),
    ({}, {"mask_token_id": 9}, "mask-mismatch"),
    ({"ids": (1, 2)}, {}, "layer-ids"),
    ({"weights": False}, {}, "weights-missing"),
])
def test_each_mismatch_is_an_error(tmp_path: Path, kwargs, rk, code):
    verifier = tmp_path / "verifier"
    verifier.mkdir()
    ck = write_ckpt(tmp_path / "0", str(verifier), **kwargs)
    found = errors(validate_checkpoint(ck, recipe(**rk), N_LAYERS, str(verifier), K))
    assert code in [f.code for f in found]


def test_messages_name_both_values(tmp_path: Path):
    ck = write_ckpt(tmp_path / "0", "/models/other", ids=(1, 2))
    found = {f.code: f.message for f in validate_checkpoint(ck, recipe(), N_LAYERS, "/models/mine", K)}
    assert "[1, 2]" in found["layer-ids"] and "[1, 2, 3]" in found["layer-ids"]
    assert "/models/other" in found["verifier-mismatch"] and "/models/mine" in found["verifier-mismatch"]


def test_truncated_weights_and_missing_config(tmp_path: Path):
    ck = write_ckpt(tmp_path / "0", "/v")
    data = (ck / "model.safetensors").read_bytes()
    (ck / "model.safetensors").write_bytes(data[:-16])
    assert "weights-unreadable" in [f.code for f in validate_checkpoint(ck, recipe(), N_LAYERS, "/v", K)]
    (tmp_path / "1").mkdir()
    assert [f.code for f in validate_checkpoint(tmp_path / "1", recipe(), N_LAYERS, None, K)] == ["config-missing"]


def test_unknown_layer_count_is_a_warning(tmp_path: Path):
    ck = write_ckpt(tmp_path / "0", "/v")
    found = validate_checkpoint(ck, recipe(), None, "/v", K)
    assert [(f.level, f.code) for f in found] == [("warning", "layers-unchecked")]


@pytest.mark.slow
def test_real_speculators_checkpoint_validates(tmp_path: Path):
    """A checkpoint written by speculators itself, on a tiny random Qwen3 verifier."""
    from speculators.models.dspark.core import DSparkDraftModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=N_LAYERS,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256)
    verifier = tmp_path / "verifier"
    Qwen3ForCausalLM(cfg).save_pretrained(verifier)
    draft = DSparkDraftModel.from_training_args(
        cfg, verifier_name_or_path=str(verifier), target_layer_ids=[1, 2, 3], block_size=8,
        draft_vocab_size=256, mask_token_id=5, num_layers=1, draft_attn_impl="sdpa", markov_rank=8)
    draft.save_pretrained(tmp_path / "checkpoints" / "0")
    ck = resolve_checkpoint(tmp_path / "checkpoints", "latest")
    assert validate_checkpoint(ck, recipe(), N_LAYERS, str(verifier), K) == []
    # and K above its 8 trained slots would be caught from the real config
    assert trained_slots(json.loads((ck / "config.json").read_text())) == 8
    wrong = validate_checkpoint(ck, recipe(mask_token_id=6), N_LAYERS, str(verifier), K)
    assert [f.code for f in wrong] == ["mask-mismatch"]


# adopt_interrupted: speculators' `interrupted` save made a mid-epoch save it resumes from


def _save(root: Path, name: str, scheduler_steps: int | None, state: dict | None = None) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"w")
    if scheduler_steps is not None:
        torch.save({"last_epoch": scheduler_steps, "_step_count": scheduler_steps + 1}, d / "scheduler_state_dict.pt")
    if state is not None:
        (d / "training_state.json").write_text(json.dumps(state))
    return d


def _state(d: Path) -> dict:
    return json.loads((d / "training_state.json").read_text())


def test_interrupted_in_the_first_epoch_becomes_epoch_0_mid_way(tmp_path):
    from dspark_kit.specdec.checkpoints import adopt_interrupted, complete_epochs, mid_epoch

    _save(tmp_path, "interrupted", 3)
    note = adopt_interrupted(tmp_path)
    assert note.startswith("interrupted resumed from: renamed 0 (epoch 0, 3 steps into it, global step 3)")
    assert _state(tmp_path / "0") == {"epoch": 0, "local_step": 3, "global_step": 3}
    assert os.readlink(tmp_path / "epoch0_step3") == "0" and not (tmp_path / "interrupted").exists()
    assert mid_epoch(tmp_path / "0") and complete_epochs(tmp_path) == []  # not a whole epoch: not `latest`


def test_interrupted_after_whole_epochs_continues_the_next_one(tmp_path):
    from dspark_kit.specdec.checkpoints import (
        adopt_interrupted,
        complete_epochs,
        resolve_checkpoint,
    )

    for e in (0, 1):
        _save(tmp_path, str(e), 6 * (e + 1), {"epoch": e, "local_step": 0, "global_step": 6 * (e + 1)})
    (tmp_path / "checkpoint_best").symlink_to("0")
    _save(tmp_path, "interrupted", 16)
    assert "renamed 2 (epoch 2, 4 steps into it, global step 16)" in adopt_interrupted(tmp_path)
    assert _state(tmp_path / "2") == {"epoch": 2, "local_step": 4, "global_step": 16}
    assert complete_epochs(tmp_path) == [0, 1]
    assert resolve_checkpoint(tmp_path, "latest") == (tmp_path / "1").resolve()
    assert resolve_checkpoint(tmp_path, "checkpoint_best") == (tmp_path / "0").resolve()


def test_interrupted_later_than_a_mid_epoch_save_replaces_it(tmp_path):
    from dspark_kit.specdec.checkpoints import adopt_interrupted

    _save(tmp_path, "0", 6, {"epoch": 0, "local_step": 0, "global_step": 6})
    _save(tmp_path, "1", 8, {"epoch": 1, "local_step": 2, "global_step": 8})  # speculators' checkpoint_freq < 1
    _save(tmp_path, "interrupted", 11)
    assert "renamed 1 (epoch 1, 5 steps into it, global step 11)" in adopt_interrupted(tmp_path)
    assert _state(tmp_path / "1") == {"epoch": 1, "local_step": 5, "global_step": 11}
    assert _state(tmp_path / "superseded-1") == {"epoch": 1, "local_step": 2, "global_step": 8}


@pytest.mark.parametrize("steps,why", [
    (6, "no later than 0 (step 6 <= 6)"),  # stopped at the epoch's end (during validation)
    (4, "no later than 0 (step 4 <= 6)"),  # left from an earlier run
    (None, "no scheduler step count"),  # train.scheduler none: the step it stopped at is unknown
])
def test_interrupted_that_cannot_be_resumed_is_kept_aside_and_says_why(tmp_path, steps, why):
    from dspark_kit.specdec.checkpoints import adopt_interrupted, complete_epochs

    _save(tmp_path, "0", 6, {"epoch": 0, "local_step": 0, "global_step": 6})
    _save(tmp_path, "interrupted", steps)
    note = adopt_interrupted(tmp_path)
    assert note.startswith("interrupted not resumed from (kept as unused-interrupted): ") and why in note
    assert note.endswith("resuming from the last whole epoch") and "\n" not in note
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "unused-interrupted"]
    assert complete_epochs(tmp_path) == [0] and adopt_interrupted(tmp_path) is None
