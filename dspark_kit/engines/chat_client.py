"""The client side of an OpenAI-compatible chat server (vLLM, vLLM-Ascend, our local engine).

One `ChatClient` per server: a pooled aiohttp session on its `/v1` base URL.
regen posts whole replies through it (with retries and endpoint health),
bench streams them (timing every server-sent event) and scrapes `/metrics`.

Client choice: aiohttp (already a dependency), not httpx.AsyncClient or the
openai package (which is httpx underneath). Measured with
scripts/bench_regen_client.py on 2 busy cores at concurrency 64 against a
zero-latency stub: httpx managed ~120 req/s with one shared pool (httpcore
scans every pooled connection per request) and ~370 req/s with one client per
worker plus TCP_NODELAY, below the 1000 req/s target; aiohttp's pooled
session clears it. We also want the raw transport errors: the openai client's
own retries would hide connection refusals from the endpoint-health logic.

JSON both ways is orjson's (C): at a few thousand requests a second the stdlib's
encoder and decoder were a fifth of the client's time (scripts/bench_regen_client.py).

Every way a request can fail (connection, timeout, HTTP status, a body that is
not a chat completion) is one `RequestFailed` with a one-line reason; anything
else is a bug and propagates.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Self

import aiohttp
import orjson

from dspark_kit.engines import openai_base_url

RETRYABLE_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


class RequestFailed(Exception):
    """refused: the connection was refused; transport: no answer at all (refused, timeout, reset)."""

    def __init__(self, reason: str, retryable: bool = True, refused: bool = False, transport: bool = False):
        super().__init__(reason)
        self.reason, self.retryable, self.refused, self.transport = reason, retryable, refused, transport or refused


class MalformedResponse(ValueError):
    """A 200 whose body is not the chat completion (or chunk) it should be."""


class EndpointDead(Exception):
    """This endpoint left the rotation; the row goes back to the queue."""


class EndpointDown(Exception):
    """This endpoint refuses connections now and another one is up: the row goes to the queue."""


@dataclass
class ClientOptions:
    concurrency: int = 64
    timeout: float = 600.0
    max_retries: int = 5
    backoff_base: float = 0.5
    backoff_cap: float = 30.0
    dead_after: int = 5
    unavailable_timeout: float = 300.0
    api_key: str | None = None


@dataclass
class Endpoint:
    url: str  # base URL ending in /v1
    model: str | None = None
    rows: int = 0
    errors: int = 0
    refused_in_a_row: int = 0
    down_since: float | None = None  # monotonic time of the first refusal in the current run of them
    dead_reason: str | None = None
    # llama-server (GET /v1/models says owned_by "llamacpp") ignores vLLM's return_token_ids; its
    # chat completions carry each generated token's id in `logprobs` instead, when asked for them
    ids_in_logprobs: bool = False

    def others_live(self, run_eps: list[Endpoint]) -> bool:
        return any(e is not self and not e.dead_reason and e.down_since is None for e in run_eps)


def backoff(opts: ClientOptions, attempt: int) -> float:
    return min(opts.backoff_cap, opts.backoff_base * 2 ** min(attempt, 30))


@functools.cache
def _tls_context() -> ssl.SSLContext:
    return ssl.create_default_context()  # loading the CA bundle costs ~50 ms: once per process


def _transport_failure(e: Exception, timeout: float) -> RequestFailed:
    if isinstance(e, aiohttp.ClientConnectorError):
        return RequestFailed(f"connection refused ({e.__class__.__name__})", refused=True)
    if isinstance(e, (TimeoutError, aiohttp.ServerTimeoutError)):
        return RequestFailed(f"timeout after {timeout:.0f}s", transport=True)
    return RequestFailed(f"transport error: {e.__class__.__name__}: {e}", transport=True)


def _status_failure(status: int, raw: bytes) -> RequestFailed:
    return RequestFailed(f"HTTP {status}: {raw[:200].decode(errors='replace')}", status in RETRYABLE_STATUS)


def _malformed(e: ValueError) -> RequestFailed:
    return RequestFailed(f"malformed response ({e.__class__.__name__}: {str(e)[:80]})")


_JSON = {"Content-Type": "application/json"}


def _json_object(raw: bytes | str) -> dict[str, Any]:
    data = orjson.loads(raw)
    if not isinstance(data, dict):
        raise MalformedResponse(f"expected a JSON object, got {type(data).__name__}")
    return data


class ChatClient:
    """One pooled session to one server: keep-alive, TCP_NODELAY, `concurrency` sockets.

    `timeout` bounds a whole request; with `streaming` it bounds each wait for the next
    bytes instead (a long streamed reply is fine while tokens keep coming).
    """

    def __init__(self, url: str, *, concurrency: int = 64, timeout: float = 600.0, api_key: str | None = None,
                 streaming: bool = False):
        self.base = openai_base_url(url)  # .../v1
        self.root = self.base.removesuffix("/v1")  # /metrics and /health live here
        self.timeout = timeout
        limit = (aiohttp.ClientTimeout(sock_read=timeout, connect=min(10.0, timeout)) if streaming
                 else aiohttp.ClientTimeout(total=timeout, connect=min(10.0, timeout)))
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=concurrency, ssl=_tls_context()), headers=headers, timeout=limit)

    async def close(self) -> None:
        await self.session.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _answer(self, request) -> bytes:
        """A request's body when it answers 200; a transport failure or another status is RequestFailed."""
        try:
            async with request as r:
                status, raw = r.status, await r.read()
        except (TimeoutError, aiohttp.ClientError) as e:
            raise _transport_failure(e, self.timeout) from None
        if status != 200:
            raise _status_failure(status, raw)
        return raw

    async def post_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """One whole chat completion, parsed (parse_chat_response)."""
        raw = await self._answer(self.session.post(self.base + "/chat/completions", data=orjson.dumps(body),
                                                   headers=_JSON))
        try:
            return parse_chat_response(orjson.loads(raw))
        except ValueError as e:  # not JSON, not UTF-8, or not a chat completion
            raise _malformed(e) from None

    def stream_chat(self, body: dict[str, Any]) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """POST a chat completion and yield what comes back as it arrives: ("event", chunk) per
        server-sent event of a streamed reply (up to [DONE]), or one ("body", response) from a
        server that answers a single JSON body. Use it under contextlib.aclosing."""
        return self._stream("/chat/completions", body)

    def stream_completion(self, body: dict[str, Any]) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """stream_chat for /v1/completions (a text or token-id prompt)."""
        return self._stream("/completions", body)

    async def _stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        try:
            async with self.session.post(self.base + path, data=orjson.dumps(body), headers=_JSON) as r:
                if r.status != 200:
                    raise _status_failure(r.status, await r.read())
                if "text/event-stream" not in r.headers.get("content-type", ""):
                    yield "body", _json_object(await r.read())
                    return
                async for raw_line in r.content:
                    line = raw_line.decode("utf-8").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    yield "event", _json_object(data)
        except (TimeoutError, aiohttp.ClientError) as e:
            raise _transport_failure(e, self.timeout) from None
        except ValueError as e:  # a line that is not JSON (or too long for one event)
            raise _malformed(e) from None

    async def models(self) -> list[dict[str, Any]]:
        """The models GET /v1/models lists (each with a string id; OpenAI's `owned_by` names the
        server: vLLM's "vllm", llama-server's "llamacpp")."""
        raw = await self._answer(self.session.get(self.base + "/models"))
        try:
            data = _json_object(raw).get("data")
            if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str)
                                                     for m in data):
                raise MalformedResponse("data: expected a list of models with string ids")
        except ValueError as e:
            raise _malformed(e) from None
        return data

    async def model_ids(self) -> list[str]:
        """The ids GET /v1/models lists."""
        return [m["id"] for m in await self.models()]

    async def get_text(self, path: str) -> str | None:
        """GET a server path (e.g. /metrics) under the root URL: its text, None on any failure."""
        try:
            async with self.session.get(self.root + path) as r:
                return (await r.text(errors="replace")) if r.status == 200 else None
        except (TimeoutError, aiohttp.ClientError):
            return None


