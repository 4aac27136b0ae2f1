"""The training memory plan (dspark_kit/resolved/memory_plan.py): its terms follow the recipe, preflight
refuses a recipe whose plan exceeds the stated device memory naming the cheapest fixes in order, the seed
recipe's dry run prints its per-device plan, and init picks settings that fit. How close the plan is to
a real training's memory: benchmarks/bench_memory.py (docs/PERFORMANCE_ANALYSES.md#training-memory-issue-40)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dspark_kit.recipe import load_recipe
from dspark_kit.resolved import Resolved
from dspark_kit.resolved.memory_plan import GIB, plan_for

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "recipes" / "tiny-cpu.yaml"
SEED = REPO / "recipes" / "qwen3-30b-a3b-ultrachat-ascend.yaml"
# the tiny recipe at a long sequence on a stated 1 GiB device: over without checkpointing, under with it
PLANTED = ["train.device=cpu", "train.device_memory_gib=1", "data.seq_length=8192", "train.max_anchors=2048",
           "draft.num_layers=3"]


def res_of(path: Path, sets: list[str], tmp_path: Path) -> Resolved:
    return Resolved(load_recipe(path, sets), tmp_path / "run", planning=True)


def terms(plan) -> dict[str, int]:
    return {t.name: t.bytes for t in plan.trainer.terms}


def test_terms_follow_the_recipe(tmp_path):
    res = res_of(TINY, ["train.device=cpu", "data.seq_length=4096", "train.max_anchors=256"], tmp_path)
    base = plan_for(res)
    t = terms(base)
    assert t["optimizer"] == 2 * t["gradients"] and t["parameters"] > t["gradients"]  # frozen tables: no grads
    assert t["hidden states"] == 4096 * 4 * 128 * 2  # S x (3 targets + last layer) x hidden x bf16
    more = terms(plan_for(res, max_anchors=512))
    assert more["logits"] == pytest.approx(2 * t["logits"], rel=0.05) and more["layers"] > t["layers"]
    ckpt = plan_for(res, gradient_checkpointing=True)
    assert ckpt.trainer.peak < base.trainer.peak and terms(ckpt)["logits"] == 0  # folded into the max
    longer = plan_for(res, seq_length=8192)
    assert terms(longer)["hidden states"] == 2 * t["hidden states"]
    assert all(name in line for name, line in zip(("parameters", "gradients"), base.lines()[1:3], strict=True))


def test_fsdp_shards_parameters_gradients_and_optimizer(tmp_path):
    res = res_of(SEED, [], tmp_path)
    ddp, fsdp = terms(plan_for(res)), terms(plan_for(res, fsdp_shard=True))
    for name in ("parameters", "gradients", "optimizer"):
        assert fsdp[name] == pytest.approx(ddp[name] / 2, abs=4)  # train.nproc 2
    assert "ddp buckets" in ddp and "fsdp gathered" in fsdp and "ddp buckets" not in fsdp


def test_planted_recipe_is_refused_with_the_fixes_in_order(tmp_path):
    from dspark_kit.stages.preflight.memory import memory_findings

    res = res_of(TINY, PLANTED, tmp_path)
    assert res.memory_plan.trainer.peak > GIB
    [f] = memory_findings(res)
    assert f.level == "error" and f.code == "train-memory" and "1.0 GiB (train.device_memory_gib)" in f.message
    fixes = f.message.split("cheapest fixes in order: ")[1]
    order = [fixes.index(k) for k in ("train.gradient_checkpointing: true", "train.max_anchors:",
                                      "train.fsdp_shard: true", "data.seq_length:")]
    assert order == sorted(order), fixes
    assert fixes.split(";")[0].endswith("(fits)")  # checkpointing alone fits this one
    fitted = res_of(TINY, [*PLANTED, "train.gradient_checkpointing=true"], tmp_path)
    assert fitted.memory_plan.trainer.fits and memory_findings(fitted) == []


def test_the_memory_check_is_part_of_preflight_for_training_only(tmp_path):
    from dspark_kit.stages.preflight.checks import run_preflight

    res = res_of(TINY, PLANTED, tmp_path)
    codes = {f.code for f in run_preflight(res, probes=False, checkpoints=False, storage=False)}
    assert "train-memory" in codes
    codes = {f.code for f in run_preflight(res, probes=False, storage=False, training=False)}
    assert "train-memory" not in codes


def test_seed_recipe_dry_run_prints_its_per_device_plan(tmp_path):
    from dspark_kit.stages.training.train import plan as plan_train

    lines = plan_train(res_of(SEED, [], tmp_path)).lines
    memory = [ln for ln in lines if ln.startswith("# memory:")]
    assert memory[0].startswith("# memory: each of 2 training rank(s) on npu: planned peak ")
    assert "of 59.6 GiB (train.device_memory_gib): fits" in memory[0]
    # the verifier (a hub id) is not on this machine: its server is shown, not checked
    assert "verifier server on vLLM (hidden states" in memory[1] and "not checked" in memory[1], memory[1]
    assert any("logits" in ln and "draft vocab 151,936" in ln for ln in lines)


def test_without_the_verifiers_shape_the_plan_says_why(tmp_path):
    from dspark_kit.resolved.memory_plan import plan_lines

    res = res_of(SEED, ["verifier.vocab_size=null"], tmp_path)
    assert plan_lines(res) == [("# memory: not planned (verifier.vocab_size: no config.json for the verifier on this "
                               "machine; set verifier.vocab_size to plan training memory (or run where the "
                               "verifier is))")]


def test_init_picks_settings_that_fit_the_target_device(tmp_path):
    import yaml
    from test_init import QWEN3_0_6B, TOKENIZER_FIXTURE, init, verifier_dir

    verifier = verifier_dir(tmp_path / "v", TOKENIZER_FIXTURE, QWEN3_0_6B, weights=False)
    roomy, tight = tmp_path / "roomy.yaml", tmp_path / "tight.yaml"
    assert init("--verifier", str(verifier), "--target-device", "npu", "-o", str(roomy),
                "--device-memory-gib", "64").exit_code == 0
    r = init("--verifier", str(verifier), "--target-device", "npu", "-o", str(tight), "--device-memory-gib", "12")
    assert r.exit_code == 0, r.output
    assert "memory: each of 2 training rank(s) on npu" in r.output
    a, b = yaml.safe_load(roomy.read_text())["train"], yaml.safe_load(tight.read_text())["train"]
    assert "gradient_checkpointing" not in a and b["gradient_checkpointing"] is True
    assert b["device_memory_gib"] == 12
    plan = plan_for(Resolved(load_recipe(tight), tmp_path / "run", planning=True))
    assert plan.trainer.fits


@pytest.mark.slow
def test_planted_recipe_cli_refuses_then_trains_with_checkpointing(tmp_path, tiny_verifier):
    """`dspark-kit preflight` exits 1 on the planted recipe naming the fixes; with checkpointing its
    memory check passes and the recipe trains."""
    from typer.testing import CliRunner

    from dspark_kit.cli import app

    wd = tmp_path / "run"
    small = ["data.limit=48", "regen.enabled=false", "train.epochs=1", "train.max_steps=1", "train.logger=none"]
    sets = [f for s in [*PLANTED, *small] for f in ("--set", s)]
    bad = CliRunner().invoke(app, ["preflight", "-r", str(TINY), "-w", str(wd), *sets])
    assert bad.exit_code == 1 and "cheapest fixes in order: train.gradient_checkpointing: true" in bad.output
    ckpt = [*sets, "--set", "train.gradient_checkpointing=true"]
    ok = CliRunner().invoke(app, ["preflight", "-r", str(TINY), "-w", str(wd), *ckpt])
    assert "train-memory" not in ok.output and "fits" in ok.output, ok.output
    ran = CliRunner().invoke(app, ["run", str(TINY), "-w", str(wd), "--stages", "prepare,hidden-states,train", *ckpt])
    assert ran.exit_code == 0, ran.output[-3000:]
    assert "--gradient-checkpointing" in (wd / "plans" / "train.json").read_text()
