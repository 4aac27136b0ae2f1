"""Stage 0: regenerate assistant turns with the verifier itself.

Client choice: aiohttp (already a dependency), not httpx.AsyncClient or the
openai package (which is httpx underneath). Measured with
scripts/bench_regen_client.py on 2 busy cores at concurrency 64 against a
zero-latency stub: httpx managed ~120 req/s with one shared pool (httpcore
scans every pooled connection per request) and ~370 req/s with one client per
worker plus TCP_NODELAY, below the 1000 req/s target; aiohttp's pooled
session clears it. We also want the raw transport errors: the openai client's
own retries would hide connection refusals from the endpoint-health logic.

Per conversation: user/system turns kept, original assistant turns dropped,
each reply regenerated in order with the new replies as history.
`concurrency` workers per endpoint pull rows from one queue (faster servers
take more); an endpoint refusing connections `dead_after` times in a row
leaves the rotation and its in-flight rows are requeued. Output is append-only
jsonl, one complete line per row, flushed, fsync'ed every `fsync_every` rows
(streamed, not temp+rename: a crash keeps finished rows); `resume` cuts a
partial last line and skips every idx present. Rows that exhaust their retries
go to `<outfile>.errors.jsonl`.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import os
import ssl
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from dspark_kit.data.conversations import to_sharegpt
from dspark_kit.engines import openai_base_url as normalize_endpoint
from dspark_kit.recipe import Recipe

RETRYABLE_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


class RequestFailed(Exception):
    def __init__(self, reason: str, retryable: bool = True, refused: bool = False):
        super().__init__(reason)
        self.reason, self.retryable, self.refused = reason, retryable, refused


class EndpointDead(Exception):
    """This endpoint left the rotation; the row goes back to the queue."""


@dataclass
class RegenOptions:
    concurrency: int = 64
    max_tokens: int = 8192
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = 42
    thinking: bool = False
    model: str | None = None
    timeout: float = 600.0
    max_retries: int = 5
    backoff_base: float = 0.5
    backoff_cap: float = 30.0
    dead_after: int = 5
    fsync_every: int = 32
    api_key: str | None = None


@dataclass
class Endpoint:
    url: str  # base URL ending in /v1
    model: str | None = None
    rows: int = 0
    errors: int = 0
    refused_in_a_row: int = 0
    dead_reason: str | None = None


# ---- output file: append-only jsonl with crash repair -----------------------


def prepare_outfile(path: Path, resume: bool) -> tuple[set[int], dict[str, int]]:
    """Done idx set; on resume cut a partial last line and drop unparsable lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    info = {"truncated_bytes": 0, "dropped_lines": 0}
    if not resume or not path.exists():
        path.write_bytes(b"")
        return set(), info
    data = path.read_bytes()
    keep = data[: data.rfind(b"\n") + 1]  # up to the last complete line (or nothing)
    info["truncated_bytes"] = len(data) - len(keep)
    done: set[int] = set()
    good: list[bytes] = []
    for line in keep.splitlines(keepends=True):
        try:
            done.add(int(json.loads(line)["metadata"]["idx"]))
            good.append(line)
        except (ValueError, KeyError, TypeError):
            info["dropped_lines"] += 1
    if info["truncated_bytes"] or info["dropped_lines"]:
        tmp = path.with_name(path.name + ".repair")
        tmp.write_bytes(b"".join(good))
        os.replace(tmp, path)
    return done, info


class JsonlSink:
    """One complete line per write; flush always, fsync every N lines."""

    def __init__(self, path: Path, fsync_every: int):
        self.f = path.open("a", encoding="utf-8")
        self.fsync_every, self.unsynced = max(1, fsync_every), 0

    def write(self, obj: dict[str, Any]) -> None:
        self.f.write(json.dumps(obj, ensure_ascii=False) + "\n")
        self.f.flush()
        self.unsynced += 1
        if self.unsynced >= self.fsync_every:
            self.sync()

    def sync(self) -> None:
        os.fsync(self.f.fileno())
        self.unsynced = 0

    def close(self) -> None:
        self.sync()
        self.f.close()


