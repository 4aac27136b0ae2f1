"""`stream: true` on the local engine: server-sent events in vLLM's shape.

Each event is `data: <json>\\n\\n`; the stream ends with `data: [DONE]`. Chat
chunks are `chat.completion.chunk` objects whose first delta carries the role,
completions chunks are `text_completion` objects with a `text` piece; the last
piece carries `finish_reason`. With `stream_options.include_usage` one more
chunk follows with `choices: []` and the usage (with `continuous_usage_stats`,
every chunk carries the usage so far too). An error after the stream started
is one `data: {"error": ...}` event, then `[DONE]`, as vLLM sends it.

Text is released as soon as it is final: the decoded text of all tokens so
far, minus what a stop string or a reasoning marker could still change (a
trailing partial character, the last len(stop) - 1 characters, a partial
`<think>`/`</think>` or Harmony channel marker: the parser's format's `markers`). The pieces concatenate to exactly the text a
non-streamed request returns: the last event sends the rest of that text.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from dspark_kit.engines.local.api import error_body


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def _held_back(text: str, stops: list[str], tags: tuple[str, ...]) -> int:
    """How many trailing characters of `text` may still change or be cut."""
    n = len(text) - len(text.rstrip("\ufffd"))  # an incomplete UTF-8 character decodes as U+FFFD
    longest = max((len(s) for s in stops if s), default=0)
    n = max(n, min(len(text), longest - 1)) if longest else n
    for tag in tags:  # a partial tag at the end: wait for the rest
        for k in range(len(tag) - 1, 0, -1):
            if text.endswith(tag[:k]):
                n = max(n, k)
                break
    return n


class TextStream:
    """Releases the final prefix of a growing decoded text, split into fields by `split`."""

    def __init__(self, decode: Callable[[list[int]], str], stop_ids: frozenset[int], stops: list[str],
                 field: str = "text", split: Callable[[str], dict[str, str | None]] | None = None):
        """`field`: where the text goes (chat: content, completions: text); `split`: a reasoning
        format's split_reply (data/reasoning_formats.py), giving content / reasoning_content instead."""
        self.decode, self.stop_ids, self.stops, self.field, self.split = decode, stop_ids, stops, field, split
        fmt = getattr(split, "__self__", None)  # the format a bound split_reply belongs to
        self.markers: tuple[str, ...] = fmt.markers if fmt is not None else ()
        self.tokens: list[int] = []
        self.sent: dict[str, str] = {}

    def _fields(self, text: str) -> dict[str, str]:
        if self.split is None:
            return {self.field: text}
        return {k: v for k, v in self.split(text).items() if k != "reasoning" and v}

    def _delta(self, text: str) -> dict[str, str]:
        out = {}
        for key, value in self._fields(text).items():
            sent = self.sent.get(key, "")
            if value.startswith(sent) and len(value) > len(sent):  # never take back what was sent
                out[key] = value[len(sent):]
                self.sent[key] = value
        return out

    def push(self, tokens: list[int]) -> dict[str, str]:
        self.tokens += tokens
        shown = [t for t in self.tokens if t not in self.stop_ids]  # a stop token ends the output, shown nowhere
        text = self.decode(shown)
        hits = [text.index(s) for s in self.stops if s and s in text]
        if hits:
            text = text[: min(hits)]
        else:
            text = text[: len(text) - _held_back(text, self.stops, self.markers)]
        return self._delta(text)

    def finish(self, final_text: str) -> dict[str, str]:
        """The rest of the reply as the non-streamed answer has it."""
        return self._delta(final_text)


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def stream_events(tokens: AsyncIterator[list[int] | dict], text: TextStream, *, chat: bool, rid: str,
                        created: int, model: str, prompt_ids: list[int], req) -> AsyncIterator[str]:
    """SSE lines for one request, from Engine.stream's token runs and its final result."""
    head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model}
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = include_usage and bool(opts.continuous_usage_stats)
    produced, pending = 0, []

    def chunk(piece: dict[str, str], finish: str | None = None, first: bool = False,
              token_ids: list[int] | None = None) -> dict[str, Any]:
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            for key, value in piece.items():
                delta[key] = value
                if key == "reasoning_content":
                    delta["reasoning"] = value  # vLLM's newer name of the same text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": piece.get("text", ""), "logprobs": None, "finish_reason": finish}
        if req.return_token_ids and token_ids is not None:
            choice["token_ids"] = token_ids
        body = {**head, "choices": [choice]}
        if first and req.return_token_ids:
            body["prompt_token_ids"] = prompt_ids
        if continuous:
            body["usage"] = _usage(len(prompt_ids), produced)
        return body

    try:
        if chat:
            yield sse(chunk({}, first=True, token_ids=[]))
        final = None
        async for item in tokens:
            if isinstance(item, dict):  # the whole result: the rest of the text and the finish reason
                final = item
                break
            produced += len(item)
            pending += item  # token ids go out with the text they make (held-back text: later)
            piece = text.push(item)
            if piece:
                yield sse(chunk(piece, token_ids=pending))
                pending = []
        if final is None:
            raise RuntimeError("decoding ended without a result")
        last = chunk(text.finish(final["text"]), finish=final["finish_reason"], token_ids=pending)
        last["choices"][0]["stop_reason"] = None  # vLLM's field (a matched stop string); always null here
        if "spec_decode" in final:  # the engine's own per-request count (a dspark-kit extension)
            last["spec_decode"] = final["spec_decode"]
        yield sse(last)
        if include_usage:
            yield sse({**head, "choices": [], "usage": _usage(len(prompt_ids), len(final["token_ids"]))})
    except Exception as e:  # noqa: BLE001 - the stream has started: report in-band, as vLLM does
        yield sse(error_body(500, f"{type(e).__name__}: {e}", "InternalServerError"))
    yield sse("[DONE]")