def _add_tool_calls(calls: dict[int, dict[str, Any]], value: Any, streamed: bool) -> None:
    """OpenAI's `tool_calls` into calls (position -> call): whole calls, or a stream's pieces (each
    names its call's `index`; the id and name come once, the arguments' text in pieces)."""
    if not isinstance(value, list):
        raise MalformedResponse("tool_calls is not a list")
    for k, c in enumerate(value):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict):
            raise MalformedResponse("a tool call has no function")
        name, args = f.get("name"), f.get("arguments")
        if not isinstance(name, str | None) or not isinstance(args, str | None):
            raise MalformedResponse("a tool call's name and arguments must be text")
        pos = c.get("index", k) if streamed else len(calls)
        call = calls.setdefault(pos, {"type": "function", "function": {"name": "", "arguments": ""}})
        if isinstance(c.get("id"), str):
            call["id"] = c["id"]
        call["function"]["name"] += name or ""
        call["function"]["arguments"] += args or ""


def _logprob_ids(logprobs: Any) -> list[Any] | None:
    """The generated ids a llama-server chat completion lists in `logprobs.content` (asked with
    `logprobs: true`): one entry per generated token, its `id` beside its text, the end-of-turn
    token included when the reply ended on it, as vLLM's return_token_ids. None when the entries
    carry no ids (OpenAI's own logprobs name tokens by text only)."""
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list) or not content or not all(isinstance(t, dict) and "id" in t for t in content):
        return None
    return [t["id"] for t in content]


