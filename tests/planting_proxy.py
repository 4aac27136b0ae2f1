"""A proxy in front of a real chat server that plants a behaviour in chosen replies.

Fault and behaviour injection for tests that need what one machine's verifier may not do: the
verifier's own replies pass through, except those a planter rewrites:
- `stray_reasoning`: the text before the reply's middle word moves into `reasoning_content`, as a
  server's reasoning parser (vLLM's Qwen3 parser, the local engine's) does when a hybrid model emits
  a stray `</think>` halfway through a non-thinking reply;
- `tool_call`: the reply becomes the call builtin:tiny-tools' request asks for, as a server with
  `--tool-call-parser hermes` returns it (`tool_calls`, finish_reason tool_calls).
A planted reply drops the server's `token_ids`: they belong to the text it replaced.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Callable

import aiohttp
from aiohttp import web

from dspark_kit.engines.ports import free_port

# planter(n, planted, request body, reply message) -> the planted message, or None to pass it through
Planter = Callable[[int, int, dict, dict], dict | None]


def stray_reasoning(when: Callable[[int, int], bool]) -> Planter:
    def plant(n: int, planted: int, _body: dict, msg: dict) -> dict | None:
        words = (msg.get("content") or "").split(" ")
        if len(words) < 2 or not when(n, planted):
            return None
        half = len(words) // 2
        return {**msg, "reasoning_content": " ".join(words[:half]), "content": " ".join(words[half:])}
    return plant


def _tiny_tools_call(body: dict) -> tuple[str, dict] | None:
    """The call a builtin:tiny-tools request asks for next (data/tiny_tools.py's three kinds)."""
    last = body["messages"][-1]
    text = last.get("content") or ""
    if last["role"] == "tool":  # a chain's second step: a rhyme for the noun the first result named
        return ("rhyme_for", {"word": text.split()[-1]}) if text.startswith("a ") and "rhyme" in \
            next(m["content"] for m in body["messages"] if m["role"] == "user") else None
    if m := re.fullmatch(r"count the words of: (.*)", text):
        return "count_words", {"text": m.group(1)}
    if m := re.fullmatch(r"(?:find )?what is (.*?)(?:\?| and a rhyme for it\.)", text):
        return "describe_place", {"place": m.group(1)}
    return None


def tool_call(when: Callable[[int, int], bool]) -> Planter:
    def plant(n: int, planted: int, body: dict, msg: dict) -> dict | None:
        call = _tiny_tools_call(body) if body.get("tools") else None
        if call is None or not when(n, planted):
            return None
        name, args = call
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_planted_{n}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}
    return plant


class PlantingProxy:
    def __init__(self, upstream: str, plant: Planter):
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
        choice = reply["choices"][0]
        planted = self.plant(n, self.planted, json.loads(body), choice["message"])
        if planted is not None:
            self.planted += 1
            choice["message"] = planted
            choice.pop("token_ids", None)
            if planted.get("tool_calls"):
                choice["finish_reason"] = "tool_calls"
        return web.json_response(reply)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
