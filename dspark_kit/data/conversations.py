"""One conversation model for the whole kit: chat rows in, OpenAI-style messages out.

A message is `{"role", "content"}` plus, on assistant turns, `reasoning_content`
(the thinking text, the field Qwen3's chat template and speculators read) when
the reply carried any, `finish_reason` when the row recorded one, and
`token_ids` when the row kept the verifier's own tokens of the reply (think
block through the end-of-turn token, as the server generated them).

Tool calling: an assistant turn keeps its `tool_calls` (OpenAI's `[{id, type, function: {name,
arguments}}]`, arguments parsed into an object as vLLM does before rendering), a `tool` turn its `tool_call_id` / `name`, and the row's `tools` (the schema
list, or its JSON text) is read by `row_tools`; the chat template renders all three.

Readers accept the regen schema / ShareGPT (`conversations: [{from, value}]`, with
`function_call` turns (a JSON `{name, arguments}` or a list of them: the assistant's calls) and
`observation` turns (a tool's result), and a top-level `system` prompt), OpenAI `messages: [{role,
content}]`, Alpaca (`instruction`, `input`, `output`, optional `system` and `history`), TRL's
prompt/completion (strings, or message lists) and `prompt`/`response` pairs (`row_format` names
which; docs/DATA.md shows each); reasoning as
`reasoning_content`, `reasoning` (vLLM's newer name) or inline
`<think>...</think>` at the start of the content (split the way Qwen3's template
splits it) or Harmony's analysis/final channels (data/reasoning_formats.py). Writers
(`to_sharegpt`, used by regen) store reasoning explicitly in
`reasoning_content`. A row that cannot be used raises `ConversationError` whose
text is the full reason; callers count rows per reason.

A reply the model did not finish (`finish_reason: length`, or `<think>` without
`</think>`) is marked; `truncation(messages)` names it so prepare can skip it.
"""

from __future__ import annotations

import json
from typing import Any

from dspark_kit.data import reasoning_formats
from dspark_kit.data.reasoning_formats import THINK, ReasoningFormat

ROLE_ALIASES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
    "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "model": "assistant",
    "system": "system", "tool": "tool", "observation": "tool", "function": "tool",
    "function_call": "assistant",
}
# a row's key -> its format's name, checked in this order (a TRL row has `prompt` and `completion`)
FORMATS = {"messages": "OpenAI messages", "conversations": "ShareGPT", "completion": "TRL prompt/completion",
           "instruction": "Alpaca", "prompt": "prompt/response"}
UNCLOSED = "unclosed"  # marker key on a message whose reasoning never closed


class ConversationError(ValueError):
    """A row that cannot become a conversation; str(e) is the reason."""


def split_reasoning(content: str) -> tuple[str | None, str, bool]:
    """(reasoning or None, content, unclosed) of a reply with inline reasoning, in whichever format's
    markers it carries (data/reasoning_formats.py: Qwen3's think block, Harmony's channels)."""
    return reasoning_formats.split_inline(content)


def canonical_reasoning(reasoning: str, content: str, fmt: ReasoningFormat = THINK) -> tuple[str, str]:
    """Reasoning given apart from the content (a parser's field), cut as `fmt`'s template cuts
    inline reasoning (ReasoningFormat.canonical). A row does not say its verifier's format, so a
    reader cuts as Qwen3's template does (the only one that cuts); regen passes its verifier's."""
    return fmt.canonical(reasoning, content)


def _text(value: Any, what: str, i: int) -> str | None:
    if isinstance(value, list):  # OpenAI content parts: text only (an image would be dropped unseen)
        if not all(isinstance(p, dict) and p.get("type", "text") == "text" and isinstance(p.get("text"), str)
                   for p in value):
            kinds = {str(p.get("type")) if isinstance(p, dict) else type(p).__name__ for p in value} - {"text"}
            raise ConversationError(f"turn {i}: {what} holds parts other than text "
                                    f"({', '.join(sorted(kinds)) or 'a part without text'}); only text is trained")
        value = "".join(p["text"] for p in value)
    if value is not None and not isinstance(value, str):
        raise ConversationError(f"turn {i}: {what} must be text, got {type(value).__name__}")
    return value


