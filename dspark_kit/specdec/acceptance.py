"""The acceptance figures (docs/CONCEPTS.md#acceptance-figures), computed one way for in-process eval
(the decoder's per-request counts) and served eval/bench (vLLM's /metrics counter deltas)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Acceptance:
    """vLLM's semantics: a draft is one speculation step; rates are fractions in [0, 1]."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: list[int]  # accepted tokens at draft position i (empty: the source gave rates only)
    acceptance_length: float | None  # 1 + accepted / drafts
    acceptance_rate: float | None  # accepted / draft tokens
    mean_verified_per_step: float | None  # draft tokens / drafts
    per_position_acceptance: list[float]  # accepted at position i / drafts

    def as_dict(self, ndigits: int | None = None) -> dict[str, Any]:
        """The figures as eval.json / bench json write them (rounded to `ndigits` when given)."""
        def r(x):
            return round(x, ndigits) if ndigits is not None and isinstance(x, float) else x

        d = asdict(self)
        return {k: [r(x) for x in v] if k == "per_position_acceptance" else r(v) for k, v in d.items()}


def acceptance(drafts: float, draft_tokens: float, accepted: float,
               accepted_per_pos: dict[int, float] | list[float]) -> Acceptance:
    """The figures from counts summed over a run (in-process requests or a /metrics window)."""
    per_pos = (list(accepted_per_pos) if isinstance(accepted_per_pos, list)
               else [accepted_per_pos[k] for k in sorted(accepted_per_pos)])
    return Acceptance(
        num_drafts=int(drafts), num_draft_tokens=int(draft_tokens), num_accepted_tokens=int(accepted),
        accepted_per_pos=[int(a) for a in per_pos],
        acceptance_length=1.0 + accepted / drafts if drafts else None,
        acceptance_rate=accepted / draft_tokens if draft_tokens else None,
        mean_verified_per_step=draft_tokens / drafts if drafts else None,
        per_position_acceptance=[a / drafts for a in per_pos] if drafts else [],
    )


def per_position(figures: dict[str, Any]) -> list[float]:
    """A written file's per-position acceptance."""
    # bench files before issue 28 named it per_position_acceptance_rates
    return list(figures.get("per_position_acceptance") or figures.get("per_position_acceptance_rates") or [])
