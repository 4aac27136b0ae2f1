"""One rule for a sweep's K values and windows, in-process `tune` and `tune --served` alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from dspark_kit.recipe import load_recipe
from dspark_kit.resolved import Resolved
from dspark_kit.stages.evaluation.sweep_rules import EvalError, sweep_inputs

TINY = Path(__file__).resolve().parents[1] / "recipes" / "tiny-cpu.yaml"


def _res(tmp_path):
    return Resolved(load_recipe(TINY, ["draft.block_size=4", "data.seq_length=64"]), tmp_path, planning=True)


@pytest.mark.parametrize("what", ["tune", "tune --served"])
def test_both_sweeps_choose_the_same_candidates(tmp_path, what):
    res = _res(tmp_path)
    ks, windows, ctx = sweep_inputs(res, ks=None, windows=None, context_lengths=[300], allow_below=False, what=what)
    assert (ks, windows, ctx) == ([3, 4], [64, 128, 256], [300])  # block - 1 and block; the training window doubled
    assert sweep_inputs(res, ks=[2], windows=[], context_lengths=[300], allow_below=False, what=what)[:2] == ([2], [])


@pytest.mark.parametrize("what", ["tune", "tune --served"])
def test_both_sweeps_bound_k_by_the_trained_slots_and_windows_by_the_training_window(tmp_path, what):
    res = _res(tmp_path)
    with pytest.raises(EvalError, match=rf"^{what} --ks 5: outside 1..4"):
        sweep_inputs(res, ks=[4, 5], windows=None, context_lengths=[300], allow_below=False, what=what)
    with pytest.raises(EvalError, match=rf"^{what} --windows \[32\]: below the draft's training window 64"):
        sweep_inputs(res, ks=None, windows=[32], context_lengths=[300], allow_below=False, what=what)
    assert sweep_inputs(res, ks=None, windows=[32], context_lengths=[300], allow_below=True, what=what)[1] == [32]


def test_the_served_sweep_proposes_windows_at_the_serving_engines_block(tmp_path):
    """vllm-ascend windows at its own KV block (128 by default, --block-size in serve.extra_args), not
    the local engine's 16: the served tune's default windows are multiples of the block they run at."""
    from dspark_kit.specdec.window import ASCEND_KV_BLOCK_SIZE

    recipe = load_recipe(TINY, ["draft.block_size=4", "data.seq_length=100", "serve.engine=vllm-ascend"])
    res = Resolved(recipe, tmp_path, planning=True)
    _, served, _ = sweep_inputs(res, ks=None, windows=None, context_lengths=[1000], allow_below=False,
                                what="tune --served", served=True)
    _, local, _ = sweep_inputs(res, ks=None, windows=None, context_lengths=[1000], allow_below=False)
    assert res.kv_block_size.value == ASCEND_KV_BLOCK_SIZE
    assert served and all(w % ASCEND_KV_BLOCK_SIZE == 0 for w in served), served
    assert any(w % ASCEND_KV_BLOCK_SIZE for w in local), local  # in-process: the local engine's block
