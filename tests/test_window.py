"""Draft KV window arithmetic (docs/CONCEPTS.md#window-arithmetic) and `dspark-kit window plan`."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from typer.testing import CliRunner

from dspark_kit.cli import app
from dspark_kit.specdec.window import (
    WindowPlan,
    draft_seq_len,
    future_offset,
    plan_window,
    window_start,
)


# How a WindowPlan is applied to a paged KV cache's block table, as vLLM-Ascend does: the
# reference the plan's figures are checked against here (no module of the kit needs it).
def gather_block_table(block_table: torch.Tensor, plan: WindowPlan) -> torch.Tensor:
    """Windowed block table for the draft's attention reads.

    Row r is shifted left by start_blocks[r]; columns at or past
    needed_blocks[r] are zeroed. The result has max_window_blocks columns
    (fewer when the table itself is narrower). The full table is still the one
    used for slot_mapping (KV writes).
    """
    rows, cols = block_table.shape
    width = min(plan.max_window_blocks, cols)

    start = torch.as_tensor(plan.start_blocks, dtype=torch.long).view(rows, 1)
    needed = torch.as_tensor(plan.needed_blocks, dtype=torch.long).view(rows, 1)
    col = torch.arange(width, dtype=torch.long).view(1, width)
    src = (start + col).clamp(max=cols - 1)
    gathered = torch.gather(block_table, 1, src)
    return torch.where(col < needed, gathered, torch.zeros_like(gathered))


def slot_mapping(block_table: torch.Tensor, positions: torch.Tensor, kv_block_size: int) -> torch.Tensor:
    """Cache slot of each (row, position): always from the full, unwindowed table."""
    blocks = torch.gather(block_table, 1, positions // kv_block_size)
    return blocks * kv_block_size + positions % kv_block_size


def test_reference_vector():
    plan = plan_window([10, 60, 200, 64], window=64, kv_block_size=16, future_offset=3)
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
    plan = plan_window([10, 60, 200, 64], window=64, kv_block_size=16, future_offset=3)
    got = gather_block_table(table, plan)
    assert got.shape == (4, 5)
    assert got[0].tolist() == [1, 0, 0, 0, 0]  # 1 block needed
    assert got[1].tolist() == [1, 2, 3, 4, 0]
    assert got[2].tolist() == [9, 10, 11, 12, 13]  # starts at block 8
    # KV writes use the full table: position 199 lives in logical block 12 -> physical 13
    assert slot_mapping(table[2:3], torch.tensor([[199]]), 16).item() == 13 * 16 + 199 % 16


def test_bad_arguments_name_the_setting():
    with pytest.raises(ValueError, match="draft_window_size"):
        plan_window([10], window=0, kv_block_size=16)
    with pytest.raises(ValueError, match="kv_block_size"):
        window_start(10, 8, 0)


def test_dspark_window_starts_from_context_plus_k():
    """vllm-ascend's proposer passes seq_lens = context + K for dflash/dspark (future_offset 0):
    the docs/CONCEPTS.md#window-arithmetic example W=64, b=16, K=3, contexts 10, 60, 200, 64 -> windowed 13, 63, 75, 67."""
    seqs = [draft_seq_len("dspark", n, 3) for n in (10, 60, 200, 64)]
    assert seqs == [13, 63, 203, 67]
    plan = plan_window(seqs, window=64, kv_block_size=16, future_offset=future_offset("dspark", 3))
    assert plan.windowed_lens == [13, 63, 75, 67]
    # passing the context alone starts the window one kernel block early when (ctx - W) mod b >= b - K
    # (78 - 64) mod 16 = 14 >= 16 - 3: context alone starts at 0, context + K at 16
    assert window_start(78, 64, 16) == 0 and window_start(draft_seq_len("dspark", 78, 3), 64, 16) == 16
    assert window_start(200, 64, 16) == window_start(203, 64, 16) == 128  # 8 < 13: no shift there
    assert draft_seq_len("eagle3", 200, 3) == 200


def test_the_decoder_windows_like_vllm_ascend(monkeypatch):
    """DSparkDraft.draft keeps context positions >= window_start(context + K)."""
    from dspark_kit.specdec import draft_model

    seen = {}
    real = draft_model.window_start

    def spy(seq_len, window, kv_block_size, future_offset=0):
        seen["seq"] = seq_len
        return real(seq_len, window, kv_block_size, future_offset)

    monkeypatch.setattr(draft_model, "window_start", spy)

    class Stop(Exception):
        pass

    fake = draft_model.DSparkDraft.__new__(draft_model.DSparkDraft)
    fake.block_size, fake.sample_from_anchor, fake.slots = 4, True, 4
    monkeypatch.setattr(draft_model.DSparkDraft, "block_hidden", lambda *a, **k: (_ for _ in ()).throw(Stop()))
    with pytest.raises(Stop):
        fake.draft(torch.zeros(200, 2), torch.arange(200), anchor=5, anchor_pos=200, num_slots=3,
                   window=64, kv_block_size=16)
    assert seen["seq"] == 203
    # the cached path (what the decoder runs) reads the cache from the same first position
    monkeypatch.setattr(draft_model.DSparkDraft, "block_hidden_cached",
                        lambda self, cache, start, *a: seen.update(start=start) or (_ for _ in ()).throw(Stop()))
    with pytest.raises(Stop):
        fake.draft_cached(SimpleNamespace(context_len=200), anchor=5, num_slots=3, window=64, kv_block_size=16)
    assert seen["seq"] == 203 and seen["start"] == 128  # (203 - 64) // 16 * 16


def test_cli_plan_text_and_json():
    runner = CliRunner()
    args = ["window", "plan", "--context-lengths", "10,60,200,64", "-W", "64", "--kv-block-size", "16",
            "--num-speculative-tokens", "3", "--method", "dspark"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "13,63,75,67" in res.output
    res = runner.invoke(app, [*args, "--json"])
    data = json.loads(res.stdout)
    assert data["seq_lens"] == [13, 63, 203, 67] and data["future_offset"] == 0
    assert data["start_blocks"] == [0, 0, 8, 0] and data["needed_blocks"] == [1, 4, 5, 5]
    eagle = json.loads(runner.invoke(app, ["window", "plan", "--context-lengths", "10,60,200,64", "-W", "64",
                                           "--kv-block-size", "16", "--num-speculative-tokens", "3",
                                           "--method", "eagle3", "--json"]).stdout)
    assert eagle["windowed_lens"] == [10, 60, 72, 64] and eagle["future_offset"] == 3  # the §5 test vector
    bad = runner.invoke(app, ["window", "plan", "--context-lengths", "10,x", "-W", "64"])
    assert bad.exit_code == 2


def test_cli_rejects_a_window_not_above_future_offset():
    res = CliRunner().invoke(app, ["window", "plan", "--context-lengths", "0", "-W", "1", "--kv-block-size", "1",
                                   "--num-speculative-tokens", "2", "--method", "eagle3"])
    assert res.exit_code == 2 and "must exceed future_offset 2" in res.output
