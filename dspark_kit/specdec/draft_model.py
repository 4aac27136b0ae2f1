"""A speculators DSpark checkpoint, run the way vLLM drafts with it (docs/CONCEPTS.md#dspark-at-inference).

The weights are loaded through speculators' own `DSparkDraftModel` and its own
submodules are reused, so training and inference share one definition; only
the inference wiring lives here:

- context features `hidden_norm(fc(aux))` of verified tokens are the K/V
  inputs of every draft layer (k_norm on K, no input_layernorm), RoPE at the
  context tokens' own positions;
- the block `[anchor, MASK x (K-1)]` sits at positions p..p+K-1 and attends
  bidirectionally to itself (causally on sliding layers unless the config
  says non-causal), exactly like the training mask;
- one parallel pass gives base logits; the Markov bias is then chained
  slot by slot: prev = anchor, slot i adds bias(prev), takes argmax,
  prev = chosen (sample_from_anchor: slot i predicts token p+i+1).

`draft` recomputes every context K/V through speculators' layers (the reference,
checked against the training forward); `draft_cached` runs the same layers on a
`DraftKVCache` that holds them across steps (what the decoder uses).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from dspark_kit.rundir import RunDir
from dspark_kit.specdec.draft_cache import DraftKVCache
from dspark_kit.specdec.spec_sampling import Sampling, draw, probs, topk_candidates
from dspark_kit.specdec.window import LOCAL_KV_BLOCK_SIZE, draft_seq_len, window_start


class DraftLoadError(ValueError):
    """A checkpoint that cannot be loaded; str(e) names the file and the fix."""


@dataclass
class DraftBlock:
    tokens: list[int]  # proposed verifier-vocabulary ids, len == num_slots
    logits: torch.Tensor  # [num_slots, draft_vocab] base + Markov bias
    base_logits: torch.Tensor  # [num_slots, draft_vocab]
    confidence: list[float] | None  # per-slot sigmoid(confidence logit)
    probs: torch.Tensor | None = None  # sampled drafting: q per slot [num_slots, verifier vocab]


def chain_prev_tokens(anchor: int, chosen: list[int]) -> list[int]:
    """Markov prev ids per slot: slot i is conditioned on the token at p+i.

    Module-level so a test can swap in the old off-by-one chain and check that
    the consistency test notices.
    """
    return [anchor, *chosen]


def load_dspark_model(checkpoint: str | Path, verifier_path: str | Path, device: str = "cpu",
                      sample_from_anchor: bool | None = None):
    """speculators' DSparkDraftModel in float32, its verifier path made loadable, in the anchor layout
    specdec/anchor.py decides (`sample_from_anchor` forces one: `dspark-kit import` measures both)."""
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

    from dspark_kit.specdec.anchor import anchor_layout

    ckpt = Path(checkpoint)
    if not (ckpt / "config.json").exists():
        raise DraftLoadError(f"checkpoint {ckpt}: no config.json (pass a checkpoint dir, e.g. "
                             f"{RunDir(Path('WORKDIR')).best_checkpoint})")
    raw = json.loads((ckpt / "config.json").read_text())
    if raw.get("speculators_model_type") != "dspark":
        raise DraftLoadError(
            f"checkpoint {ckpt}: speculators_model_type is {raw.get('speculators_model_type')!r}, expected 'dspark'"
        )
    if sample_from_anchor is None:
        anchor = anchor_layout(raw)
        if anchor.sample_from_anchor is None:
            raise DraftLoadError(f"checkpoint {ckpt}: {anchor.problem()}")
        sample_from_anchor = anchor.sample_from_anchor
    config = DSparkSpeculatorConfig.from_pretrained(str(ckpt))
    config.sample_from_anchor = sample_from_anchor  # speculators' class would read a missing key as true
    # The stored verifier path may be relative to wherever training ran.
    config.speculators_config.verifier.name_or_path = str(Path(verifier_path).resolve())
    # Explicit masks below; sdpa runs everywhere (flex attention needs a compiler).
    config.transformer_layer_config._attn_implementation = "sdpa"
    model = DSparkDraftModel.from_pretrained(str(ckpt), config=config, dtype=torch.float32)
    return model.to(device=device, dtype=torch.float32).eval()


class DSparkDraft:
    """Inference wrapper around a loaded DSparkDraftModel."""

    def __init__(self, model):
        self.model = model
        cfg = model.config
        tl = cfg.transformer_layer_config
        self.block_size: int = cfg.block_size
        # false: the DFlash block layout, the anchor is the bonus token and mask position p+k predicts
        # token p+k (block position 0's output is unused), so a block gives one token fewer
        self.sample_from_anchor: bool = bool(cfg.sample_from_anchor)
        from dspark_kit.specdec.anchor import draft_tokens

        self.slots: int = draft_tokens(self.block_size, self.sample_from_anchor)
        self.mask_token_id: int = model.mask_token_id
        self.target_layer_ids: list[int] = list(model.target_layer_ids)
        self.sliding_window: int | None = model.sliding_window
        self.sliding_layers = set(model.sliding_window_indices)
        self.sliding_non_causal: bool = bool(cfg.sliding_window_non_causal)
        self.hidden_size: int = tl.hidden_size
        self.device = next(model.parameters()).device

    @classmethod
    def load(cls, checkpoint: str | Path, verifier_path: str | Path, device: str = "cpu",
             sample_from_anchor: bool | None = None) -> DSparkDraft:
        return cls(load_dspark_model(checkpoint, verifier_path, device, sample_from_anchor))

    # ---- vocabulary ---------------------------------------------------------
    def to_verifier_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        d2t = self.model.d2t
        if not self.model.use_draft_vocab or d2t is None:
            return draft_ids
        return draft_ids + d2t[draft_ids]  # d2t holds offsets (EAGLE convention)

    # ---- forward pieces -----------------------------------------------------
    @torch.inference_mode()
    def context_features(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[n, len(target ids) * hidden] concatenated aux states -> [n, hidden]."""
        return self.model.hidden_norm(self.model.fc(aux_hidden.to(self.device, torch.float32)))

    def _layer_masks(self, ctx_pos: torch.Tensor, anchor_pos: int, num_slots: int) -> dict[bool, torch.Tensor | None]:
        """Boolean [1, 1, K, n_ctx + K] masks (True = attend), full and sliding.

        Full layers attend to everything (the context and the whole block): no mask,
        which lets sdpa share K/V heads instead of copying them per query head.
        """
        masks: dict[bool, torch.Tensor | None] = {False: None}
        if self.sliding_layers:
            n = ctx_pos.numel()
            block = torch.ones(num_slots, num_slots, dtype=torch.bool, device=self.device)
            in_win = (ctx_pos >= anchor_pos - self.sliding_window).to(self.device)
            ctx = in_win.view(1, n).expand(num_slots, n)
            blk = block if self.sliding_non_causal else torch.tril(block)
            masks[True] = torch.cat([ctx, blk], 1)[None, None]
        return masks

    @torch.inference_mode()
    def block_hidden(self, ctx_feats: torch.Tensor, ctx_pos: torch.Tensor, anchor: int, anchor_pos: int, num_slots: int) -> torch.Tensor:
        """Final-normed hidden states [num_slots, hidden] of one drafted block."""
        m = self.model
        ids = torch.full((1, num_slots), self.mask_token_id, dtype=torch.long, device=self.device)
        ids[0, 0] = anchor
        x = m.embed_tokens(ids)
        block_pos = torch.arange(anchor_pos, anchor_pos + num_slots, device=self.device)
        positions = torch.cat([ctx_pos.to(self.device), block_pos]).view(1, -1)
        cos_sin = m.rotary_emb(x, positions)
        masks = self._layer_masks(ctx_pos, anchor_pos, num_slots)
        target = ctx_feats.view(1, -1, self.hidden_size)
        for i, layer in enumerate(m.layers):
            x = layer(
                hidden_states=x,
                target_hidden=target,
                attention_mask=masks[i in self.sliding_layers],
                position_ids=positions,
                position_embeddings=cos_sin,
            )
        return m.norm(x)[0]

    @torch.inference_mode()
    def markov_bias(self, prev_ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """Bias for slot len(prev_ids)-1 given the prev chain so far (any head type).

        vanilla and gated heads are per position (slot i reads prev i and hidden i
        only), so only the last slot is computed; the rnn head carries a state
        through the chain, so it runs the whole prefix.
        """
        head = self.model.markov_head
        i = len(prev_ids) - 1
        if head.head_type == "vanilla":  # W2 @ W1[prev], the head's own formula without its module calls
            return head.markov_w2.weight @ head.markov_w1.weight[prev_ids[-1]].to(head.markov_w2.weight.dtype)
        if head.head_type == "gated":
            prev = torch.tensor([prev_ids[-1:]], dtype=torch.long, device=self.device)
            return head.block_bias(prev_token_ids=prev, hidden_states=hidden[None, i: i + 1])[0, -1]
        prev = torch.tensor([prev_ids], dtype=torch.long, device=self.device)
        return head.block_bias(prev_token_ids=prev, hidden_states=hidden[None, : i + 1])[0, -1]

    @torch.inference_mode()
    def confidences(self, prev_ids: list[int], hidden: torch.Tensor) -> list[float]:
        """sigmoid(confidence logit) of slots 0..len(prev_ids)-1, slot i given prev i (one batched call)."""
        m = self.model
        n = len(prev_ids)
        feats = hidden[:n]
        if m.config.confidence_head_with_markov and m.markov_head is not None:
            prev = m.markov_head.prev_embeddings(torch.tensor(prev_ids, device=self.device))
            feats = torch.cat([feats, prev.to(feats.dtype)], dim=-1)
        return torch.sigmoid(m.confidence_head(feats)).tolist()

    # ---- the draft KV cache (draft_cache.py) --------------------------------
    def new_cache(self) -> DraftKVCache:
        attn = self.model.layers[0].self_attn
        kv_heads = attn.k_proj.out_features // attn.head_dim
        param = next(self.model.parameters())
        return DraftKVCache(len(self.model.layers), kv_heads, attn.head_dim, param.device, param.dtype)

    def extend_cache(self, cache: DraftKVCache, ctx_feats: torch.Tensor) -> None:
        """Verified context features [m, hidden] for positions cache.context_len..: their K/V are
        computed by the next drafted block's pass (draft_cached), once, then kept."""
        cache.append(ctx_feats)

    @torch.inference_mode()
    def block_hidden_cached(self, cache: DraftKVCache, start: int, anchor: int, num_slots: int) -> torch.Tensor:
        """`block_hidden` on the cache: the pending context positions pass through the layers with
        the block (speculators' own attention computes their K/V, as it does for a whole context),
        the committed ones are read from `start` on; then the pending ones are committed."""
        m = self.model
        pending = cache.take_pending(self.hidden_size)
        new, anchor_pos = pending.shape[0], cache.length + pending.shape[0]  # the block follows the context
        ids = torch.full((1, num_slots), self.mask_token_id, dtype=torch.long, device=self.device)
        ids[0, 0] = anchor
        x = m.embed_tokens(ids)
        positions = torch.arange(cache.length, anchor_pos + num_slots, device=self.device).view(1, -1)
        cos_sin = m.rotary_emb(x, positions)
        masks = self._layer_masks(torch.arange(start, anchor_pos, device=self.device), anchor_pos, num_slots)
        target = pending.to(self.device, x.dtype).view(1, new, self.hidden_size)
        reader = cache.reader(start, new, num_slots)
        for i, layer in enumerate(m.layers):
            x = layer(
                hidden_states=x,
                target_hidden=target,
                attention_mask=masks[i in self.sliding_layers],
                position_ids=positions,
                position_embeddings=cos_sin,
                past_key_value=reader,
            )
        cache.commit(new)
        return m.norm(x)[0]

    # ---- drafting -------------------------------------------------------------
    def _check_slots(self, num_slots: int) -> None:
        if not 1 <= num_slots <= self.slots:
            raise ValueError(f"num_speculative_tokens: {num_slots} outside 1..{self.slots} (the draft's slots)")

    def _block_positions(self, num_slots: int) -> int:
        """Block positions one draft of num_slots tokens runs: one more with a bonus anchor."""
        return num_slots if self.sample_from_anchor else num_slots + 1

    def _slot_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The block positions whose outputs are the drafted tokens (a bonus anchor's is not one)."""
        return hidden if self.sample_from_anchor else hidden[1:]

    @staticmethod
    def window_first_position(context_len: int, num_slots: int, window: int | None, kv_block_size: int) -> int:
        """First context position the draft reads: 0, or where vllm-ascend starts the window (token level)."""
        if window is None:
            return 0
        return window_start(draft_seq_len("dspark", context_len, num_slots), window, kv_block_size)

    @torch.inference_mode()
    def draft(
        self,
        ctx_feats: torch.Tensor,
        ctx_pos: torch.Tensor,
        anchor: int,
        anchor_pos: int,
        num_slots: int,
        window: int | None = None,
        kv_block_size: int = LOCAL_KV_BLOCK_SIZE,
        with_confidence: bool = True,
        sampling: Sampling | None = None,
    ) -> DraftBlock:
        """Propose num_slots tokens after `anchor` (at anchor_pos) from the context, recomputing its K/V
        (`sampling`: drawn slot by slot from q, else argmax)."""
        self._check_slots(num_slots)
        if window is not None:  # draft KV window: reads only, token level, as vllm-ascend starts it
            keep = ctx_pos >= self.window_first_position(ctx_pos.numel(), num_slots, window, kv_block_size)
            ctx_feats, ctx_pos = ctx_feats[keep], ctx_pos[keep]
        hidden = self.block_hidden(ctx_feats, ctx_pos, anchor, anchor_pos, self._block_positions(num_slots))
        return self._propose(self._slot_hidden(hidden), anchor, num_slots, with_confidence, sampling)

    @torch.inference_mode()
    def draft_cached(
        self,
        cache: DraftKVCache,
        anchor: int,
        num_slots: int,
        window: int | None = None,
        kv_block_size: int = LOCAL_KV_BLOCK_SIZE,
        with_confidence: bool = True,
        sampling: Sampling | None = None,
    ) -> DraftBlock:
        """`draft` for the context held in `cache` (positions 0..cache.context_len-1); the anchor follows it."""
        self._check_slots(num_slots)
        # the window trims the context only: the block always attends to itself (as `draft` keeps it)
        start = min(self.window_first_position(cache.context_len, num_slots, window, kv_block_size), cache.context_len)
        hidden = self.block_hidden_cached(cache, start, anchor, self._block_positions(num_slots))
        return self._propose(self._slot_hidden(hidden), anchor, num_slots, with_confidence, sampling)

    def _propose(self, hidden: torch.Tensor, anchor: int, num_slots: int, with_confidence: bool = True,
                 sampling: Sampling | None = None) -> DraftBlock:
        """Base logits, then the Markov bias chained slot by slot (each slot's token: the argmax, or
        with `sampling` a draw from q = softmax(logits / T), as vLLM's DSpark speculator samples),
        and (if asked) the confidences."""
        base = self.model.lm_head(hidden)
        logits = base.clone()
        chosen: list[int] = []
        d2t = self.model.d2t if self.model.use_draft_vocab else None
        keep = topk_candidates(base, sampling.draft_topk) if sampling is not None else None
        q = None if sampling is None else torch.zeros_like(base, dtype=torch.float32)
        for i in range(num_slots):
            if self.model.markov_head is not None:
                logits[i] += self.markov_bias(chain_prev_tokens(anchor, chosen)[: i + 1], hidden)
            if sampling is None:
                pick = int(logits[i].argmax())
            else:
                row = logits[i] if keep is None else logits[i].masked_fill(~keep[i], float("-inf"))
                q[i] = probs(row, sampling.temperature)
                pick = draw(q[i], sampling.gen)
            chosen.append(pick + int(d2t[pick]) if d2t is not None else pick)  # d2t: offsets (EAGLE convention)
        conf = None
        if with_confidence and self.model.confidence_head is not None:
            conf = self.confidences(chain_prev_tokens(anchor, chosen)[:num_slots], hidden)
        return DraftBlock(tokens=chosen, logits=logits, base_logits=base, confidence=conf,
                          probs=None if q is None else self.to_verifier_probs(q))

    def to_verifier_probs(self, q: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary probabilities [n, Vd] -> verifier ids [n, verifier vocab] (zero outside the draft's)."""
        if not self.model.use_draft_vocab or self.model.d2t is None:
            return q
        ids = self.to_verifier_ids(torch.arange(q.shape[-1], device=q.device))
        out = q.new_zeros(q.shape[0], self.model.verifier_vocab_size)
        return out.index_copy_(1, ids, q)


def confident_prefix(confidence: list[float] | None, threshold: float | None) -> int | None:
    """How many drafted tokens to verify: stop once prod(sigmoid) < threshold."""
    if confidence is None or threshold is None:
        return None
    survive, n = 1.0, 0
    for c in confidence:
        survive *= c
        if survive < threshold:
            break
        n += 1
    return max(n, 1)  # always verify at least one drafted token