# ---- one request, one conversation ------------------------------------------


async def _post_chat(client: aiohttp.ClientSession, ep: Endpoint, body: dict[str, Any],
                     opts: RegenOptions) -> dict[str, Any]:
    try:
        async with client.post(ep.url + "/chat/completions", json=body) as r:
            status, raw = r.status, await r.read()
    except aiohttp.ClientConnectorError as e:
        raise RequestFailed(f"connection refused ({e.__class__.__name__})", refused=True) from None
    except (TimeoutError, aiohttp.ServerTimeoutError):
        raise RequestFailed(f"timeout after {opts.timeout:.0f}s") from None
    except aiohttp.ClientError as e:
        raise RequestFailed(f"transport error: {e.__class__.__name__}: {e}") from None
    if status != 200:
        text = raw[:200].decode(errors="replace")
        raise RequestFailed(f"HTTP {status}: {text}", status in RETRYABLE_STATUS)
    try:
        data = json.loads(raw)
        choice = data["choices"][0]
        text = choice["message"]["content"]
        if not isinstance(text, str):
            raise TypeError("content is not text")
        return {"text": text, "finish_reason": choice.get("finish_reason"), "usage": data.get("usage") or {}}
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise RequestFailed(f"malformed response ({e.__class__.__name__}: {str(e)[:80]})") from None


async def chat_with_retries(ep: Endpoint, client, body: dict[str, Any], opts: RegenOptions) -> dict[str, Any]:
    attempt = 0
    while True:
        if ep.dead_reason:
            raise EndpointDead(ep.dead_reason)
        try:
            out = await _post_chat(client, ep, body, opts)
            ep.refused_in_a_row = 0
            return out
        except RequestFailed as e:
            if e.refused:
                ep.refused_in_a_row += 1
                if ep.refused_in_a_row >= opts.dead_after and not ep.dead_reason:
                    ep.dead_reason = f"{e.reason} {ep.refused_in_a_row} times in a row"
            if not e.retryable or attempt >= opts.max_retries:
                raise
            await asyncio.sleep(min(opts.backoff_cap, opts.backoff_base * 2**attempt))
            attempt += 1


async def regenerate(ep: Endpoint, client, idx: int, messages: list[dict], opts: RegenOptions) -> dict[str, Any]:
    """The output row for one conversation."""
    history: list[dict[str, str]] = []
    finish: list[str | None] = []
    usage = Counter()

    async def reply() -> None:
        body = {"model": ep.model, "messages": history, "max_tokens": opts.max_tokens,
                "temperature": opts.temperature, "top_p": opts.top_p,
                "chat_template_kwargs": {"enable_thinking": opts.thinking}}
        if opts.seed is not None:
            body["seed"] = opts.seed + idx * 1000 + len(finish)
        out = await chat_with_retries(ep, client, body, opts)
        history.append({"role": "assistant", "content": out["text"]})
        finish.append(out["finish_reason"])
        for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
            usage[k] += int(out["usage"].get(k) or 0)

    for m in messages:
        if m["role"] != "assistant":
            history.append(m)
        elif history and history[-1]["role"] != "assistant":
            await reply()  # one new reply where the original had one
    if history[-1]["role"] == "user":
        await reply()  # the source ends on a question: answer it too
    return {"id": f"regen-{idx}", "conversations": to_sharegpt(history),
            "metadata": {"idx": idx, "finish_reasons": finish, "usage": dict(usage),
                         "endpoint": ep.url, "model": ep.model, "thinking": opts.thinking}}


@functools.cache
def _tls_context() -> ssl.SSLContext:
    return ssl.create_default_context()  # loading the CA bundle costs ~50 ms: once per process


