"""The replies-vs-thinking-mode rule (data/mode_rule.py): one decision per row, one budget per stage."""

from __future__ import annotations

from dspark_kit.data import mode_rule
from dspark_kit.data.mode_rule import AGREES, REASONING_WITH_THINKING_OFF, ModeCounts
from dspark_kit.data.reasoning_formats import HARMONY, THINK

PLAIN = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
STRAY = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b", "reasoning_content": "a story "}]


def test_a_reply_with_reasoning_is_dropped_only_with_thinking_off():
    assert mode_rule.decide(STRAY, False, THINK) == REASONING_WITH_THINKING_OFF
    assert mode_rule.decide(STRAY, True, THINK) == AGREES
    assert mode_rule.decide(PLAIN, False, THINK) == AGREES
    blank = [PLAIN[0], {**PLAIN[1], "reasoning_content": "\n\n"}]  # an empty think block is no reasoning
    assert mode_rule.decide(blank, False, THINK) == AGREES


def test_a_format_without_a_thinking_switch_has_no_stray_reasoning():
    """Harmony (gpt-oss) always reasons: no mode of its verifier makes a reasoning reply stray, and rows
    without reasoning (raw data nobody regenerated) are no misconfigured thinking mode."""
    assert mode_rule.decide(STRAY, False, HARMONY) == AGREES
    assert _counts(8, 0, thinking_rows=8).verdict(0.02, "prepare") is not None
    assert ModeCounts(rows=8, thinking_rows=8, always_reasons=True).verdict(0.02, "prepare") is None


def _counts(rows: int, dropped: int, thinking_rows: int = 0, with_reasoning: int = 0) -> ModeCounts:
    return ModeCounts(rows=rows, dropped=dropped, thinking_rows=thinking_rows, thinking_with_reasoning=with_reasoning)


def test_one_stray_row_in_256_is_counted_not_fatal():
    c = _counts(256, 1)
    assert c.verdict(0.02, "regen") is None
    assert c.line() == f"dropped 1 of 256 rows: {REASONING_WITH_THINKING_OFF}"


def test_a_systematic_mismatch_fails_in_one_line_naming_the_key_and_the_fix():
    why = _counts(256, 77).verdict(0.02, "regen")
    assert why is not None and "\n" not in why
    assert why.startswith("regen: 77 of 256 rows (30%) carry reasoning")
    assert "data.max_mode_mismatch_fraction 0.02" in why and "verifier.thinking: true" in why


def test_the_budget_is_a_bound_not_a_guess():
    assert _counts(100, 2).verdict(0.02, "prepare") is None  # at the budget: allowed
    assert _counts(100, 3).verdict(0.02, "prepare") is not None
    assert _counts(0, 0).verdict(0.0, "prepare") is None


def test_thinking_rows_without_any_reasoning_fail_and_in_a_mixture_warn():
    why = _counts(10, 0, thinking_rows=10).verdict(0.02, "prepare")
    assert why is not None and "none of 10 rows in thinking mode carries reasoning" in why
    assert _counts(10, 0, thinking_rows=10, with_reasoning=1).verdict(0.02, "prepare") is None
    mixture = _counts(10, 0, thinking_rows=4)  # a mixture: the other 6 rows are not thinking
    assert mixture.verdict(0.02, "prepare") is None
    assert mixture.warning().startswith("WARNING: none of the 4 rows in thinking mode carries reasoning")
    assert _counts(10, 0, thinking_rows=10).warning() is None  # all of them: the verdict says it


def test_counts_of_reads_only_recorded_decisions():
    def row(decision, thinking=False, msgs=PLAIN):
        meta = {"idx": 0, "thinking": thinking, **({mode_rule.RECORD: decision} if decision else {})}
        return {"messages": msgs, "metadata": meta}

    rows = [row(AGREES), row(REASONING_WITH_THINKING_OFF, msgs=STRAY), row(None, msgs=STRAY),
            row(AGREES, thinking=True, msgs=STRAY), "not a row"]
    c = mode_rule.counts_of(rows, THINK)
    assert (c.rows, c.dropped, c.thinking_rows, c.thinking_with_reasoning) == (3, 1, 1, 1)
    assert mode_rule.recorded(rows[2]) is None and mode_rule.recorded("x") is None


def test_regen_blames_the_verifier_reasoning_unasked_not_the_data():
    """regen's rows are the verifier's own replies, asked with thinking off: reasoning in them is the
    verifier reasoning unasked (the tiny verifier does it on multi-turn UltraChat), not data generated in
    thinking mode; prepare judging raw data keeps the data's message."""
    regen = _counts(16, 4).verdict(0.02, "regen", generated=True)
    assert regen is not None and "\n" not in regen and regen.startswith("regen: 4 of 16 rows (25%)")
    assert "the verifier reasoned in its own replies though asked with thinking off" in regen
    assert "generated in thinking mode" not in regen and "data.max_mode_mismatch_fraction" in regen
    data = _counts(16, 4).verdict(0.02, "prepare")
    assert "the data was generated in thinking mode" in data


def test_regens_failure_verdict_uses_the_verifiers_message():
    from dspark_kit.stages.dataset.regen import failure_verdict

    summary = {"failed": 0, "written": 16, "failed_reasons": {}, "mode": _counts(16, 4).as_dict()}
    verdict = failure_verdict(summary, 0.05, 0.02)
    assert verdict is not None and "the verifier reasoned in its own replies" in verdict
