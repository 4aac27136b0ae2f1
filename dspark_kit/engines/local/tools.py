"""Tool calls on the local engine, as vLLM answers them with `--enable-auto-tool-choice
--tool-call-parser hermes` (Qwen3's format: `<tool_call>\\n{"name": .., "arguments": ..}\\n</tool_call>`).

The request's `tools` reach the chat template (the schema in the system prompt); the reply's
text is split into the content before the first `<tool_call>` (None when empty) and one
OpenAI tool call per block, arguments as JSON text. Text whose blocks do not parse stays
content with no calls, as vLLM's parser leaves it. Without the two flags a request with tools
and tool_choice other than "none" is refused (400), as vLLM refuses it.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

PARSERS = ("hermes",)
START = "<tool_call>"
# a closed block, or an unclosed one running to the end (a reply cut off by max_tokens)
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def refusal(tools: list[dict] | None, tool_choice: Any, enabled: bool) -> str | None:
    """Why this request's tool fields cannot be served here (one line), or None."""
    if not tools:
        return None if tool_choice in (None, "none", "auto") else "tool_choice: given without tools"
    if tool_choice in ("required",) or isinstance(tool_choice, dict):
        return ("tool_choice: the local engine has no guided decoding, so it serves only \"auto\" and \"none\" "
                "(vLLM serves required and named choices)")
    if tool_choice not in (None, "auto", "none"):
        return f"tool_choice: {tool_choice!r} is not one of auto, none, required or a named function"
    if tool_choice != "none" and not enabled:
        return ("tools: \"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser "
                "(serve.tool_call_parser in the recipe), as vLLM")
    return None


def split_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a reply, as vLLM's hermes parser splits it."""
    if START not in text:
        return text, []
    try:
        calls = [json.loads(closed or open_) for closed, open_ in _BLOCK.findall(text)]
        out = [{"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
                "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
               for c in calls]
    except (ValueError, KeyError, TypeError):  # not the format: the text stays the reply
        return text, []
    content = text[: text.find(START)]
    return content or None, out
