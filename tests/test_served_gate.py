"""The served-acceptance gate: served beside in-process acceptance, and a planted mismatch fails it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY_RECIPE, TRAINED_RUN_SETS, set_args

from dspark_kit.measure.served_gate import (
    Served,
    ServedGateError,
    checkpoint_identity,
    compare,
    enforce,
    side_by_side,
)


def bench(al, k=4, n=8):
    return {"spec_decode": {"acceptance_length": al} if al is not None else None,
            "num_speculative_tokens": k, "num_prompts": n}


def test_compare_gates_only_like_with_like():
    ev = {"acceptance_length": 3.0, "num_speculative_tokens": 4}
    ok = compare(bench(2.7), ev, 0.8)
    assert ok["comparable"] and ok["passed"] and ok["fraction"] == 0.9
    low = compare(bench(2.0), ev, 0.8)
    assert low["comparable"] and not low["passed"]
    assert compare(bench(2.0), ev, None)["passed"]  # bench.min_served_fraction null: compared, never failed
    other_k = compare(bench(2.0, k=3), ev, 0.8)
    assert not other_k["comparable"] and "K 3 != eval K 4" in other_k["why_not"]
    assert not compare(bench(2.0), None, 0.8)["comparable"]
    assert not compare(bench(None), ev, 0.8)["comparable"]
    assert "not gated" in side_by_side(other_k) and "0.90x" in side_by_side(ok)


def test_compare_gates_only_at_one_temperature():
    ev = {"acceptance_length": 3.0, "num_speculative_tokens": 4, "temperature": 0.7}
    sampled = compare(bench(2.0) | {"temperature": 0.7}, ev, 0.8)
    assert sampled["comparable"] and not sampled["passed"]
    greedy = compare(bench(2.0) | {"temperature": 0.0}, ev, 0.8)
    assert not greedy["comparable"] and "temperature 0.0, eval at 0.7" in greedy["why_not"]
    # an eval.json from before eval.temperature measured greedily
    assert compare(bench(2.7) | {"temperature": 0.0}, {"acceptance_length": 3.0, "num_speculative_tokens": 4},
                   0.8)["comparable"]


def test_checkpoint_identity_sees_config_and_weights(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"aux_hidden_state_layer_ids": [1, 2, 3], "block_size": 4}))
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    a = checkpoint_identity(tmp_path)
    assert a["config"]["aux_hidden_state_layer_ids"] == [1, 2, 3] and a["config"]["sample_from_anchor"] is None
    (tmp_path / "model.safetensors").write_bytes(b"weightz")
    assert checkpoint_identity(tmp_path)["weights_sha256"] != a["weights_sha256"]


def assert_budget_trade(wd: Path) -> None:
    """eval puts confidence-threshold verify budgets beside the fixed K (what adaptive verification trades)."""
    ev = json.loads((wd / "eval" / "eval.json").read_text())
    budget, k = ev["verify_budget"], ev["num_speculative_tokens"]
    assert budget["k"] == k and budget["fixed"]["acceptance_length"] == ev["acceptance_length"]
    fixed = budget["fixed"]["mean_verified_per_step"]
    assert k - 0.5 < fixed <= k  # a fixed K verifies every slot but where the token limit cuts the last block
    cuts = [t["mean_verified_per_step"] for t in budget["thresholds"]]
    assert all(c <= fixed for c in cuts) and cuts == sorted(cuts, reverse=True)  # a higher bar verifies fewer
    assert "## Verify budget from the confidence head" in (wd / "eval" / "eval.md").read_text()


def _run(wd: Path, stages: str, *extra: str) -> subprocess.CompletedProcess:
    # the gate compares the headline figures: the recipe's per-category eval would only add time
    sets = [*TRAINED_RUN_SETS, "regen.enabled=false", "eval.num_prompts=6", "bench.num_prompts=6",
            "eval.categories=[]"]
    cmd = [sys.executable, "-m", "dspark_kit", "run", str(TINY_RECIPE), "--stages", stages, "--workdir", str(wd),
           *set_args(sets), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)


def test_the_gate_diagnoses_against_what_the_stage_served_and_asks_only_when_it_fails(tmp_path: Path):
    """enforce takes plain values and the served record (measure/ reads no resolver): a passing bench
    never asks for it; a failing one names each difference from eval's record."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"block_size": 4}))
    (ckpt / "model.safetensors").write_bytes(b"w")
    eval_json = tmp_path / "eval.json"
    eval_json.write_text(json.dumps({"acceptance_length": 3.0, "num_speculative_tokens": 4, "draft_window_size": 256,
                                     "checkpoint": str(ckpt), "checkpoint_identity": checkpoint_identity(ckpt)}))
    asked = []

    def served():
        asked.append(1)
        return Served(ckpt, 128, "serve.draft_window_size", ("warning k: planted",), "the engine's layout verdict")

    assert enforce(bench(2.9), eval_json, 0.8, served)["passed"] and not asked
    (ckpt / "model.safetensors").write_bytes(b"other")
    with pytest.raises(ServedGateError) as e:
        enforce(bench(1.0), eval_json, 0.8, served)
    why = str(e.value)
    assert asked == [1] and "0.33x" in why
    assert "weights changed since eval" in why and "draft window: eval 256, served 128 (serve.draft_window_size)" in why
    assert "checkpoint warning k: planted" in why and "the engine's layout verdict" in why and "dspark-kit contract" in why


