"""The local engine's guard counts a request in flight until, and not after, its last byte.

A client that holds the whole reply must never see its request still counted: a test (or a
client polling /metrics) that reads `in_flight` right after a response would otherwise race the
server's bookkeeping. No model and no server here: the guard wraps a plain ASGI app.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from dspark_kit.engines.local.api import Guard
from dspark_kit.engines.prom import EngineMetrics


def _engine():
    return SimpleNamespace(args=SimpleNamespace(api_key=None, max_concurrency=4), in_flight=0,
                           metrics=EngineMetrics("tiny", spec=False))


def _serve_one(engine, app, method: str = "POST") -> list[tuple[str, bool, int]]:
    """One request through the guard: each message the client is sent, with `in_flight` as the
    server had it when the message went out."""
    sent: list[tuple[str, bool, int]] = []
    scope = {"type": "http", "method": method, "path": "/v1/completions", "headers": []}

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        sent.append((message["type"], message.get("more_body", False), engine.in_flight))

    asyncio.run(Guard(app, engine)(scope, receive, send))
    return sent


def _app(chunks: int, work_after_reply: bool = False):
    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(chunks):
            await send({"type": "http.response.body", "body": b"x", "more_body": i < chunks - 1})
        if work_after_reply:  # e.g. a streaming response's own cleanup after its last byte
            await asyncio.sleep(0)
    return app


def test_request_leaves_in_flight_before_its_last_byte():
    engine = _engine()
    sent = _serve_one(engine, _app(chunks=3, work_after_reply=True))
    assert sent == [("http.response.start", False, 1), ("http.response.body", True, 1),
                    ("http.response.body", True, 1), ("http.response.body", False, 0)]
    assert engine.in_flight == 0  # counted down once, not again when the app returns
    assert _serve_one(engine, _app(chunks=1))[-1] == ("http.response.body", False, 0)
    assert engine.in_flight == 0


def test_request_that_fails_or_is_not_counted_leaves_the_count_as_it_was():
    engine = _engine()

    async def broken(scope, receive, send):
        raise RuntimeError("the app failed before answering")

    try:
        _serve_one(engine, broken)
    except RuntimeError:
        pass
    assert engine.in_flight == 0
    assert _serve_one(engine, _app(chunks=1), method="GET")[-1] == ("http.response.body", False, 0)
    assert engine.in_flight == 0
