"""The figures a draft is published with, from per-request draft records (docs/EVALUATION.md).

A request's record lists its draft steps: how many tokens were drafted, how many the verifier
accepted, and (when the draft has a confidence head) the head's per-slot confidences. From them:

- tau = 1 + accepted / drafts over all steps: the acceptance length counting the bonus token;
- unconditional acceptance at position i: steps accepting position i / steps;
- conditional acceptance at position i: steps accepting i / steps that drafted i with 0..i-1 accepted;
- drafts per request;
- calibration of the confidence head on the positions the verifier judged (drafted, all earlier
  accepted): the slot's confidence against whether it was accepted. ECE over equal-width bins,
  ROC-AUC (Mann-Whitney, ties counted half) and the reliability curve. Also the cumulative form:
  the product of confidences up to i against position i being accepted, over every drafted slot;
- bootstrap intervals over prompts (the unit: a prompt with all its turns), seeded; a paired
  difference resamples the same prompts for both drafts.
Plain values only.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

BINS = 10
BOOTSTRAP = 1000


@dataclass
class RequestRecord:
    prompt: str  # the bootstrap unit: a benchmark row (its turns share it)
    drafted: list[int] = field(default_factory=list)  # per step
    accepted: list[int] = field(default_factory=list)  # per step
    confidence: list[list[float]] | None = None  # per step, per drafted slot (None: no head)
    output_tokens: int = 0
    wall_s: float = 0.0

    def as_dict(self) -> dict:
        return {"prompt": self.prompt, "drafted": self.drafted, "accepted": self.accepted,
                "confidence": None if self.confidence is None else [[round(c, 5) for c in s] for s in self.confidence],
                "output_tokens": self.output_tokens, "wall_s": round(self.wall_s, 4)}

    @classmethod
    def from_dict(cls, d: dict) -> RequestRecord:
        return cls(d["prompt"], list(d["drafted"]), list(d["accepted"]), d.get("confidence"),
                   int(d.get("output_tokens", 0)), float(d.get("wall_s", 0.0)))


def ece(conf: Sequence[float], labels: Sequence[int], bins: int = BINS) -> float | None:
    """Expected calibration error: sum over equal-width bins of (share of samples) x |mean confidence -
    accept rate|; a confidence of exactly 1 falls in the last bin. None without samples."""
    if not conf:
        return None
    rows = reliability(conf, labels, bins)
    return sum(r["count"] / len(conf) * abs(r["mean_confidence"] - r["accept_rate"]) for r in rows)


def reliability(conf: Sequence[float], labels: Sequence[int], bins: int = BINS) -> list[dict]:
    """Per non-empty bin: its range, count, mean confidence and accept rate."""
    sums: list[list[float]] = [[0, 0.0, 0] for _ in range(bins)]
    for c, y in zip(conf, labels, strict=True):
        b = min(int(c * bins), bins - 1) if c >= 0 else 0
        sums[b][0] += 1
        sums[b][1] += c
        sums[b][2] += int(y)
    return [{"bin": [b / bins, (b + 1) / bins], "count": int(n), "mean_confidence": s / n, "accept_rate": a / n}
            for b, (n, s, a) in enumerate(sums) if n]


def roc_auc(scores: Sequence[float], labels: Sequence[int]) -> float | None:
    """Probability that an accepted slot scores above a rejected one (ties half): the Mann-Whitney U
    over positives x negatives. None when either class is empty."""
    pos = sum(1 for y in labels if y)
    neg = len(labels) - pos
    if not pos or not neg:
        return None
    order = sorted(range(len(scores)), key=lambda i: scores[i])
    rank_sum, i = 0.0, 0
    while i < len(order):  # average ranks over ties
        j = i
        while j + 1 < len(order) and scores[order[j + 1]] == scores[order[i]]:
            j += 1
        avg = (i + j) / 2 + 1
        rank_sum += sum(avg for k in range(i, j + 1) if labels[order[k]])
        i = j + 1
    return (rank_sum - pos * (pos + 1) / 2) / (pos * neg)


def judged_slots(records: Sequence[RequestRecord]) -> tuple[list[float], list[int], list[float], list[int]]:
    """(conditional confidences, labels, cumulative confidences, labels) over the records' steps."""
    cc, cy, uc, uy = [], [], [], []
    for r in records:
        for d, a, conf in zip(r.drafted, r.accepted, r.confidence or [], strict=False):
            survive = 1.0
            for j, c in enumerate(conf[:d]):
                survive *= c
                uc.append(survive)
                uy.append(int(j < a))
                if j <= a:  # the verifier judged slot j: every earlier slot was accepted
                    cc.append(c)
                    cy.append(int(j < a))
    return cc, cy, uc, uy


def tau(records: Sequence[RequestRecord]) -> float | None:
    steps = sum(len(r.drafted) for r in records)
    return 1.0 + sum(sum(r.accepted) for r in records) / steps if steps else None


