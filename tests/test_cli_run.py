"""Integration: the real CLI trains a real DSpark draft on the tiny recipe (torchtune style)."""

import json
from pathlib import Path

import pytest
from conftest import TRAINED_RUN_SETS, set_args  # the trained_run fixture's recipe overrides

TINY_RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "tiny-cpu.yaml"

pytestmark = pytest.mark.slow


def test_run_layout_and_checkpoint(trained_run):
    wd = trained_run
    summary = json.loads((wd / "run.json").read_text())
    assert [s["stage"] for s in summary["stages"]] == ["prepare", "hidden-states", "train"]
    assert (wd / "prepared" / "token_freq.pt").exists()
    assert list((wd / "prepared" / "hidden_states").glob("hs_*.safetensors"))
    best = wd / "checkpoints" / "checkpoint_best"
    assert best.is_symlink() and (best / "model.safetensors").exists()
    cfg = json.loads((best / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dspark"
    assert cfg["block_size"] == 4 and cfg["aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert cfg["transformer_layer_config"]["layer_types"] == ["full_attention"]
    val = json.loads((best / "val_metrics.json").read_text())
    assert summary["stages"][-1]["figure"] == pytest.approx(val["accept_len_epoch"])
    manifest = json.loads((wd / "manifest.json").read_text())
    assert "dspark_kit.compat.train_entry" in manifest["stages"]["train"]["argv"]
    assert manifest["devices"]["versions"]["speculators"] == "0.9.0"


def test_tensorboard_has_val_accept_len(trained_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((trained_run / "logs").rglob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    assert "val/accept_len_epoch" in acc.Tags()["scalars"]
    from dspark_kit.recipe import load_recipe

    epochs = load_recipe(TINY_RECIPE, TRAINED_RUN_SETS).train.epochs
    assert len(acc.Scalars("val/accept_len_epoch")) == epochs  # one validation per epoch


def test_rerun_skips_unchanged_stages(own_trained_run):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "dspark_kit", "run", str(TINY_RECIPE), "--stages",
           "prepare,hidden-states,train", "--workdir", str(own_trained_run), "--json", *set_args(),
           "--set", "regen.enabled=false"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout
    assert {s["status"] for s in json.loads(out)["stages"]} == {"skipped (unchanged)"}


def test_each_stage_has_a_log(trained_run):
    """What a stage printed is in its stage log; the trainer's own output in train.log, in full."""
    for stage in ("prepare", "hidden-states"):
        assert (trained_run / "logs" / f"stage-{stage}.log").stat().st_size > 0, stage
    assert (trained_run / "logs" / "stage-train.log").is_file()
    assert "Training epoch" in (trained_run / "logs" / "train.log").read_text()


def test_replay_reruns_from_the_manifest(trained_run, tmp_path):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "dspark_kit", "run", "--replay", str(trained_run), "--workdir", str(tmp_path),
           "--stages", "prepare", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout
    assert [s["stage"] for s in json.loads(out)["stages"]] == ["prepare"]
    old = json.loads((trained_run / "manifest.json").read_text())["recipe"]
    new = json.loads((tmp_path / "manifest.json").read_text())["recipe"]
    assert new == old
    assert (tmp_path / "prepared" / "token_freq.pt").exists()


def test_pipeline_eval_prompts_are_not_training_rows(own_trained_run):
    """Reproduced: the pipeline's eval read the first rows of the run's data, which are training rows
    (one demo checkpoint: AL 3.475 there, 3.356 on held-out prompts). It now evaluates on prompts the
    draft never trained on and eval.json says which."""
    import subprocess
    import sys

    from datasets import load_from_disk
    from transformers import AutoTokenizer

    from dspark_kit.data.chat import render
    from dspark_kit.data.tiny_corpus import eval_conversations
    from dspark_kit.measure.eval_prompts import until_last_user
    from dspark_kit.recipe import load_recipe

    wd = own_trained_run
    sets = [*TRAINED_RUN_SETS, "regen.enabled=false", "eval.num_prompts=4", "eval.max_new_tokens=8"]
    cmd = [sys.executable, "-m", "dspark_kit", "run", str(TINY_RECIPE), "--stages", "eval", "--workdir", str(wd),
           "--json", *set_args(sets)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    prompts = json.loads((wd / "eval" / "eval.json").read_text())["prompts"]
    assert prompts["held_out"] is True and prompts["count"] == 4 and "held-out" in prompts["source"]
    held_out = eval_conversations(64)
    used = [held_out[int(i.removeprefix("tiny-heldout-"))] for i in prompts["ids"] + prompts["history_ids"]]
    recipe = load_recipe(TINY_RECIPE, sets)
    tok = AutoTokenizer.from_pretrained(json.loads((wd / "prepared" / "prepare_meta.json").read_text())["tokenizer"])
    data = load_from_disk(str(wd / "prepared")).with_format(None)
    cut = int(len(data) * recipe.train.train_data_ratio)  # what speculators trains on: the rows before it
    trained = [tok.decode(ids) for ids in data["input_ids"][:cut]]
    for chat in used:
        prompt = render(tok, until_last_user(chat), False, add_generation_prompt=True)
        assert not any(prompt in t for t in trained), prompt
