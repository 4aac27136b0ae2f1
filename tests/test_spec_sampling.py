"""Rejection sampling on its own (no verifier): one drafted block's output is distributed as p.

The exact law of the first emitted token after a one-slot block is p whatever q is; with a wrong
residual it is min(p, q) + (1 - sum min(p, q)) p instead. Both are checked on seeded draws against
a total-variation bound set by the sampling noise at the number of draws.
"""

from __future__ import annotations

import math

import pytest
import torch

from dspark_kit.specdec import spec_sampling
from dspark_kit.specdec.spec_sampling import Sampling, residual, topk_candidates, verify_block

N = 4000
# TV between a distribution over V outcomes and its empirical estimate from N draws: its mean is at
# most 0.5 * sum_x sqrt(p(x)(1-p(x))/N) <= 0.5 * sqrt(V / N), and McDiarmid (one draw moves TV by at
# most 1/N) adds sqrt(ln(1/delta) / (2N)) at confidence 1 - delta.
V = 6
BOUND = 0.5 * math.sqrt(V / N) + math.sqrt(math.log(1e4) / (2 * N))


def _first_token_law(p_logits: torch.Tensor, q: torch.Tensor, temperature: float, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    s = Sampling(temperature, gen=gen)
    counts = torch.zeros(V)
    target = torch.stack([p_logits, p_logits])  # the slot's row, then the bonus row (same law: only slot 0 read)
    for _ in range(N):
        tok = int(torch.multinomial(q, 1, generator=gen))
        v = verify_block(target, [tok], q[None], s)
        counts[tok if v.accepted else v.next_token] += 1
    return counts / N


def _cases():
    g = torch.Generator().manual_seed(3)
    for temperature in (0.7, 1.0):
        logits = torch.randn(V, generator=g) * 2
        q = torch.softmax(torch.randn(V, generator=g) * 2, -1)
        yield temperature, logits, q


@pytest.mark.parametrize("temperature, logits, q", list(_cases()))
def test_one_slot_is_distributed_as_the_verifier(temperature, logits, q):
    p = torch.softmax(logits / temperature, -1)
    tv = 0.5 * float((_first_token_law(logits, q, temperature) - p).abs().sum())
    assert tv < BOUND, (tv, BOUND)


@pytest.mark.parametrize("temperature, logits, q", list(_cases()))
def test_a_wrong_residual_is_caught(temperature, logits, q, monkeypatch):
    p = torch.softmax(logits / temperature, -1)
    wrong_law = torch.minimum(p, q) + (1 - torch.minimum(p, q).sum()) * p
    assert 0.5 * float((wrong_law - p).abs().sum()) > 2 * BOUND  # the planted bug is big enough to see
    monkeypatch.setattr(spec_sampling, "residual", lambda p, q: p)  # resample from p, not max(0, p - q)
    tv = 0.5 * float((_first_token_law(logits, q, temperature) - p).abs().sum())
    assert tv > BOUND, (tv, BOUND)


def test_residual_is_the_normalized_positive_part():
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.6, 0.2])
    assert torch.allclose(residual(p, q), torch.tensor([1.0, 0.0, 0.0]))
    assert torch.equal(residual(p, p), p)  # nothing left: p itself


def test_a_full_block_takes_a_bonus_from_the_last_row():
    gen = torch.Generator().manual_seed(0)
    target = torch.full((3, 4), -1e9)
    target[0, 1] = target[1, 2] = target[2, 3] = 0.0  # the verifier is sure of 1, 2, then 3
    q = torch.zeros(2, 4)
    q[0, 1] = q[1, 2] = 1.0
    v = verify_block(target, [1, 2], q, Sampling(1.0, gen=gen))
    assert (v.accepted, v.next_token) == (2, 3)


def test_topk_keeps_the_k_best_per_slot():
    base = torch.tensor([[0.1, 3.0, 2.0, -1.0], [5.0, 0.0, 1.0, 4.0]])
    assert topk_candidates(base, 2).tolist() == [[False, True, True, False], [True, False, False, True]]
    assert topk_candidates(base, None) is None and topk_candidates(base, 4) is None
