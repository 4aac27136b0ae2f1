"""Reference DSpark decoder: speculative decoding, offline and lossless, greedy or sampled.

`SpecGenerator` drafts with a DSpark checkpoint (dspark_kit.specdec.draft_model) and
verifies with the transformers verifier under a KV cache. Greedy, it accepts the longest
prefix that matches the verifier's greedy choice plus one bonus token, so its output is
token-for-token the verifier's greedy output. At a temperature it samples the block from the
draft and accepts by rejection sampling (dspark_kit.specdec.spec_sampling), so its output is
distributed as the verifier's own sampling. Its counters follow
vLLM's /metrics semantics (docs/CONCEPTS.md#acceptance-figures), so acceptance measured here is
comparable with a served vLLM run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from dspark_kit.specdec.checkpoints import ks_outside_slots, slots_error
from dspark_kit.specdec.draft_model import DSparkDraft, confident_prefix
from dspark_kit.specdec.spec_sampling import Sampling, verify_block
from dspark_kit.specdec.verifier import SAMPLING_EPS, LayerTap, load_verifier, sample_token
from dspark_kit.specdec.window import LOCAL_KV_BLOCK_SIZE


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    # speculative decoding counters for this request (vLLM /metrics semantics)
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


class Generator(Protocol):
    """What the local engine needs from a decoding backend.

    `on_tokens`, when given, is called with each run of new output tokens as soon as
    they are decided (a token at a time, or an accepted draft run), for streaming.
    """

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int | None = None,
        stop_ids: frozenset[int] = frozenset(),
        cancel=None,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> GenerationResult: ...


@dataclass
class SpecResult(GenerationResult):
    verifier_forwards: int = 0
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    # per draft step: tokens drafted and accepted, and (record_confidence, a draft with a confidence
    # head) the head's confidence of each drafted slot; measure.suite_metrics reads them
    step_drafted: list[int] = field(default_factory=list)
    step_accepted: list[int] = field(default_factory=list)
    step_confidence: list[list[float]] | None = None


class Verifier:
    """A causal LM with a KV cache that also returns aux hidden states (vLLM layer ids, verifier.LayerTap)."""

    def __init__(self, path: str | Path, layer_ids: list[int] | None = None, device: str = "cpu",
                 dtype: str = "float32"):
        # dtype: Resolved's (float32 on CPU); the draft reads the aux states in float32 either way
        self.model = load_verifier(path, device, dtype)
        self.device = self.model.device
        self.tap = LayerTap(self.model, layer_ids or [], field="aux_hidden_state_layer_ids")
        self.num_layers: int = self.tap.num_layers
        self.layer_ids = self.tap.layer_ids

    def new_cache(self):
        from transformers import DynamicCache

        # Full layers everywhere, even for sliding-window layers (gpt-oss): verification rolls the
        # cache back (crop), and a sliding layer has dropped the states a rollback needs. The model
        # still applies its window in the attention mask, so the logits are the same.
        return DynamicCache()

    @torch.no_grad()  # not inference_mode: tests train on these states
    def forward(self, ids: list[int], cache, start_pos: int, last_only: bool = False,
                aux: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [n, V] (`last_only`: [1, V], the next token's, as a prefill needs) and
        concatenated aux states [n, len(ids)*H] for new tokens (None without `aux`)."""
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        pos = torch.arange(start_pos, start_pos + len(ids), device=self.device).view(1, -1)
        aux = aux and bool(self.layer_ids)
        out = self.model(
            input_ids=x, position_ids=pos, past_key_values=cache, use_cache=True,
            output_hidden_states=aux, logits_to_keep=1 if last_only else 0,
        )
        aux = self.tap.select(out.hidden_states).flatten(1) if aux else None
        return out.logits[0].float(), aux


def _emit(new: list[int], out: list[int], max_new: int, stop_ids: frozenset[int],
          on_tokens: Callable[[list[int]], None] | None = None) -> str | None:
    """Append tokens to out (and hand them to on_tokens); return a finish reason once generation must end."""
    start, reason = len(out), None
    for t in new:
        out.append(t)
        if t in stop_ids:
            reason = "stop"
            break
        if len(out) >= max_new:
            reason = "length"
            break
    if on_tokens is not None and len(out) > start:
        on_tokens(out[start:])
    return reason