def _json(value: Any, what: str) -> Any:
    """A field given as JSON text (ShareGPT keeps `tools` and calls as strings) or as is."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ConversationError(f"{what} is not valid JSON ({e.msg})") from None


def _tool_calls(value: Any, i: int) -> list[dict[str, Any]]:
    """OpenAI's `tool_calls` shape from OpenAI's own or a ShareGPT `function_call` value."""
    calls = _json(value, f"turn {i}: tool call")
    calls = calls if isinstance(calls, list) else [calls]
    out = []
    for c in calls:
        f = c.get("function", c) if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ConversationError(f"turn {i}: a tool call needs a function name")
        # parsed, as vLLM parses them before it renders history (and speculators' prepare-data
        # renders through vLLM): the template writes the object back (`tojson`), so the context is
        # the one the served verifier sees whatever spacing the text had
        args = _json(f.get("arguments", f.get("parameters")) or {}, f"turn {i}: tool call arguments")
        if not isinstance(args, dict):
            raise ConversationError(f"turn {i}: tool call arguments must be a JSON object")
        call: dict[str, Any] = {"type": "function", "function": {"name": f["name"], "arguments": args}}
        if isinstance(c.get("id"), str):
            call["id"] = c["id"]
        out.append(call)
    return out


def _served_tool(t: Any) -> dict[str, Any]:
    """A tool schema as vLLM hands it to the template: its request model keeps `type` and `function`
    {name, description, parameters (both null when absent), strict and defer_loading when set}, drops
    other keys, in that order (entrypoints/openai/chat_completion/protocol.py ChatCompletionToolsParam
    and FunctionDefinition). The served verifier sees that text; a ShareGPT set's bare function
    schema is wrapped the same way (vLLM accepts no other shape)."""
    if not isinstance(t, dict):
        raise ConversationError("tools must be a list of tool schemas (objects)")
    if t.get("type", "function") != "function":
        raise ConversationError(f"tools: only function tools render (got type {t.get('type')!r})")
    f = t.get("function", t)
    if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
        raise ConversationError("tools: a tool schema needs a function name")
    if not isinstance(f.get("description"), str | None) or not isinstance(f.get("parameters"), dict | None):
        raise ConversationError(f"tools: {f['name']}: description must be text and parameters an object")
    fn = {"name": f["name"], "description": f.get("description"), "parameters": f.get("parameters")}
    fn.update({k: f[k] for k in ("strict", "defer_loading") if f.get(k) is not None})
    return {"type": "function", "function": fn}


def row_tools(row: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The row's tool schemas (`tools`: a list, or its JSON text as ShareGPT sets keep it) as vLLM
    renders them (_served_tool), or None."""
    tools = _json(row.get("tools"), "tools") if row.get("tools") else None
    if tools is not None and not isinstance(tools, list):
        raise ConversationError("tools must be a list of tool schemas (objects)")
    return [_served_tool(t) for t in tools] or None if tools else None


def row_format(row: Any) -> str | None:
    """Which of the formats the reader accepts a row is in (FORMATS' names), or None."""
    if isinstance(row, dict):
        return next((name for key, name in FORMATS.items() if key in row
                     and (key != "completion" or "prompt" in row)), None)
    return None


def _turn(t: Any, i: int) -> dict[str, Any]:
    if not isinstance(t, dict):
        raise ConversationError(f"turn {i}: expected an object, got {type(t).__name__}")
    role = t.get("role", t.get("from"))
    if not isinstance(role, str) or role.lower() not in ROLE_ALIASES:
        raise ConversationError(f"turn {i}: unknown role {role!r}")
    if role.lower() == "function_call":  # ShareGPT: the turn's value is the call itself
        return {"role": "assistant", "content": "", "tool_calls": _tool_calls(t.get("value", t.get("content")), i)}
    role = ROLE_ALIASES[role.lower()]
    content = _text(t.get("content", t.get("value")), "content", i) or ""
    msg: dict[str, Any] = {"role": role, "content": content}
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if isinstance(t.get(key), str):
                msg[key] = t[key]
    if role != "assistant":
        return msg
    if t.get("tool_calls"):
        msg["tool_calls"] = _tool_calls(t["tool_calls"], i)
    reasoning = _text(t.get("reasoning_content"), "reasoning_content", i)
    if reasoning is None:
        reasoning = _text(t.get("reasoning"), "reasoning", i)
    inline, rest, unclosed = split_reasoning(content)  # an unclosed reply keeps its raw text
    if inline is not None:
        if reasoning:
            raise ConversationError(f"turn {i}: reasoning given twice (a reasoning field and inline <think>)")
        reasoning, msg["content"] = inline, rest
    elif reasoning is not None:
        reasoning, msg["content"] = canonical_reasoning(reasoning, content)
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    if unclosed:
        msg[UNCLOSED] = True
    ids = t.get("token_ids")  # the verifier's own tokens of this reply (regen keeps them)
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                for x in ids):
            raise ConversationError(f"turn {i}: token_ids must be a list of token ids")
        msg["token_ids"] = ids
    if isinstance(t.get("finish_reason"), str):
        msg["finish_reason"] = t["finish_reason"]
    return msg


def _as_turns(value: Any, role: str, what: str) -> list[Any]:
    """TRL's prompt or completion: a message list (conversational) or a string (plain)."""
    if isinstance(value, list):
        return value
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    raise ConversationError(f"'{what}' must be text or a list of messages, got {type(value).__name__}")