def parse_chat_response(data: Any) -> dict[str, Any]:
    """text, reasoning (None when the server gave none), tool_calls (OpenAI's shape, arguments as
    the JSON text the model wrote; None when it made none), finish_reason, usage and the generated
    token_ids (None unless the server returned them: vLLM's `token_ids`, else the ids in llama-server's
    `logprobs`) of a chat completion: one response body, or the list of chunks of a streamed one (`delta`s).
    Raises MalformedResponse when the body is not one."""
    chunks = data if isinstance(data, list) else [data]
    text = reasoning = finish = token_ids = None
    calls: dict[int, dict[str, Any]] = {}
    usage: dict = {}
    seen = False
    for chunk in chunks:
        if not isinstance(chunk, dict):
            raise MalformedResponse(f"expected a JSON object, got {type(chunk).__name__}")
        usage = chunk.get("usage") or usage
        if not isinstance(usage, dict):
            raise MalformedResponse("usage is not an object")
        if not chunk.get("choices"):
            continue
        seen = True
        choices = chunk["choices"]
        choice = choices[0] if isinstance(choices, list) else None
        msg = None
        if isinstance(choice, dict):
            msg = choice.get("message") if "message" in choice or not isinstance(data, list) else choice.get("delta")
        if not isinstance(msg, dict):
            raise MalformedResponse("choices[0]: no message")
        content = msg.get("content")
        r = msg.get("reasoning_content")
        r = msg.get("reasoning") if r is None else r  # vLLM's older / newer name
        for key, value in (("content", content), ("reasoning", r)):
            if value is not None and not isinstance(value, str):
                raise MalformedResponse(f"{key} is not text")
        if msg.get("tool_calls"):
            _add_tool_calls(calls, msg["tool_calls"], isinstance(data, list))
        text = text if content is None else (text or "") + content
        reasoning = reasoning if r is None else (reasoning or "") + r
        finish = choice.get("finish_reason") or finish
        ids = choice.get("token_ids")  # vLLM with return_token_ids: the generated ids
        if ids is None:
            ids = _logprob_ids(choice.get("logprobs"))
        if ids is not None:
            if not isinstance(ids, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
                raise MalformedResponse("token_ids is not a list of token ids")
            token_ids = (token_ids or []) + ids
    if not seen:
        raise MalformedResponse("no choices")
    if text is None and reasoning is None and not calls:
        raise MalformedResponse("no content")
    if any(not c["function"]["name"] for c in calls.values()):
        raise MalformedResponse("a tool call has no function name")
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        try:
            int(usage.get(key) or 0)
        except (TypeError, ValueError):
            raise MalformedResponse(f"usage.{key} is not a number") from None
    return {"text": text or "", "reasoning": reasoning, "finish_reason": finish, "usage": usage,
            "token_ids": token_ids, "tool_calls": [calls[k] for k in sorted(calls)] or None}


async def chat_with_retries(ep: Endpoint, client: ChatClient, body: dict[str, Any], opts: ClientOptions,
                            peers: list[Endpoint] | None = None) -> dict[str, Any]:
    """One reply. Refused connections wait for the endpoint (up to unavailable_timeout) without
    using the row's retries; other failures retry max_retries times with backoff."""
    attempt = refused = 0
    while True:
        if ep.dead_reason:
            raise EndpointDead(ep.dead_reason)
        try:
            out = await client.post_chat(body)
            ep.refused_in_a_row, ep.down_since = 0, None
            return out
        except RequestFailed as e:
            if e.refused:
                now = time.monotonic()
                ep.refused_in_a_row += 1
                ep.down_since = ep.down_since or now
                down_for = now - ep.down_since
                if (ep.refused_in_a_row >= opts.dead_after and down_for >= opts.unavailable_timeout
                        and not ep.dead_reason):
                    ep.dead_reason = (f"{e.reason} {ep.refused_in_a_row} times in a row over {down_for:.1f}s "
                                      f"(regen.unavailable_timeout {opts.unavailable_timeout:g}s)")
                if ep.dead_reason:
                    raise EndpointDead(ep.dead_reason) from None
                if peers and ep.others_live(peers):
                    raise EndpointDown(e.reason) from None  # the worker backs off after requeueing
                await asyncio.sleep(backoff(opts, refused))
                refused += 1
                continue
            if not e.retryable or attempt >= opts.max_retries:
                raise
            await asyncio.sleep(backoff(opts, attempt))
            attempt += 1


async def discover_model(ep: Endpoint, client: ChatClient, opts: ClientOptions) -> None:
    """The served model id (unless the endpoint names one) and which server it is; a server still
    starting (refusing connections) is waited for up to unavailable_timeout, other failures get
    max_retries. An endpoint given its model is asked once, and kept on any failure: only the
    token ids' place (`ids_in_logprobs`) depends on the answer."""
    t0, attempt = time.monotonic(), 0
    while True:
        try:
            models = await client.models()
            if models:
                ep.model = ep.model or models[0]["id"]
                ep.ids_in_logprobs = models[0].get("owned_by") == "llamacpp"
                return
            refused, reason = False, f"GET {ep.url}/models failed: the server lists no model"
        except RequestFailed as e:
            refused, reason = e.refused, f"GET {ep.url}/models failed: {e.reason[:120]}"
        if ep.model:
            return
        attempt += 1
        if attempt > opts.max_retries and not (refused and time.monotonic() - t0 < opts.unavailable_timeout):
            break
        await asyncio.sleep(backoff(opts, attempt - 1))
    ep.dead_reason = reason + " (pass --model NAME or check the endpoint)"