class ReferenceDecoder:
    """Verifier-only decoding (greedy or sampled): the lossless reference.

    Kept apart from engines.verifier_generator.VerifierGenerator on purpose: it
    decodes through `Verifier.forward` (the same cache and positions SpecGenerator
    verifies with), counts verifier forwards and wall time for evaluate.py, and
    an unseeded call samples from torch's global RNG; sampling is shared.
    """

    def __init__(self, verifier: Verifier):
        self.verifier = verifier

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens, temperature=0.0, seed=None, stop_ids=frozenset(),
                 cancel=None, on_tokens=None) -> SpecResult:
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        cache, out, forwards = self.verifier.new_cache(), [], 0
        feed, pos, reason = list(prompt_ids), 0, None
        while reason is None:
            logits, _ = self.verifier.forward(feed, cache, pos, last_only=True, aux=False)
            forwards += 1
            pos += len(feed)
            nxt = sample_token(logits[-1], temperature, gen=gen)
            reason = _emit([nxt], out, max_new_tokens, stop_ids, on_tokens)
            if reason is None and cancel is not None and cancel.is_set():
                reason = "abort"  # the client went away: stop decoding for it
            feed = [nxt]
        return SpecResult(out, reason, verifier_forwards=forwards, wall_s=time.perf_counter() - t0)


class _DraftContext:
    """The verified context as the draft sees it: a draft KV cache, or (reference) raw features."""

    def __init__(self, draft: DSparkDraft, cached: bool):
        self.d = draft
        self.cache = draft.new_cache() if cached else None
        self.feats: torch.Tensor | None = None

    def extend(self, aux: torch.Tensor) -> None:
        """Append the verified tokens' aux states (only accepted positions ever come here)."""
        feats = self.d.context_features(aux)
        if self.cache is not None:
            self.d.extend_cache(self.cache, feats)
        else:
            self.feats = feats if self.feats is None else torch.cat([self.feats, feats])

    def draft(self, anchor: int, num_slots: int, window: int | None, kv_block_size: int, with_confidence: bool,
              sampling: Sampling | None = None):
        if self.cache is not None:
            return self.d.draft_cached(self.cache, anchor, num_slots, window, kv_block_size, with_confidence,
                                       sampling)
        p = self.feats.shape[0]
        return self.d.draft(self.feats, torch.arange(p, device=self.d.device), anchor, p, num_slots, window,
                            kv_block_size, with_confidence, sampling)


