"""Replies against their row's thinking mode: one rule, decided once, by the first stage that sees a row.

The rule: a row whose thinking mode is off but one of whose replies carries reasoning is dropped,
with its reason. It is not trained "as generated": a server's reasoning parser has already moved
the text before a stray `</think>` into `reasoning_content`, so the row's template render is no
longer the token sequence the verifier produced, and a hybrid model that slips a `</think>` into
one reply in a few hundred gives the draft nothing worth learning. One such row is noise; many
are a mistake (data generated in thinking mode, trained for non-thinking): above
`data.max_mode_mismatch_fraction` of the rows the deciding stage fails in one line naming the key.
So does a run whose rows are all in thinking mode while not one reply carries reasoning.

Who decides: regen, for the rows it regenerates (each row records `metadata.mode_check`: "ok" or
the reason, and regen judges the budget over its whole output); prepare, for rows nobody decided
(raw data, another tool's regenerated file), and it records its counts in prepare_meta.json.
Later stages and preflight read those records; none judges the rows again.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from dspark_kit.data.conversations import has_reasoning
from dspark_kit.data.reasoning_formats import ReasoningFormat

RECORD = "mode_check"  # the metadata key regen records its decision under
AGREES = "ok"
REASONING_WITH_THINKING_OFF = ("reply carries reasoning but the row's thinking mode is off (verifier.thinking is "
                               "false, or its metadata.thinking or mixture draw is)")
BUDGET_KEY = "data.max_mode_mismatch_fraction"


def decide(messages: list[dict[str, Any]], thinking: bool, fmt: ReasoningFormat) -> str:
    """The rule for one row under the verifier's reasoning format (`fmt.stray`: only a format with a
    thinking switch can reason where the row's mode is off): AGREES, or why the row is dropped."""
    return REASONING_WITH_THINKING_OFF if fmt.stray(has_reasoning(messages), thinking) else AGREES


def recorded(row: object) -> str | None:
    """The decision an earlier stage recorded in the row's metadata (None: nobody decided yet)."""
    meta = row.get("metadata") if isinstance(row, dict) else None
    value = meta.get(RECORD) if isinstance(meta, dict) else None
    return value if isinstance(value, str) else None


@dataclass
class ModeCounts:
    """What the deciding stage counts and records: rows judged, rows dropped, and the thinking-mode
    rows with and without reasoning (a thinking run whose replies never reason is misconfigured)."""

    rows: int = 0
    dropped: int = 0
    thinking_rows: int = 0
    thinking_with_reasoning: int = 0
    # the verifier always reasons (Harmony: no thinking switch): there is no mode to get wrong, and rows
    # without reasoning (raw data, never regenerated) are just that
    always_reasons: bool = False

    def add(self, thinking: bool, reasoning: bool, decision: str) -> None:
        self.rows += 1
        self.dropped += decision != AGREES
        self.thinking_rows += thinking
        self.thinking_with_reasoning += thinking and reasoning

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def line(self) -> str | None:
        """The deciding stage's one line about the rule (None when nothing was dropped)."""
        if not self.dropped:
            return None
        return f"dropped {self.dropped} of {self.rows} rows: {REASONING_WITH_THINKING_OFF}"

    def warning(self) -> str | None:
        """A mixture's thinking-mode rows of which not one carries reasoning (all rows so: a verdict)."""
        if self.always_reasons or not self.thinking_rows or self.thinking_with_reasoning or self.thinking_rows == self.rows:
            return None
        return (f"WARNING: none of the {self.thinking_rows} rows in thinking mode carries reasoning: they train "
                "an empty think block (regenerate them in thinking mode, or weigh thinking out of the mixture)")

    def verdict(self, budget: float, stage: str, generated: bool = False) -> str | None:
        """Why the deciding stage fails (None: within the rule), in one line naming the key and the fix.
        `generated`: the rows' replies are the verifier's own, generated with the rows' mode (regen's
        output), so reasoning in them is the verifier reasoning unasked, not data generated in thinking
        mode."""
        if self.rows and self.dropped / self.rows > budget and generated:
            # regen's rows: every reply in them is the verifier's own, asked with thinking off just now
            return (f"{stage}: {self.dropped} of {self.rows} rows ({self.dropped / self.rows:.0%}): the verifier "
                    f"reasoned in its own replies though asked with thinking off (enable_thinking false), above {BUDGET_KEY} "
                    f"{budget:g}: the verifier reasons unasked (or the server ignores "
                    "chat_template_kwargs.enable_thinking); the source data is not at fault. Raise "
                    f"{BUDGET_KEY} to drop those rows and go on, or set verifier.thinking: true")
        if self.rows and self.dropped / self.rows > budget:
            return (f"{stage}: {self.dropped} of {self.rows} rows ({self.dropped / self.rows:.0%}) carry reasoning "
                    f"though their thinking mode is off, above {BUDGET_KEY} {budget:g}: the data was generated in "
                    "thinking mode (or the server ignores chat_template_kwargs.enable_thinking); set "
                    "verifier.thinking: true, or regenerate with thinking off")
        if not self.always_reasons and self.thinking_rows and self.thinking_rows == self.rows and not self.thinking_with_reasoning:
            return (f"{stage}: none of {self.thinking_rows} rows in thinking mode carries reasoning: regenerate in "
                    "thinking mode (with vLLM: the verifier's --reasoning-parser keeps it, e.g. qwen3), or set "
                    "verifier.thinking: false")
        return None


def counts_of(rows, fmt: ReasoningFormat) -> ModeCounts:
    """The counts over rows that carry a recorded decision (regen's output, whole: a resumed run
    is judged with the rows earlier runs wrote)."""
    from dspark_kit.data.conversations import ConversationError, normalize

    counts = ModeCounts(always_reasons=fmt.always)
    for row in rows:
        decision = recorded(row)
        if decision is None:
            continue
        thinking = row["metadata"].get("thinking") is True
        try:
            reasoning = has_reasoning(normalize(row))
        except ConversationError:
            reasoning = False
        counts.add(thinking, reasoning, decision)
    return counts
