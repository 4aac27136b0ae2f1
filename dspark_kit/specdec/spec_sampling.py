"""Lossless speculative sampling: the draft's sampled block and the verifier's rejection step.

Follows vLLM's GPU model runner (v1/worker/gpu/spec_decode: the DSpark speculator's sequential
sampling and the rejection sampler), on the CPU and one request at a time:

- drafting: slot i's logits (base + Markov bias given the token sampled at slot i-1), divided
  by the request's temperature, give the draft's distribution q_i; the slot's token is drawn from
  it. With a draft top-k, the top k base logits of each slot are the only candidates (chosen
  before the Markov bias, as vLLM's `dspark_draft_topk`); the rest of q_i is zero.
- verifying: p_i = softmax(verifier logits_i / T). Drafted token x_i is accepted when u < p_i(x_i) /
  q_i(x_i), u ~ U(0, 1); at the first rejection the token is resampled from the normalized residual
  max(0, p_i - q_i) and the block ends there; a fully accepted block adds a bonus token from p.

The emitted tokens are then distributed exactly as the verifier sampling alone (Leviathan et al.,
Chen et al. 2023), whatever q is. One `torch.Generator` drives every draw, in a fixed order (the
draft's slots, then each acceptance test, then the resample or bonus), so a seed reproduces a run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """How a request samples: temperature (> 0), the draft's top-k (None: the whole vocabulary), the RNG."""

    temperature: float
    draft_topk: int | None = None
    gen: torch.Generator | None = None  # None: torch's global RNG


def probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) in float32, over the last dimension."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def draw(p: torch.Tensor, gen: torch.Generator | None) -> int:
    """One index drawn from the (unnormalized, non-negative) weights p."""
    return int(torch.multinomial(p.cpu(), 1, generator=gen))


def topk_candidates(base_logits: torch.Tensor, k: int | None) -> torch.Tensor | None:
    """Per slot, a bool mask [slots, V] of the k largest base logits (None: no top-k)."""
    if k is None or k >= base_logits.shape[-1]:
        return None
    idx = base_logits.topk(k, dim=-1).indices
    return torch.zeros_like(base_logits, dtype=torch.bool).scatter_(-1, idx, True)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The distribution a rejected token is resampled from: max(0, p - q), normalized.

    Module-level so the lossless test can plant a wrong residual and see the test fail. Where
    p <= q everywhere (the two agree to float precision) nothing is left, and p itself is used.
    """
    r = torch.clamp(p - q, min=0.0)
    total = float(r.sum())
    return r / total if total > 0 else p


@dataclass
class Verdict:
    accepted: int  # drafted tokens accepted (a prefix)
    next_token: int  # the resampled token at the first rejection, else the bonus token


def verify_block(target_logits: torch.Tensor, drafted: list[int], draft_probs: torch.Tensor,
                 s: Sampling) -> Verdict:
    """Rejection sampling of one drafted block.

    target_logits [len(drafted)+1, V]: row j is the verifier's logits for the token after
    anchor + drafted[:j]; draft_probs [len(drafted), V]: q of each slot in verifier ids.
    """
    p = probs(target_logits, s.temperature)
    q = draft_probs.to(p.device, p.dtype)
    if q.shape[-1] < p.shape[-1]:  # a verifier vocabulary padded past the draft's: q is zero there
        q = torch.nn.functional.pad(q, (0, p.shape[-1] - q.shape[-1]))
    for i, tok in enumerate(drafted):
        u = float(torch.rand(1, generator=s.gen))
        if u * float(q[i, tok]) < float(p[i, tok]):  # u < p/q, without dividing by q
            continue
        return Verdict(i, draw(residual(p[i], q[i]), s.gen))
    return Verdict(len(drafted), draw(p[len(drafted)], s.gen))
