"""A proxy in front of a real chat server that plants a stray reasoning block in chosen replies.

Fault injection for the replies-vs-thinking-mode rule (data/mode_rule.py): the verifier's own reply
passes through, except that for planted requests the text before its middle word moves into
`reasoning_content`, as a server's reasoning parser (vLLM's Qwen3 parser, the local engine's) does
when a hybrid model emits a stray `</think>` halfway through a non-thinking reply.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import aiohttp
from aiohttp import web

from dspark_kit.engines.ports import free_port


class PlantingProxy:
    def __init__(self, upstream: str, plant: Callable[[int, int], bool]):
        # plant(n, planted): whether to plant in the n-th chat reply (0-based), `planted` planted so far
        self.upstream, self.plant = upstream.rstrip("/"), plant
        self.requests = self.planted = 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        assert ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.forward)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        ready.set()
        self.loop.run_forever()

    async def forward(self, request: web.Request) -> web.Response:
        body = await request.read()
        async with aiohttp.ClientSession() as s, s.request(
                request.method, self.upstream.removesuffix("/v1") + request.path_qs, data=body,
                headers={"Content-Type": request.content_type}) as up:
            if request.path != "/v1/chat/completions" or up.status != 200:
                return web.Response(body=await up.read(), status=up.status, content_type=up.content_type)
            reply = await up.json()
        n, self.requests = self.requests, self.requests + 1
        msg = reply["choices"][0]["message"]
        words = (msg.get("content") or "").split(" ")
        if len(words) > 1 and self.plant(n, self.planted):
            self.planted += 1
            half = len(words) // 2
            msg["reasoning_content"] = " ".join(words[:half])
            msg["content"] = " ".join(words[half:])
        return web.json_response(reply)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
