"""Which of a source row's assistant turns regen gives a reply of its own, said as changed rows.

regen.regenerate asks the verifier for one reply (or call chain) per run of assistant turns after a
prompt: two assistant turns in a row get one reply, and an assistant turn before any system or
user turn gets none (there is nothing to reply to). `reshaped` names those rows by reason, so a
source whose turns regen folds or drops is counted, not silently reshaped. (Prepare, reading such a
row without regen, refuses two assistant turns in a row when the chat template merges them, and
keeps an opening assistant turn as context: data/template_rows.py.)
"""

from __future__ import annotations

from typing import Any

MERGED_REPLIES = ("two assistant turns in a row (no user or tool turn between): the verifier wrote one reply "
                  "where the source had them")
OPENING_REPLY = "an assistant turn before any prompt: not regenerated (nothing to reply to)"


def reshaped(messages: list[dict[str, Any]]) -> list[str]:
    """Why regen.regenerate will not give each of the row's assistant turns a reply of its own, each
    reason once (none: every assistant turn gets its reply)."""
    reasons, prev, asked = set(), None, False
    for m in messages:
        if m["role"] == "assistant":
            if not asked:
                reasons.add(OPENING_REPLY)
            elif prev == "assistant":
                reasons.add(MERGED_REPLIES)
        elif m["role"] != "tool":  # a system or user turn: what history holds, so a reply is asked after it
            asked = True
        prev = m["role"]
    return sorted(reasons)
