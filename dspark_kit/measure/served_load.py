"""Timed requests against a serving engine, measured as `vllm bench serve` measures them.

`chat_request` sends one chat (or completions) request, streamed when the server streams, and
times every event (TTFT, inter-token gaps, end-to-end latency, tokens from `usage`); `run_load`
sends a prompt set at a concurrency with the server's /metrics read before and after (its
speculative-decoding counters); `summarize` turns records into vLLM's bench figures (mean,
median and p99 of ttft, tpot, itl, e2el; throughputs). bench and `tune --served` measure with
these.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from dspark_kit.engines.chat_client import ChatClient, RequestFailed
from dspark_kit.engines.prom import server_delta, spec_decode_delta


class LoadError(RuntimeError):
    """The server under load cannot be reached: one line naming the endpoint and the fix."""


@dataclass
class RequestRecord:
    ok: bool = False
    error: str | None = None
    latency_s: float = 0.0
    ttft_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    streamed: bool = False
    itl_s: list[float] = field(default_factory=list)  # gaps between content chunks
    text: str = ""  # the reply's content (a later turn's history)

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.output_tokens < 1:
            return None
        if not self.streamed:  # no first-token time: whole latency over all tokens
            return self.latency_s / self.output_tokens
        if self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def _delta_text(choice: dict) -> str:
    """The text a chat chunk (delta) or a completions chunk (text) carries."""
    if isinstance(choice.get("text"), str):
        return choice["text"]
    delta = choice.get("delta") or choice.get("message") or {}
    parts = [delta.get(k) for k in ("content", "reasoning_content", "reasoning")]
    return "".join(p for p in parts if isinstance(p, str))


def _content(choice: dict) -> str:
    """The reply text (not its reasoning) a chunk or a whole body carries."""
    if isinstance(choice.get("text"), str):
        return choice["text"]
    part = (choice.get("delta") or choice.get("message") or {}).get("content")
    return part if isinstance(part, str) else ""


def _apply_usage(rec: RequestRecord, usage: dict | None) -> None:
    if usage:
        rec.output_tokens = int(usage.get("completion_tokens") or 0)
        rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)


async def chat_request(client: ChatClient, payload: dict, completion: bool = False) -> RequestRecord:
    """POST one chat completion (`completion`: a /v1/completions request), streamed when the
    server streams; times every event."""
    rec = RequestRecord()
    start = time.perf_counter()
    last = start
    chunks = 0
    try:
        send = client.stream_completion if completion else client.stream_chat
        async with aclosing(send(payload)) as events:
            async for kind, event in events:
                now = time.perf_counter()
                if kind == "body":  # the server answered one JSON body
                    rec.latency_s = rec.ttft_s = now - start
                    rec.text = "".join(_content(c) for c in event.get("choices") or [])
                    _apply_usage(rec, event.get("usage"))
                    rec.ok = True
                    return rec
                rec.streamed = True
                if "error" in event:
                    rec.error = str(event["error"])[:200]
                    return rec
                rec.text += "".join(_content(c) for c in event.get("choices") or [])
                if any(_delta_text(c) for c in event.get("choices") or []):
                    chunks += 1
                    if rec.ttft_s is None:
                        rec.ttft_s = now - start
                    else:
                        rec.itl_s.append(now - last)
                    last = now
                _apply_usage(rec, event.get("usage"))
        rec.latency_s = time.perf_counter() - start
        if rec.ttft_s is None:
            rec.ttft_s = rec.latency_s
        if rec.output_tokens == 0:  # no usage chunk: one token per chunk is the best guess
            rec.output_tokens = chunks
        rec.ok = True
    except RequestFailed as e:
        rec.error = e.reason[:200]
    return rec


def _rejects_streaming(rec: RequestRecord) -> bool:
    """A 400 that names `stream`: the server only answers whole JSON bodies."""
    return bool(rec.error and rec.error.startswith("HTTP 400") and "stream" in rec.error.lower())


async def run_load(base_url: str, model: str | None, prompts: list[list[dict[str, str]]], *,
                   concurrency: int, max_tokens: int, temperature: float, thinking: bool,
                   timeout: float = 600.0, preferred_model: str = "",
                   follow_ups: list[list[str]] | None = None) -> dict[str, Any]:
    """Send every prompt with at most `concurrency` in flight; returns records + metrics.

    No `model`: `preferred_model` when the server lists it, else the server's first model.
    `follow_ups[i]`: prompt i's later user turns, each sent after the server's reply to the one
    before (MT-Bench's second turn), inside the same /metrics window; one record per request."""
    async with ChatClient(base_url, concurrency=concurrency + 4, timeout=timeout, streaming=True) as client:
        try:
            ids = await asyncio.wait_for(client.model_ids(), 10)
        except (RequestFailed, TimeoutError) as e:
            if isinstance(e, RequestFailed) and not e.transport:
                ids = []  # it answers: the model list is optional
            else:
                raise LoadError(f"--endpoint {base_url}: server not reachable "
                                 f"({getattr(e, 'reason', None) or 'no answer in 10 s'}); "
                                 "start it with `dspark-kit serve` or pass the right --endpoint") from None
        model = model or (preferred_model if preferred_model in ids or not ids else ids[0])
        before = await client.get_text("/metrics")
        sem = asyncio.Semaphore(concurrency)
        use_stream = [True]  # flipped once if the server rejects streaming

        async def one(msgs: list[dict[str, str]]) -> RequestRecord:
            payload = {
                "model": model, "messages": msgs, "max_tokens": max_tokens,
                "temperature": temperature,
                "chat_template_kwargs": {"enable_thinking": thinking},
            }
            streamed = {"stream": True, "stream_options": {"include_usage": True}}
            async with sem:
                if use_stream[0]:
                    rec = await chat_request(client, payload | streamed)
                    if not _rejects_streaming(rec):
                        return rec
                    use_stream[0] = False
                return await chat_request(client, payload)

        async def conversation(i: int, msgs: list[dict[str, str]]) -> list[RequestRecord]:
            out = [await one(msgs)]
            for turn in (follow_ups[i] if follow_ups and i < len(follow_ups) else []):
                if not out[-1].ok:
                    break  # no reply to continue from
                msgs = [*msgs, {"role": "assistant", "content": out[-1].text}, {"role": "user", "content": turn}]
                out.append(await one(msgs))
            return out

        t0 = time.perf_counter()
        records = [r for rs in await asyncio.gather(*(conversation(i, p) for i, p in enumerate(prompts))) for r in rs]
        duration = time.perf_counter() - t0
        after = await client.get_text("/metrics")
    scraped = before is not None and after is not None
    spec = spec_decode_delta(before, after) if scraped else None
    server = server_delta(before, after, duration) if scraped else None
    return {"model": model, "records": records, "duration_s": duration,
            "spec_decode": spec, "server_metrics": server, "metrics_available": after is not None}


def _stats(prefix: str, values_s: list[float]) -> dict[str, float | None]:
    ms = sorted(v * 1000.0 for v in values_s)
    if not ms:
        return {f"mean_{prefix}_ms": None, f"median_{prefix}_ms": None, f"p99_{prefix}_ms": None}
    p99 = ms[min(len(ms) - 1, max(0, round(0.99 * (len(ms) - 1))))]
    return {f"mean_{prefix}_ms": statistics.fmean(ms), f"median_{prefix}_ms": statistics.median(ms),
            f"p99_{prefix}_ms": p99}


def summarize(records: list[RequestRecord], duration_s: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration_s,
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else None,
        "output_throughput": out_tokens / duration_s if duration_s > 0 else None,
        "streamed": bool(ok) and all(r.streamed for r in ok),
    }
    summary |= _stats("ttft", [r.ttft_s for r in ok if r.ttft_s is not None])
    summary |= _stats("tpot", [t for r in ok if (t := r.tpot_s) is not None])
    summary |= _stats("itl", [g for r in ok for g in r.itl_s])
    summary |= _stats("e2el", [r.latency_s for r in ok])
    return summary
