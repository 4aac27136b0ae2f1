"""The draft's KV cache: each draft layer's K/V of the verified context, kept across steps.

A DSpark draft layer's context K/V come from the context features alone:
k = RoPE(k_norm(k_proj(feature)), position), v = v_proj(feature), per token, the
same input for every layer (no layer output feeds them). So the K/V of a
verified token never change once computed: appending each step's accepted
positions gives exactly what recomputing the whole context gives, at a cost
that no longer grows with the context. Real engines keep this cache; without it
the draft's cost per step grows with the context length.

Only verified tokens are committed. The block `[anchor, MASK x (K-1)]` writes
its K/V past the committed length as scratch for one step's attention, so a
rejected draft leaves nothing behind. A draft window reads a suffix of the
cache (as vllm-ascend windows the block table the draft reads, never its
writes).
"""

from __future__ import annotations

import torch

_MIN_CAPACITY = 256


class DraftKVCache:
    """Per-layer K/V [1, kv_heads, capacity, head_dim] of context positions 0..length-1."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, device, dtype):
        shape = (1, kv_heads, _MIN_CAPACITY, head_dim)
        self.keys = [torch.empty(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.values = [torch.empty(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def reserve(self, n: int) -> None:
        """Room for n positions (doubling, so appends stay amortised O(new tokens))."""
        if n <= self.capacity:
            return
        cap = max(n, 2 * self.capacity)
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                grown = t.new_empty(t.shape[0], t.shape[1], cap, t.shape[3])
                grown[:, :, : self.length] = t[:, :, : self.length]
                store[i] = grown

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """K/V [1, kv_heads, m, head_dim] at positions start..start+m-1 (no commit)."""
        end = start + k.shape[2]
        self.keys[layer][:, :, start:end] = k
        self.values[layer][:, :, start:end] = v

    def commit(self, n: int) -> None:
        self.length += n

    def reader(self, start: int, block_len: int) -> BlockReader:
        self.reserve(self.length + block_len)
        return BlockReader(self, start)


class BlockReader:
    """What a draft layer's attention calls as its `past_key_values` for one drafted block.

    `update` is the transformers Cache call the layer makes with the block's own K/V:
    they go into the scratch slots after the context, and the layer attends to the
    context from `start` (the window's first position) through the block.
    """

    def __init__(self, cache: DraftKVCache, start: int):
        self.cache, self.start = cache, start

    def update(self, key_states, value_states, layer_idx: int, cache_kwargs=None):
        c = self.cache
        c.write(layer_idx, c.length, key_states, value_states)
        end = c.length + key_states.shape[2]
        return c.keys[layer_idx][:, :, self.start:end], c.values[layer_idx][:, :, self.start:end]
