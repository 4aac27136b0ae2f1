"""Draft KV window arithmetic, as vLLM-Ascend computes it (docs/CONCEPTS.md#k-and-the-draft-window).

The draft attends only to the last ~W tokens of its context; the verifier keeps
full attention. Windows start on a kernel-block boundary, so a windowed length
lies in [min(seq, W - K), W + b - 1]. KV *writes* (the slot mapping) are never
windowed: only the block table the draft's attention reads is (tests/test_window.py
applies a plan to a block table the way vLLM-Ascend does).

W = draft_window_size, b = KV-cache (kernel) block size `kv_block_size` (not
the draft's block_size), future_offset: 0 for dflash/dspark, K for eagle3.

What the sequence length is depends on the method (docs/CONCEPTS.md#k-and-the-draft-window): for
dflash/dspark the proposer passes context + K (the query block
[anchor, MASK x (K-1)] is already counted) with future_offset 0; eagle3 passes
the context and offsets by K. `draft_seq_len` + `future_offset` say both.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where tensors are made: plans (dry runs) read the constants without torch
    import torch

WINDOWED_METHODS = ("dspark", "dflash", "eagle3")
# The local engine and eval window at this KV-block granularity; vllm-ascend at its own KV cache
# block, ASCEND_KV_BLOCK_SIZE unless serve.extra_args passes --block-size (the resolver's
# kv_block_size decides which; `window plan --kv-block-size` shows either).
LOCAL_KV_BLOCK_SIZE = 16
ASCEND_KV_BLOCK_SIZE = 128


def future_offset(method: str, num_speculative_tokens: int) -> int:
    """K for a speculative method: only eagle3 drafts into its own cache."""
    if method not in WINDOWED_METHODS:
        raise ValueError(f"method: {method!r} unknown; expected one of {', '.join(WINDOWED_METHODS)}")
    return num_speculative_tokens if method == "eagle3" else 0


def draft_seq_len(method: str, context_len: int, num_speculative_tokens: int) -> int:
    """The seq_len the window adapter sees: context + the K-token query block for dflash/dspark."""
    future_offset(method, num_speculative_tokens)  # validates the method
    return context_len if method == "eagle3" else context_len + num_speculative_tokens


def max_window_blocks(window: int, kv_block_size: int) -> int:
    return math.ceil(window / kv_block_size) + 1


def window_start(seq_len: int, window: int, kv_block_size: int, future_offset: int = 0) -> int:
    """First token position the draft still attends to (a block boundary)."""
    _check(window, kv_block_size, future_offset)
    return (max(seq_len + future_offset - window, 0) // kv_block_size) * kv_block_size


@dataclass
class WindowPlan:
    seq_lens: list[int]
    windowed_lens: list[int]
    start_blocks: list[int]
    needed_blocks: list[int]
    window: int
    kv_block_size: int
    future_offset: int
    max_window_blocks: int

    def as_dict(self) -> dict:
        return asdict(self)


def plan_window(seq_lens: torch.Tensor | list[int], window: int, kv_block_size: int, future_offset: int = 0) -> WindowPlan:
    """Vectorised window arithmetic for a batch of sequence lengths."""
    _check(window, kv_block_size, future_offset)
    import torch

    seq = torch.as_tensor(seq_lens, dtype=torch.long)
    start = ((seq + future_offset - window).clamp(min=0) // kv_block_size) * kv_block_size
    windowed = seq - start
    cap = max_window_blocks(window, kv_block_size)
    needed = ((windowed + kv_block_size - 1) // kv_block_size).clamp(max=cap)
    return WindowPlan(
        seq_lens=seq.tolist(),
        windowed_lens=windowed.tolist(),
        start_blocks=(start // kv_block_size).tolist(),
        needed_blocks=needed.tolist(),
        window=window,
        kv_block_size=kv_block_size,
        future_offset=future_offset,
        max_window_blocks=cap,
    )


def _check(window: int, kv_block_size: int, future_offset: int) -> None:
    if window < 1:
        raise ValueError(f"draft_window_size: must be >= 1, got {window}")
    if kv_block_size < 1:
        raise ValueError(f"kv_block_size: must be >= 1, got {kv_block_size}")
    if future_offset < 0:
        raise ValueError(f"future_offset: must be >= 0, got {future_offset}")
    if future_offset >= window:  # else the start passes the sequence end: a negative windowed length
        raise ValueError(f"draft_window_size {window}: must exceed future_offset {future_offset} "
                         "(the tokens drafted ahead); raise the window")