def _alpaca_turns(row: dict[str, Any]) -> list[dict[str, Any]]:
    """Alpaca: the instruction (and its input, on the next line, as LLaMA-Factory joins them) is the
    user turn, `output` the reply; `history` [[question, answer], ...] comes before them."""
    instruction, extra, output = row.get("instruction"), row.get("input") or "", row.get("output")
    if not isinstance(instruction, str) or not isinstance(extra, str):
        raise ConversationError("Alpaca row: 'instruction' and 'input' must be text")
    turns = []
    for pair in row.get("history") or ():
        if not (isinstance(pair, list | tuple) and len(pair) == 2):
            raise ConversationError("Alpaca row: 'history' must be [[question, answer], ...]")
        turns += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    turns.append({"role": "user", "content": "\n".join(filter(None, (instruction, extra)))})
    if output is not None:
        turns.append({"role": "assistant", "content": output})
    return turns


def row_turns(row: dict[str, Any]) -> list[Any]:
    """The raw turns of a row in any of FORMATS, its top-level `system` (ShareGPT's, Alpaca's) first."""
    fmt = row_format(row)
    if fmt in ("ShareGPT", "OpenAI messages"):
        turns = row.get("conversations", row.get("messages"))
    elif fmt == "TRL prompt/completion":
        turns = [*_as_turns(row["prompt"], "user", "prompt"), *_as_turns(row["completion"], "assistant", "completion")]
    elif fmt == "Alpaca":
        turns = _alpaca_turns(row)
    elif fmt == "prompt/response":
        turns = [{"role": "user", "content": row["prompt"]}]
        if row.get("response") is not None:
            turns.append({"role": "assistant", "content": row["response"]})
    else:
        raise ConversationError("no 'conversations', 'messages', 'prompt' or 'instruction' field (docs/DATA.md)")
    if not isinstance(turns, list) or not turns:
        raise ConversationError("conversation is empty or not a list")
    system = row.get("system")
    if system is not None and system != "":
        if not isinstance(system, str):
            raise ConversationError("'system' must be text")
        first = turns[0] if isinstance(turns[0], dict) else {}
        if str(first.get("role", first.get("from"))).lower() == "system":
            raise ConversationError("system prompt given twice (a top-level 'system' and a system turn)")
        turns = [{"role": "system", "content": system}, *turns]
    return turns


def normalize(row: Any) -> list[dict[str, Any]]:
    """Messages of one row; raises ConversationError when the row is unusable."""
    if not isinstance(row, dict):
        raise ConversationError(f"row must be an object, got {type(row).__name__}")
    msgs = [_turn(t, i) for i, t in enumerate(row_turns(row))]
    if not any(m["role"] == "user" for m in msgs):
        raise ConversationError("no user turn")
    if empty := [i for i, m in enumerate(msgs) if m["role"] == "user" and not m["content"].strip()]:
        raise ConversationError(f"turn {empty[0]}: empty user turn (the verifier would answer nothing)")
    # regen rows record one finish reason per generated (assistant) turn in metadata
    meta = row.get("metadata")
    finish = meta.get("finish_reasons") if isinstance(meta, dict) else None
    replies = [m for m in msgs if m["role"] == "assistant"]
    if isinstance(finish, list) and len(finish) == len(replies):
        for m, f in zip(replies, finish):
            if isinstance(f, str):
                m.setdefault("finish_reason", f)
    return msgs


def truncation(messages: list[dict[str, Any]]) -> str | None:
    """The reason a conversation holds a reply the model did not finish, or None."""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if m.get("finish_reason") == "length":
            return "truncated reply (finish_reason: length; data.keep_truncated keeps it)"
        if m.get(UNCLOSED):
            return "truncated reply (reasoning never closed; data.keep_truncated keeps it)"
    return None


def has_reasoning(messages: list[dict[str, Any]]) -> bool:
    """Whether any reply carries non-empty reasoning."""
    return any((m.get("reasoning_content") or "").strip() for m in messages if m["role"] == "assistant")


TEMPLATE_KEYS = ("role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name")


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the chat template gets: role, content, reasoning_content and the tool fields only."""
    keys = TEMPLATE_KEYS
    return [{k: m[k] for k in keys if k in m} for m in messages]


def to_sharegpt(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    back = {"user": "human", "assistant": "gpt"}
    out = []
    for m in messages:
        turn = {"from": back.get(m["role"], m["role"]), "value": m["content"]}
        if m.get("reasoning_content") is not None:
            turn["reasoning_content"] = m["reasoning_content"]
        for key in ("tool_calls", "tool_call_id", "name", "token_ids"):
            if m.get(key) is not None:
                turn[key] = m[key]
        out.append(turn)
    return out
