"""The draft's KV cache: each draft layer's K/V of the verified context, kept across steps.

A DSpark draft layer's context K/V come from the context features alone:
k = RoPE(k_norm(k_proj(feature)), position), v = v_proj(feature), per token, the
same input for every layer (no layer output feeds them). So the K/V of a
verified token never change once computed: computing them once, when the token
is verified, gives exactly what recomputing the whole context every step gives,
at a cost that no longer grows with the context. Real engines keep this cache;
without it the draft's cost per step grows with the context length.

Verified tokens' features wait in `pending` until the next drafted block: the
layers then project them together with the block (one pass, as an engine writes
the KV of new tokens during its forward) and they are committed. The block
`[anchor, MASK x (K-1)]` writes its K/V after them as scratch for that pass only,
so a rejected draft leaves nothing behind. A draft window reads a suffix of the
cache (as vllm-ascend windows the block table the draft reads, never its writes).
"""

from __future__ import annotations

import torch

_MIN_CAPACITY = 256


class DraftKVCache:
    """Per-layer K/V [1, kv_heads, capacity, head_dim] of context positions 0..length-1, plus the
    features of verified positions length.. whose K/V the next drafted block computes."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, device, dtype):
        shape = (1, kv_heads, _MIN_CAPACITY, head_dim)
        self.keys = [torch.empty(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.values = [torch.empty(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.length = 0
        self.pending: list[torch.Tensor] = []  # [m, hidden] feature runs, in position order

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @property
    def context_len(self) -> int:
        """Verified positions, committed or pending: the next anchor's position."""
        return self.length + sum(f.shape[0] for f in self.pending)

    def append(self, feats: torch.Tensor) -> None:
        """Context features [m, hidden] of the next verified positions (accepted tokens only)."""
        self.pending.append(feats)

    def take_pending(self, hidden_size: int) -> torch.Tensor:
        feats = torch.cat(self.pending) if len(self.pending) > 1 else (
            self.pending[0] if self.pending else torch.empty(0, hidden_size, device=self.keys[0].device,
                                                              dtype=self.keys[0].dtype))
        self.pending = []
        return feats

    def reserve(self, n: int) -> None:
        """Room for n positions (doubling, so writes stay amortised O(new tokens))."""
        if n <= self.capacity:
            return
        cap = max(n, 2 * self.capacity)
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                grown = t.new_empty(t.shape[0], t.shape[1], cap, t.shape[3])
                grown[:, :, : self.length] = t[:, :, : self.length]
                store[i] = grown

    def reader(self, start: int, new: int, block_len: int) -> BlockReader:
        """For one pass over `new` pending positions and a block of `block_len`; commit(new) after it."""
        self.reserve(self.length + new + block_len)
        return BlockReader(self, start)

    def commit(self, n: int) -> None:
        self.length += n


class BlockReader:
    """What a draft layer's attention calls as its `past_key_values` for one drafted block.

    `update` is the transformers Cache call the layer makes with the K/V it just computed
    (the pending context positions, then the block): they go in after the committed
    context, and the layer attends to everything from `start` (the window's first
    position) through the block.
    """

    def __init__(self, cache: DraftKVCache, start: int):
        self.cache, self.start = cache, start

    def update(self, key_states, value_states, layer_idx: int, cache_kwargs=None):
        c = self.cache
        end = c.length + key_states.shape[2]
        c.keys[layer_idx][:, :, c.length:end] = key_states
        c.values[layer_idx][:, :, c.length:end] = value_states
        return c.keys[layer_idx][:, :, self.start:end], c.values[layer_idx][:, :, self.start:end]
