"""The one reader of the kit's log files: their last lines (what an error or a failed stage quotes)
and what one run appended to a log that others append to."""

from __future__ import annotations

import os
import re
from pathlib import Path

TAIL_BYTES = 64 * 1024  # the last lines of a log are in its end: never read a multi-GB server log whole


def log_tail(path: Path, lines: int) -> list[str] | None:
    """The last `lines` non-empty lines of a log, secrets redacted; None when it cannot be read.

    A progress bar redraws its line with carriage returns: only the last drawing of a line is kept."""
    from dspark_kit.redact import redact_text

    try:
        with Path(path).open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL_BYTES))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    rows = [r.split("\r")[-1].rstrip() for r in text.splitlines()]
    return [redact_text(r) for r in rows if r.strip()][-lines:]


def quoted_tail(path: Path, lines: int = 30) -> str:
    """log_tail as one block for an error message or a result file."""
    rows = log_tail(path, lines)
    if rows is None:
        return "(no log)"
    return "\n".join(rows) or "(log is empty)"


def log_since(path: Path, since: int) -> str:
    """What this run appended to a log that held `since` bytes before it ("" when unreadable)."""
    try:
        with Path(path).open("rb") as f:
            f.seek(since)
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def failed_row(text: str, pattern: re.Pattern) -> tuple[int, str] | None:
    """(row, reason) from the last line `pattern` (groups: row, reason) matches: speculators' own
    line naming the row that stopped it (the trainer's circuit breaker, generate-offline-data's
    --fail-on-error). rich puts the logging call site (file.py:line) at the right edge: dropped."""
    for line in reversed(text.splitlines()):
        m = pattern.search(line)
        if m:
            reason = re.sub(r"\s{2,}\S+\.py:\d+$", "", m.group(2).strip())
            return int(m.group(1)), reason if len(reason) <= 240 else reason[:237] + "..."
    return None