def new_session(opts: RegenOptions) -> aiohttp.ClientSession:
    """One pooled session per endpoint: keep-alive, TCP_NODELAY, `concurrency` sockets."""
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=opts.concurrency, ssl=_tls_context()), headers=headers,
        timeout=aiohttp.ClientTimeout(total=opts.timeout, connect=min(10.0, opts.timeout)))


async def discover_model(ep: Endpoint, client: aiohttp.ClientSession, opts: RegenOptions) -> None:
    for attempt in range(opts.max_retries + 1):
        try:
            async with client.get(ep.url + "/models") as r:
                r.raise_for_status()
                ep.model = (await r.json(content_type=None))["data"][0]["id"]
            return
        except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, IndexError) as e:
            reason = f"GET {ep.url}/models failed: {e.__class__.__name__}: {str(e)[:120]}"
        await asyncio.sleep(min(opts.backoff_cap, opts.backoff_base * 2**attempt))
    ep.dead_reason = reason + " (pass --model NAME or check the endpoint)"


# ---- the run -----------------------------------------------------------------


@dataclass
class _Run:
    opts: RegenOptions
    endpoints: list[Endpoint]
    sink: JsonlSink
    errors: JsonlSink
    on_row: Callable[[dict[str, Any]], None] | None
    queue: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(maxsize=4096))
    written: int = 0
    failed: int = 0
    completion_tokens: int = 0

    def live(self) -> list[Endpoint]:
        return [e for e in self.endpoints if not e.dead_reason]

    def fail(self, idx: int, ep: Endpoint, reason: str) -> None:
        self.failed += 1
        ep.errors += 1
        self.errors.write({"idx": idx, "endpoint": ep.url, "reason": reason, "time": time.time()})
        if self.on_row:
            self.on_row({"idx": idx, "error": reason, "endpoint": ep.url})

    async def worker(self, ep: Endpoint, client: aiohttp.ClientSession) -> None:
        while not ep.dead_reason:
            item = await self.queue.get()
            if item is None:
                self.queue.task_done()
                return
            idx, messages = item
            try:
                row = await regenerate(ep, client, idx, messages, self.opts)
            except EndpointDead as e:
                if self.live():
                    await self.queue.put(item)  # another endpoint takes it
                else:
                    self.fail(idx, ep, f"no live endpoint left ({e})")
            except RequestFailed as e:
                self.fail(idx, ep, e.reason)
            except Exception as e:  # noqa: BLE001 - one odd row must not stop the run
                self.fail(idx, ep, f"{e.__class__.__name__}: {e}")
            else:
                self.sink.write(row)
                self.written += 1
                ep.rows += 1
                self.completion_tokens += row["metadata"]["usage"].get("completion_tokens", 0)
                if self.on_row:
                    self.on_row(row)
            self.queue.task_done()


async def regen_rows(rows, endpoints: list[str], outfile: Path, opts: RegenOptions,
                     done: set[int], on_row=None) -> dict[str, Any]:
    """Regenerate `rows` ((idx, messages) iterable) over `endpoints` into outfile."""
    eps = [Endpoint(normalize_endpoint(u), model=opts.model) for u in endpoints]
    run = _Run(opts, eps, JsonlSink(outfile, opts.fsync_every),
               JsonlSink(outfile.with_name(outfile.name + ".errors.jsonl"), 1), on_row)
    skipped_done = 0
    sessions = {ep.url: new_session(opts) for ep in eps}
    try:
        await asyncio.gather(*(discover_model(ep, sessions[ep.url], opts) for ep in eps if not ep.model))
        workers = [asyncio.create_task(run.worker(ep, sessions[ep.url]))
                   for ep in run.live() for _ in range(opts.concurrency)]

        async def feed() -> None:
            nonlocal skipped_done
            try:
                for idx, messages in rows:
                    if idx in done:
                        skipped_done += 1
                        continue
                    await run.queue.put((idx, messages))
                await run.queue.join()  # requeued rows included
            finally:  # also when reading the source fails: workers must not wait forever
                for _ in workers:
                    await run.queue.put(None)

        feeder = asyncio.create_task(feed())
        await asyncio.gather(*workers)  # ends on sentinels, or when every endpoint died
        if feeder.done() and feeder.exception():
            raise feeder.exception()
        feeder.cancel()
    finally:
        run.sink.close()
        run.errors.close()
        for session in sessions.values():
            await session.close()
    return {
        "written": run.written, "failed": run.failed, "skipped_already_done": skipped_done,
        "completion_tokens": run.completion_tokens,
        "endpoints": [{"url": e.url, "model": e.model, "rows": e.rows, "errors": e.errors,
                       "dead": e.dead_reason} for e in eps],
        "all_endpoints_dead": not run.live(),
    }


