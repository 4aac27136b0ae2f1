"""Draft KV window arithmetic (REFERENCE §5) and `dspark-kit window plan`."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from typer.testing import CliRunner

from dspark_kit.cli import app
from dspark_kit.spec.window import (
    future_offset,
    gather_block_table,
    plan_window,
    slot_mapping,
    window_start,
)


def test_reference_vector():
    plan = plan_window([10, 60, 200, 64], window=64, block_size=16, future_offset=3)
    assert plan.windowed_lens == [10, 60, 72, 64]
    assert plan.start_blocks == [0, 0, 8, 0]
    assert plan.needed_blocks == [1, 4, 5, 4]
    assert plan.max_window_blocks == 5


@given(seq=st.integers(0, 5000), w=st.integers(1, 600), b=st.sampled_from([1, 16, 64, 128]), k=st.integers(0, 8))
def test_window_invariants(seq, w, b, k):
    assume(w > k)  # smaller windows are rejected (next test)
    plan = plan_window([seq], w, b, k)
    start = seq - plan.windowed_lens[0]
    assert start % b == 0 and 0 <= start <= seq
    assert plan.windowed_lens[0] <= max(w - k, 0) + b - 1 or start == 0  # never more than one extra block
    assert plan.windowed_lens[0] >= min(seq, w - k)  # never less than the window asks for
    assert plan.needed_blocks[0] <= math.ceil(w / b) + 1
    assert window_start(seq, w, b, k) == start


def test_window_not_above_future_offset_is_rejected():
    # seq 0, W 1, K 2 would start the window at token 1: past the end of the sequence
    with pytest.raises(ValueError, match="draft_window_size 1: must exceed future_offset 2"):
        plan_window([0], 1, 1, 2)
    with pytest.raises(ValueError, match="must exceed future_offset 3"):
        window_start(10, 3, 1, 3)


def test_future_offset_by_method():
    assert future_offset("dspark", 7) == 0 and future_offset("dflash", 7) == 0
    assert future_offset("eagle3", 7) == 7
    with pytest.raises(ValueError, match="method"):
        future_offset("mtp", 3)


def test_block_table_gather_and_slot_mapping():
    table = torch.arange(1, 15).view(1, 14).repeat(4, 1)  # physical block ids 1..14 per row
    plan = plan_window([10, 60, 200, 64], window=64, block_size=16, future_offset=3)
    got = gather_block_table(table, plan)
    assert got.shape == (4, 5)
    assert got[0].tolist() == [1, 0, 0, 0, 0]  # 1 block needed
    assert got[1].tolist() == [1, 2, 3, 4, 0]
    assert got[2].tolist() == [9, 10, 11, 12, 13]  # starts at block 8
    # KV writes use the full table: position 199 lives in logical block 12 -> physical 13
    assert slot_mapping(table[2:3], torch.tensor([[199]]), 16).item() == 13 * 16 + 199 % 16


def test_bad_arguments_name_the_setting():
    with pytest.raises(ValueError, match="draft_window_size"):
        plan_window([10], window=0, block_size=16)
    with pytest.raises(ValueError, match="block_size"):
        window_start(10, 8, 0)


def test_cli_plan_text_and_json():
    runner = CliRunner()
    args = ["window", "plan", "--seq-lens", "10,60,200,64", "--window", "64", "--block-size", "16", "--future-offset", "3"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "10,60,72,64" in res.output
    res = runner.invoke(app, [*args, "--json"])
    data = json.loads(res.stdout)
    assert data["start_blocks"] == [0, 0, 8, 0] and data["needed_blocks"] == [1, 4, 5, 4]
    bad = runner.invoke(app, ["window", "plan", "--seq-lens", "10,x", "--window", "64"])
    assert bad.exit_code == 2


def test_cli_rejects_a_window_not_above_future_offset():
    from typer.testing import CliRunner

    from dspark_kit.cli import app

    res = CliRunner().invoke(app, ["window", "plan", "--seq-lens", "0", "--window", "1", "--block-size", "1",
                                   "--future-offset", "2"])
    assert res.exit_code == 2 and "must exceed future_offset 2" in res.output
