"""Normalise chat rows from the formats users have into OpenAI-style messages.

Accepted: the regen schema / ShareGPT (`conversations: [{from, value}]`),
OpenAI `messages: [{role, content}]`, and `prompt`/`response` pairs. A row that
cannot be used raises `ConversationError` with a reason; callers count those.
"""

from __future__ import annotations

from typing import Any

ROLE_ALIASES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
    "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "model": "assistant",
    "system": "system", "tool": "tool",
}


class ConversationError(ValueError):
    """A row that cannot become a conversation; str(e) is the reason."""


def _turn(t: Any, i: int) -> dict[str, str]:
    if not isinstance(t, dict):
        raise ConversationError(f"turn {i}: expected an object, got {type(t).__name__}")
    role = t.get("role", t.get("from"))
    content = t.get("content", t.get("value"))
    if not isinstance(role, str) or role.lower() not in ROLE_ALIASES:
        raise ConversationError(f"turn {i}: unknown role {role!r}")
    if isinstance(content, list):  # OpenAI content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise ConversationError(f"turn {i}: content must be text, got {type(content).__name__}")
    return {"role": ROLE_ALIASES[role.lower()], "content": content}


def normalize(row: Any) -> list[dict[str, str]]:
    """Messages of one row; raises ConversationError when the row is unusable."""
    if not isinstance(row, dict):
        raise ConversationError(f"row must be an object, got {type(row).__name__}")
    turns = row.get("conversations", row.get("messages"))
    if turns is None and "prompt" in row:
        turns = [{"role": "user", "content": row["prompt"]}]
        if row.get("response") is not None:
            turns.append({"role": "assistant", "content": row["response"]})
    if turns is None:
        raise ConversationError("no 'conversations', 'messages' or 'prompt' field")
    if not isinstance(turns, list) or not turns:
        raise ConversationError("conversation is empty or not a list")
    msgs = [_turn(t, i) for i, t in enumerate(turns)]
    if not any(m["role"] == "user" for m in msgs):
        raise ConversationError("no user turn")
    return msgs


def to_sharegpt(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    back = {"user": "human", "assistant": "gpt"}
    return [{"from": back.get(m["role"], m["role"]), "value": m["content"]} for m in messages]