def figures(records: Sequence[RequestRecord], k: int) -> dict:
    """Every figure of one benchmark at one temperature (no intervals)."""
    steps = [(d, a) for r in records for d, a in zip(r.drafted, r.accepted, strict=True)]
    n = len(steps)
    unconditional = [sum(a > i for _, a in steps) / n if n else 0.0 for i in range(k)]
    conditional = []
    for i in range(k):
        reached = sum(d > i and a >= i for d, a in steps)
        conditional.append(sum(a > i for _, a in steps) / reached if reached else None)
    out = {
        "requests": len(records),
        "prompts": len({r.prompt for r in records}),
        "num_drafts": n,
        "num_draft_tokens": sum(d for d, _ in steps),
        "num_accepted_tokens": sum(a for _, a in steps),
        "tau": tau(records),
        "acceptance_rate": sum(a for _, a in steps) / sum(d for d, _ in steps) if n and any(d for d, _ in steps)
        else None,
        "per_position_unconditional": unconditional,
        "per_position_conditional": conditional,
        "drafts_per_request": n / len(records) if records else None,
        "output_tokens": sum(r.output_tokens for r in records),
        "wall_s": sum(r.wall_s for r in records),
    }
    has_head = any(r.confidence is not None for r in records)
    cc, cy, uc, uy = judged_slots(records)
    out["calibration"] = None if not has_head else {
        "slots": len(cc), "ece": ece(cc, cy), "auc": roc_auc(cc, cy), "reliability": reliability(cc, cy),
        "cumulative": {"slots": len(uc), "ece": ece(uc, uy), "auc": roc_auc(uc, uy)},
    }
    return out


def by_prompt(records: Sequence[RequestRecord]) -> dict[str, list[RequestRecord]]:
    groups: dict[str, list[RequestRecord]] = {}
    for r in records:
        groups.setdefault(r.prompt, []).append(r)
    return groups


def _percentiles(values: list[float], level: float) -> list[float] | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    lo = values[int((1 - level) / 2 * (len(values) - 1))]
    hi = values[round((1 + level) / 2 * (len(values) - 1))]
    return [lo, hi]


def bootstrap(records: Sequence[RequestRecord], stat: Callable[[list[RequestRecord]], float | None],
              samples: int = BOOTSTRAP, seed: int = 0, level: float = 0.95) -> list[float] | None:
    """The `level` percentile interval of `stat` over prompts drawn with replacement (seeded)."""
    groups = list(by_prompt(records).values())
    if not groups:
        return None
    rng = random.Random(seed)
    values = []
    for _ in range(samples):
        draw = [r for _ in groups for r in groups[rng.randrange(len(groups))]]
        values.append(stat(draw))
    return _percentiles(values, level)


def paired_difference(a: Sequence[RequestRecord], b: Sequence[RequestRecord],
                      stat: Callable[[list[RequestRecord]], float | None] = tau, samples: int = BOOTSTRAP,
                      seed: int = 0, level: float = 0.95) -> dict:
    """stat(b) - stat(a) on the prompts both measured, with its interval from resampling the same
    prompts for both (the prompts' own difficulty cancels)."""
    ga, gb = by_prompt(a), by_prompt(b)
    shared = [p for p in ga if p in gb]
    if not shared:
        raise ValueError("paired difference: the two runs share no prompt (same suite, limit and seed?)")
    rng = random.Random(seed)

    def diff(keys: list[str]) -> float | None:
        sa = stat([r for k in keys for r in ga[k]])
        sb = stat([r for k in keys for r in gb[k]])
        return None if sa is None or sb is None else sb - sa

    values = [diff([shared[rng.randrange(len(shared))] for _ in shared]) for _ in range(samples)]
    return {"prompts": len(shared), "a": stat([r for k in shared for r in ga[k]]),
            "b": stat([r for k in shared for r in gb[k]]), "difference": diff(shared),
            "interval": _percentiles(values, level), "level": level,
            "only_a": len(ga) - len(shared), "only_b": len(gb) - len(shared)}


def with_intervals(records: Sequence[RequestRecord], k: int, samples: int = BOOTSTRAP, seed: int = 0) -> dict:
    """figures() plus bootstrap intervals over prompts for tau, ECE and AUC."""
    out = figures(records, k)
    out["tau_interval"] = bootstrap(records, tau, samples, seed)
    if out["calibration"] is not None:
        slots = {id(r): judged_slots([r])[:2] for r in records}  # once per request, not per resample

        def cal(stat):
            def f(rs):
                c = [x for r in rs for x in slots[id(r)][0]]
                y = [x for r in rs for x in slots[id(r)][1]]
                return stat(c, y)
            return f
        out["calibration"]["ece_interval"] = bootstrap(records, cal(ece), samples, seed)
        out["calibration"]["auc_interval"] = bootstrap(records, cal(roc_auc), samples, seed)
    out["bootstrap"] = {"samples": samples, "seed": seed, "unit": "prompt"}
    return out