class SpecGenerator:
    """DSpark speculative decoding, greedy or sampled (implements specdec.decoder.Generator)."""

    def __init__(
        self,
        verifier: Verifier,
        draft: DSparkDraft,
        num_speculative_tokens: int,
        draft_window_size: int | None = None,
        confidence_threshold: float | None = None,
        kv_block_size: int = LOCAL_KV_BLOCK_SIZE,
        draft_kv_cache: bool = True,
        draft_topk: int | None = None,
        record_confidence: bool = False,
    ):
        """`draft_kv_cache=False` recomputes the draft's context K/V every step (the reference
        path; same tokens, a cost that grows with the context): for tests and benchmarks.
        `draft_topk`: sampled drafting draws each slot from its k best base logits only (vLLM's
        dspark_draft_topk; None: the whole vocabulary); greedy decoding ignores it. `record_confidence`:
        compute the confidence head's output every step (without a threshold too) and keep it in the
        result's step_confidence, for calibration; the tokens are the same either way."""
        if draft_topk is not None and draft_topk < 1:
            raise ValueError(f"draft_topk: {draft_topk} must be >= 1 (or None: no top-k)")
        self.draft_topk = draft_topk
        self.verifier, self.draft = verifier, draft
        self.draft_kv_cache = draft_kv_cache
        self.k = num_speculative_tokens  # decided by the resolver (Resolved.k), never defaulted here
        if ks_outside_slots([self.k], draft.slots):
            raise ValueError(slots_error("num_speculative_tokens", [self.k], draft.slots))
        self.window = draft_window_size
        self.kv_block_size = kv_block_size
        self.confidence_threshold = confidence_threshold
        self.record_confidence = record_confidence and draft.model.confidence_head is not None

    @classmethod
    def from_checkpoint(
        cls,
        verifier_path: str | Path,
        checkpoint_path: str | Path,
        num_speculative_tokens: int,
        draft_window_size: int | None = None,
        device: str = "cpu",
        confidence_threshold: float | None = None,
        dtype: str = "float32",
        draft_topk: int | None = None,
    ) -> SpecGenerator:
        draft = DSparkDraft.load(checkpoint_path, verifier_path, device)
        verifier = Verifier(verifier_path, draft.target_layer_ids, device, dtype)
        return cls(verifier, draft, num_speculative_tokens, draft_window_size, confidence_threshold,
                   draft_topk=draft_topk)

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens, temperature=0.0, seed=None, stop_ids=frozenset(),
                 cancel=None, on_tokens=None) -> SpecResult:
        """Greedy below vLLM's sampling epsilon (the verifier's argmax, token for token), else lossless
        speculative sampling (spec_sampling): the verifier's sampling distribution, seeded by `seed`."""
        if not prompt_ids:
            raise ValueError("prompt_ids: empty prompt (need at least one token)")
        sampling = None
        if temperature >= SAMPLING_EPS:
            gen = torch.Generator().manual_seed(seed) if seed is not None else None
            sampling = Sampling(temperature, self.draft_topk, gen)
        t0 = time.perf_counter()
        v, d = self.verifier, self.draft
        res = SpecResult([], "length", accepted_per_pos=[0] * self.k,
                         step_confidence=[] if self.record_confidence else None)
        cache = v.new_cache()
        logits, aux = v.forward(list(prompt_ids), cache, 0, last_only=True)  # prefill
        res.verifier_forwards = 1
        context = _DraftContext(d, self.draft_kv_cache)
        context.extend(aux)
        anchor, p = sample_token(logits[-1], temperature, gen=sampling and sampling.gen), len(prompt_ids)
        reason = _emit([anchor], res.token_ids, max_new_tokens, stop_ids, on_tokens)  # p = anchor position
        while reason is None:
            num_slots = min(self.k, max_new_tokens - len(res.token_ids))
            block = context.draft(anchor, num_slots, self.window, self.kv_block_size,
                                  with_confidence=self.confidence_threshold is not None or self.record_confidence,
                                  sampling=sampling)
            keep = confident_prefix(block.confidence, self.confidence_threshold) or num_slots
            drafted = block.tokens[:keep]
            logits, aux = v.forward([anchor, *drafted], cache, p)
            res.verifier_forwards += 1
            if sampling is None:
                target = logits.argmax(-1).tolist()  # target[j] = verifier's token p+j+1
                n_acc = 0
                while n_acc < len(drafted) and drafted[n_acc] == target[n_acc]:
                    n_acc += 1
                nxt = target[n_acc]
            else:
                verdict = verify_block(logits, drafted, block.probs[:keep], sampling)
                n_acc, nxt = verdict.accepted, verdict.next_token
            res.num_drafts += 1
            res.num_draft_tokens += len(drafted)
            res.num_accepted_tokens += n_acc
            for i in range(n_acc):
                res.accepted_per_pos[i] += 1
            res.step_drafted.append(len(drafted))
            res.step_accepted.append(n_acc)
            if res.step_confidence is not None:
                res.step_confidence.append(list(block.confidence or [])[:len(drafted)])
            # Keep anchor + accepted drafts in cache and context; drop rejected ones.
            if len(drafted) > n_acc:
                cache.crop(n_acc - len(drafted))  # negative: drop the rejected tail
            context.extend(aux[: n_acc + 1])
            anchor, p = nxt, p + n_acc + 1
            reason = _emit([*drafted[:n_acc], anchor], res.token_ids, max_new_tokens, stop_ids, on_tokens)
            if reason is None and cancel is not None and cancel.is_set():
                reason = "abort"
        res.finish_reason = reason
        res.wall_s = time.perf_counter() - t0
        return res