def run_regen(recipe: Recipe, outfile: str | Path, endpoints: list[str] | None = None,
              limit: int | None = None, resume: bool = True, dataset: str | None = None,
              model: str | None = None, concurrency: int | None = None, max_tokens: int | None = None,
              temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
              api_key: str | None = None, on_row: Callable[[dict[str, Any]], None] | None = None,
              engine_log: str | Path | None = None, **opt_overrides: Any) -> dict[str, Any]:
    """Regenerate recipe.data into outfile; returns a JSON-able summary.

    Endpoints: the argument, else recipe.regen.endpoints, else a local engine
    (plan_local role chat) started for the run and stopped after it.
    """
    from dspark_kit.data.sources import iter_source

    cfg = recipe.regen
    data = recipe.data.model_copy(update={"source": dataset}) if dataset else recipe.data
    opts = RegenOptions(
        concurrency=concurrency or cfg.concurrency, max_tokens=max_tokens or cfg.max_tokens,
        temperature=cfg.temperature if temperature is None else temperature,
        top_p=cfg.top_p if top_p is None else top_p, seed=cfg.seed if seed is None else seed,
        thinking=recipe.verifier.thinking, model=model, timeout=cfg.request_timeout,
        max_retries=cfg.max_retries, api_key=api_key or os.environ.get("DSPARK_KIT_API_KEY"),
        **opt_overrides)
    outfile = Path(outfile)
    done, repair = prepare_outfile(outfile, resume)
    if not resume:
        outfile.with_name(outfile.name + ".errors.jsonl").unlink(missing_ok=True)
    skipped: Counter = Counter()
    source = iter_source(data, skipped=skipped, limit=limit)
    first = next(source, None)  # a missing file / unknown preset fails here, before any server starts
    rows = itertools.chain([first] if first else [], source)
    t0 = time.time()
    endpoints = list(endpoints or cfg.endpoints)
    server = None
    if not endpoints:
        from dspark_kit.engines.lifecycle import ManagedServer
        from dspark_kit.engines.servers import regen_server_plan
        from dspark_kit.resolved import Resolved

        plan = regen_server_plan(Resolved(recipe), api_key=opts.api_key)
        server = ManagedServer(plan, Path(engine_log or outfile.with_name(outfile.name + ".engine.log")))
        server.start()
        endpoints = [plan.base_url]
    try:
        if server is not None:
            server.wait_healthy(recipe.serve.startup_timeout)
        summary = asyncio.run(regen_rows(rows, endpoints, outfile, opts, done, on_row))
    finally:
        if server is not None:
            server.stop()
    elapsed = time.time() - t0
    summary.update({
        "outfile": str(outfile), "errors_file": str(outfile.with_name(outfile.name + ".errors.jsonl")),
        "already_done": len(done), "resume_repair": repair, "skipped_rows": dict(skipped),
        "elapsed_s": round(elapsed, 2), "rows_per_min": round(summary["written"] / elapsed * 60, 1),
        "tokens_per_s": round(summary["completion_tokens"] / elapsed, 1),
        "local_engine": server is not None,
    })
    return summary