@pytest.mark.slow
def test_run_prints_served_beside_in_process_and_a_planted_mismatch_fails(own_trained_run):
    wd = own_trained_run  # the session's run stays as trained
    dry = _run(wd, "eval,serve,bench", "--dry-run", "--json")  # the plans the run below must execute
    assert dry.returncode == 0, dry.stderr[-3000:]
    proc = _run(wd, "eval,serve,bench")
    assert proc.returncode == 0, proc.stderr[-3000:]
    from test_plan_recorded import assert_recorded_equals_dry_run

    planned = {p["stage"]: p for p in json.loads(dry.stdout)["plans"]}
    [spec] = planned["bench"]["processes"]
    assert spec["role"] == "spec server" and spec["port_chosen_at_start"]  # the tiny recipe's serve.port 0
    assert_recorded_equals_dry_run(wd, planned, ["eval", "serve", "bench"])
    assert "acceptance length served" in proc.stderr and "vs in-process" in proc.stderr, proc.stderr[-2000:]
    [result] = [json.loads(p.read_text()) for p in (wd / "bench").glob("bench_*.json")]
    gate = result["in_process"]
    assert gate["comparable"] and gate["passed"] and gate["fraction"] >= 0.8, gate
    assert_budget_trade(wd)  # the same eval also priced the confidence-threshold verify budgets

    # plant: after eval, the served checkpoint's weights are replaced (what an edited or swapped
    # checkpoint does to a server), with a config every static check still accepts
    import torch
    from safetensors.torch import load_file, save_file

    ckpt = (wd / "checkpoints" / "checkpoint_best").resolve()
    tensors = load_file(str(ckpt / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    planted = {k: v if "norm" in k else torch.randn(v.shape, generator=g).to(v.dtype) * 0.02
               for k, v in tensors.items()}
    (ckpt / "model.safetensors").unlink()  # a hard link to the session's run: replace it, never write through
    save_file(planted, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    proc = _run(wd, "bench", "--force")
    assert proc.returncode != 0
    err = proc.stderr
    assert "served acceptance length" in err and "in-process eval's" in err and "bench.min_served_fraction" in err
    assert "checkpoint weights changed since eval" in err, err[-3000:]
    [result] = [json.loads(p.read_text()) for p in (wd / "bench").glob("bench_*.json")]
    assert result["in_process"]["passed"] is False  # the failed measurement is kept, marked
