"""The lines regen's summary prints, and its verdict: tool rows, replies cut at regen.max_tokens,
the thinking-mode rule's drops, and whether the stage failed as a whole (plain dicts in, text out)."""

from __future__ import annotations

from dspark_kit.data import mode_rule
from dspark_kit.data.lengths import truncation_line


def tools_line(summary: dict) -> str | None:
    """What happened to the tool-calling rows (None when there were none): the verifier's own calls,
    and rows where it answered in text where the dataset had called (its results then go unused)."""
    t = summary.get("tools") or {}
    if not t.get("rows"):
        return None
    line = f"tool rows: {t['rows']} written, {t['verifier_calls']} calls made by the verifier"
    if t["rows_results_unused"]:
        line += (f"; in {t['rows_results_unused']} rows it answered in text where the dataset called a tool "
                 "(those results stay unused: the row is what the verifier does)")
    cut = sum((summary.get("tool_chains_cut") or {}).values())
    return line + (f"; {cut} rows cut after a call the dataset has no result for" if cut else "")


def truncated_line(summary: dict) -> str | None:
    """The line that names regen.max_tokens when more than 5% of the replies were cut (None: fewer)."""
    t = summary.get("truncated") or {}
    return truncation_line(t.get("replies", 0), t.get("of", 0), t.get("max_tokens", 0), t.get("looping", 0),
                           kept=t.get("kept", False))


def mode_line(summary: dict) -> str | None:
    """The output's rows dropped by the replies-vs-thinking-mode rule, and a mixture's thinking rows
    without any reasoning, in one line (None: neither)."""
    if not summary.get("mode"):
        return None
    counts = mode_rule.ModeCounts(**summary["mode"])
    return "; ".join(filter(None, (counts.line(), counts.warning()))) or None


def failure_verdict(summary: dict, budget: float, mode_budget: float) -> str | None:
    """Why this regen failed as a whole (None: it did its job): nothing written while rows failed,
    or more failed rows than regen.max_failed_fraction of those sent, with the first reasons; else
    (`mode_budget`: data.max_mode_mismatch_fraction) the output's replies disagree with their
    thinking mode beyond the rule (data/mode_rule.py)."""
    failed, written = summary["failed"], summary["written"]
    sent = failed + written
    if not failed or (written and failed / sent <= budget):
        if "mode" not in summary:
            return None
        return mode_rule.ModeCounts(**summary["mode"]).verdict(mode_budget, "regen", generated=True)
    reasons = "; ".join(f"{n}x {r}" for r, n in list(summary["failed_reasons"].items())[:3])
    what = "every row failed" if not written else f"{failed} of {sent} rows failed ({failed / sent:.0%})"
    return (f"regen: {what}, above regen.max_failed_fraction {budget:g}: {reasons}; fix the server or "
            "request and rerun with --resume (written rows are kept)")
