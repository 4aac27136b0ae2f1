"""The embedded tool-calling corpus (`data.source: builtin:tiny-tools`): agent traffic for the tiny recipe.

OpenAI-format chats over the tiny corpus's words: the row's `tools` (three function schemas),
a user request, the assistant's call(s) (`tool_calls`, one or two steps), the `tool`
results, then the assistant's answer that uses them. Built deterministically from a seed, so
the demo and the tests read the same rows; regen keeps the calls the verifier makes and
splices these results back in, prepare renders all of it with the verifier's template.
"""

from __future__ import annotations

import json
import random
from typing import Any

from dspark_kit.data.tiny_corpus import _pick, sentence


def _tool(name: str, description: str, param: str, kind: str = "string") -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {param: {"type": kind}}, "required": [param]}}}


TOOLS = [
    _tool("count_words", "Count the words of a text", "text"),
    _tool("describe_place", "Tell what is found at a place", "place"),
    _tool("rhyme_for", "Find a word that rhymes with a word", "word"),
]


def _call(i: int, name: str, **arguments: str) -> dict[str, Any]:
    return {"id": f"call_{i}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


def tool_conversation(rng: random.Random) -> dict[str, Any]:
    """One chat with `tools` and `messages`: a one-step call, or two calls in a chain."""
    kind = rng.randrange(3)
    if kind == 0:
        text = sentence(rng)
        n = len(text.rstrip(".").split())
        messages = [{"role": "user", "content": f"count the words of: {text}"},
                    {"role": "assistant", "content": None, "tool_calls": [_call(0, "count_words", text=text)]},
                    {"role": "tool", "tool_call_id": "call_0", "content": str(n)},
                    {"role": "assistant", "content": f"the text has {n} words."}]
    elif kind == 1:
        place = _pick(rng, "places")
        noun, adj = _pick(rng, "nouns"), _pick(rng, "adjectives")
        messages = [{"role": "user", "content": f"what is {place}?"},
                    {"role": "assistant", "content": None, "tool_calls": [_call(0, "describe_place", place=place)]},
                    {"role": "tool", "tool_call_id": "call_0", "content": f"a {adj} {noun}"},
                    {"role": "assistant", "content": f"{place} there is a {adj} {noun}."}]
    else:  # a chain: the second call needs the first result
        place, noun = _pick(rng, "places"), _pick(rng, "nouns")
        rhyme = _pick(rng, "nouns")
        messages = [{"role": "user", "content": f"find what is {place} and a rhyme for it."},
                    {"role": "assistant", "content": None, "tool_calls": [_call(0, "describe_place", place=place)]},
                    {"role": "tool", "tool_call_id": "call_0", "content": f"a {noun}"},
                    {"role": "assistant", "content": None, "tool_calls": [_call(1, "rhyme_for", word=noun)]},
                    {"role": "tool", "tool_call_id": "call_1", "content": rhyme},
                    {"role": "assistant", "content": f"{place} there is a {noun}; it rhymes with {rhyme}."}]
    return {"tools": TOOLS, "messages": messages}


def tool_conversations(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(f"tiny-tools-{seed}")
    return [tool_conversation(rng) for _ in range(n)]
