"""One Finding type for every check (checkpoint validation, preflight): level, code, message,
and the docs/PITFALLS.md pitfall it belongs to when there is one."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

PITFALLS = {
    1: "Markov prev_token off by one",
    2: "draft layers left on sliding window",
    3: "regen model, train verifier and served verifier differ",
    4: "thinking mode differs between regen, prepare and bench",
    5: "hidden-state layer ids differ from the trainer's",
    6: "num_speculative_tokens above the trained slots",
    7: "wrong or missing mask token id",
    8: "serving the wrong or an incomplete checkpoint",
    9: "draft window below the training window / window with mtp",
    10: "serving context far above the training window with no window",
    11: "multi-node: only one machine can reach it",
}


_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
          "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty")


def pitfall_count() -> str:
    """How many pitfalls there are, in words ("eleven"): what the help and the docs say (a test
    holds README and docs/PITFALLS.md to it)."""
    n = len(PITFALLS)
    return _WORDS[n] if n < len(_WORDS) else str(n)


@dataclass(frozen=True)
class Finding:
    level: Literal["error", "warning"]
    code: str
    message: str
    pitfall: int | None = None

    def as_dict(self) -> dict:
        out = asdict(self)
        if self.pitfall is not None:
            out["title"] = PITFALLS[self.pitfall]
        return out


def errors(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.level == "error"]
