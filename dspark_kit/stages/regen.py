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
Reasoning: a server with a reasoning parser (vLLM `--reasoning-parser qwen3`,
the local engine's too) returns it in `reasoning_content` / `reasoning`; a
server without one leaves `<think>..</think>` inline. Either way the row stores
it explicitly as the turn's `reasoning_content` (conversations.to_sharegpt).
History sent back holds role and content only: the Qwen3 template drops the
reasoning of turns before the last user turn anyway.

`concurrency` workers per endpoint pull rows from one queue (faster servers
take more). Refused connections do not use up a row's retries: the request
waits with backoff while the endpoint is down (a restarting server), and the
endpoint leaves the rotation only after refusing for `unavailable_timeout`
seconds (and `dead_after` times) in a row; with other endpoints live its rows
go to them at once. Every source row ends as written, failed (with reason, in
the errors file) or not attempted (all endpoints gone), counted in the summary. Output is append-only
jsonl, one complete line per row, flushed, fsync'ed every `fsync_every` rows
(streamed, not temp+rename: a crash keeps finished rows); `resume` cuts a
partial last line and skips every idx present. Rows that exhaust their retries
go to `<outfile>.errors.jsonl`; a resume retries them and drops the entries of
rows that succeed. The source is checked before any output is touched, and an
existing output is only emptied with `overwrite`.
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

from dspark_kit.data.conversations import canonical_reasoning, split_reasoning, to_sharegpt
from dspark_kit.engines import openai_base_url as normalize_endpoint
from dspark_kit.resolved import Resolved

RETRYABLE_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


class RequestFailed(Exception):
    def __init__(self, reason: str, retryable: bool = True, refused: bool = False):
        super().__init__(reason)
        self.reason, self.retryable, self.refused = reason, retryable, refused


class EndpointDead(Exception):
    """This endpoint left the rotation; the row goes back to the queue."""


class EndpointDown(Exception):
    """This endpoint refuses connections now and another one is up: the row goes to the queue."""


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
    unavailable_timeout: float = 300.0
    fsync_every: int = 32
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

    def others_live(self, run_eps: list[Endpoint]) -> bool:
        return any(e is not self and not e.dead_reason and e.down_since is None for e in run_eps)


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


def compact_errors(path: Path, succeeded: set[int]) -> None:
    """Errors file after a run: one entry per idx (the latest), none for rows now written."""
    if not path.exists():
        return
    latest: dict[int, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            latest[int(json.loads(line)["idx"])] = line
        except (ValueError, KeyError, TypeError):
            continue
    keep = [line for idx, line in latest.items() if idx not in succeeded]
    if not keep:
        path.unlink()
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
    os.replace(tmp, path)


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
        return parse_chat_response(json.loads(raw))
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise RequestFailed(f"malformed response ({e.__class__.__name__}: {str(e)[:80]})") from None


def parse_chat_response(data: Any) -> dict[str, Any]:
    """text, reasoning (None when the server gave none), finish_reason and usage of a chat
    completion: one response body, or the list of chunks of a streamed one (`delta`s)."""
    chunks = data if isinstance(data, list) else [data]
    text = reasoning = finish = None
    usage: dict = {}
    seen = False
    for chunk in chunks:
        usage = chunk.get("usage") or usage
        if not chunk.get("choices"):
            continue
        seen = True
        choice = chunk["choices"][0]
        msg = choice["message"] if "message" in choice or not isinstance(data, list) else choice["delta"]
        content = msg.get("content")
        r = msg.get("reasoning_content")
        r = msg.get("reasoning") if r is None else r  # vLLM's older / newer name
        for key, value in (("content", content), ("reasoning", r)):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{key} is not text")
        text = text if content is None else (text or "") + content
        reasoning = reasoning if r is None else (reasoning or "") + r
        finish = choice.get("finish_reason") or finish
    if not seen:
        raise IndexError("no choices")
    if text is None and reasoning is None:
        raise KeyError("content")
    return {"text": text or "", "reasoning": reasoning, "finish_reason": finish, "usage": usage}


def _backoff(opts: RegenOptions, attempt: int) -> float:
    return min(opts.backoff_cap, opts.backoff_base * 2 ** min(attempt, 30))


async def chat_with_retries(ep: Endpoint, client, body: dict[str, Any], opts: RegenOptions,
                            peers: list[Endpoint] | None = None) -> dict[str, Any]:
    """One reply. Refused connections wait for the endpoint (up to unavailable_timeout) without
    using the row's retries; other failures retry max_retries times with backoff."""
    attempt = refused = 0
    while True:
        if ep.dead_reason:
            raise EndpointDead(ep.dead_reason)
        try:
            out = await _post_chat(client, ep, body, opts)
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
                await asyncio.sleep(_backoff(opts, refused))
                refused += 1
                continue
            if not e.retryable or attempt >= opts.max_retries:
                raise
            await asyncio.sleep(_backoff(opts, attempt))
            attempt += 1


async def regenerate(ep: Endpoint, client, idx: int, messages: list[dict], opts: RegenOptions,
                     peers: list[Endpoint] | None = None) -> dict[str, Any]:
    """The output row for one conversation."""
    history: list[dict[str, Any]] = []
    finish: list[str | None] = []
    usage = Counter()

    async def reply() -> None:
        sent = [{"role": m["role"], "content": m["content"]} for m in history]
        body = {"model": ep.model, "messages": sent, "max_tokens": opts.max_tokens,
                "temperature": opts.temperature, "top_p": opts.top_p,
                "chat_template_kwargs": {"enable_thinking": opts.thinking}}
        if opts.seed is not None:
            body["seed"] = opts.seed + idx * 1000 + len(finish)
        out = await chat_with_retries(ep, client, body, opts, peers)
        msg = {"role": "assistant", "content": out["text"]}
        reasoning = out["reasoning"]
        if reasoning is None:  # no reasoning parser: split inline think tags (an unclosed one stays raw)
            inline, rest, _unclosed = split_reasoning(out["text"])
            if inline is not None:
                reasoning, msg["content"] = inline, rest
        else:
            reasoning, msg["content"] = canonical_reasoning(reasoning, out["text"])
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        history.append(msg)
        finish.append(out["finish_reason"])
        for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
            usage[k] += int(out["usage"].get(k) or 0)

    for m in messages:
        if m["role"] != "assistant":
            history.append({"role": m["role"], "content": m["content"]})
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
    """The served model id; a server still starting (refusing connections) is waited for up to
    unavailable_timeout, other failures get max_retries."""
    t0, attempt = time.monotonic(), 0
    while True:
        try:
            async with client.get(ep.url + "/models") as r:
                r.raise_for_status()
                ep.model = (await r.json(content_type=None))["data"][0]["id"]
            return
        except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, IndexError) as e:
            refused = isinstance(e, aiohttp.ClientConnectorError)
            reason = f"GET {ep.url}/models failed: {e.__class__.__name__}: {str(e)[:120]}"
        attempt += 1
        if attempt > opts.max_retries and not (refused and time.monotonic() - t0 < opts.unavailable_timeout):
            break
        await asyncio.sleep(_backoff(opts, attempt - 1))
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
    fed_all: asyncio.Event = field(default_factory=asyncio.Event)  # every row finished: stop backing off
    written: int = 0
    failed: int = 0
    completion_tokens: int = 0
    succeeded: set = field(default_factory=set)  # idx written this run
    fail_reasons: Counter = field(default_factory=Counter)

    def live(self) -> list[Endpoint]:
        return [e for e in self.endpoints if not e.dead_reason]

    def fail(self, idx: int, ep: Endpoint, reason: str) -> None:
        self.failed += 1
        self.fail_reasons[reason] += 1
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
                row = await regenerate(ep, client, idx, messages, self.opts, self.endpoints)
            except EndpointDown:
                await self.queue.put(item)  # a live endpoint takes it while this one backs off
                self.queue.task_done()
                try:
                    await asyncio.wait_for(self.fed_all.wait(), _backoff(self.opts, ep.refused_in_a_row - 1))
                except TimeoutError:
                    pass
                continue
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
                self.succeeded.add(idx)
                ep.rows += 1
                self.completion_tokens += row["metadata"]["usage"].get("completion_tokens", 0)
                if self.on_row:
                    self.on_row(row)
            self.queue.task_done()


async def regen_rows(rows, endpoints: list[str], outfile: Path, opts: RegenOptions,
                     done: set[int], on_row=None) -> dict[str, Any]:
    """Regenerate `rows` ((idx, messages) iterable) over `endpoints` into outfile."""
    eps = [Endpoint(normalize_endpoint(u), model=opts.model) for u in endpoints]
    errors_file = outfile.with_name(outfile.name + ".errors.jsonl")
    run = _Run(opts, eps, JsonlSink(outfile, opts.fsync_every), JsonlSink(errors_file, 1), on_row)
    skipped_done = queued = 0
    sessions = {ep.url: new_session(opts) for ep in eps}
    try:
        await asyncio.gather(*(discover_model(ep, sessions[ep.url], opts) for ep in eps if not ep.model))
        workers = [asyncio.create_task(run.worker(ep, sessions[ep.url]))
                   for ep in run.live() for _ in range(opts.concurrency)]

        async def feed() -> None:
            nonlocal skipped_done, queued
            try:
                for idx, messages in rows:
                    if idx in done:
                        skipped_done += 1
                        continue
                    queued += 1
                    await run.queue.put((idx, messages))
                await run.queue.join()  # requeued rows included
            finally:  # also when reading the source fails: workers must not wait forever
                run.fed_all.set()
                for _ in workers:
                    await run.queue.put(None)

        feeder = asyncio.create_task(feed())
        await asyncio.gather(*workers)  # ends on sentinels, or when every endpoint died
        if feeder.done() and feeder.exception():
            raise feeder.exception()
        feeder.cancel()
        # rows the source still holds when every endpoint is gone: never sent anywhere
        unread = sum(1 for idx, _ in rows if idx not in done) if not run.live() else 0
    finally:
        run.sink.close()
        run.errors.close()
        for session in sessions.values():
            await session.close()
    compact_errors(errors_file, done | run.succeeded)
    return {
        "written": run.written, "failed": run.failed,
        "not_attempted": queued - run.written - run.failed + unread,
        "source_rows": skipped_done + queued + unread,
        "failed_reasons": dict(run.fail_reasons.most_common()), "skipped_already_done": skipped_done,
        "completion_tokens": run.completion_tokens,
        "endpoints": [{"url": e.url, "model": e.model, "rows": e.rows, "errors": e.errors,
                       "dead": e.dead_reason} for e in eps],
        "all_endpoints_dead": not run.live(),
    }


class OutputExists(ValueError):
    """--no-resume on an output that holds rows, without --overwrite."""


def run_regen(res: Resolved, outfile: str | Path, endpoints: list[str] | None = None,
              limit: int | None = None, resume: bool = True, overwrite: bool = False, dataset: str | None = None,
              model: str | None = None, concurrency: int | None = None, max_tokens: int | None = None,
              temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
              api_key: str | None = None, on_row: Callable[[dict[str, Any]], None] | None = None,
              engine_log: str | Path | None = None, **opt_overrides: Any) -> dict[str, Any]:
    """Regenerate recipe.data into outfile; returns a JSON-able summary.

    Endpoints: the argument, else recipe.regen.endpoints, else the recipe engine's chat server
    (`res`'s plan) started for the run and stopped after it.
    The source is read (and a bad one reported) before the output is touched; resume=False on
    an output that holds rows needs overwrite=True.
    """
    from dspark_kit.data.sources import iter_source

    recipe = res.recipe
    cfg = recipe.regen
    data = recipe.data.model_copy(update={"source": dataset}) if dataset else recipe.data
    opts = RegenOptions(
        concurrency=concurrency or cfg.concurrency, max_tokens=max_tokens or cfg.max_tokens,
        temperature=cfg.temperature if temperature is None else temperature,
        top_p=cfg.top_p if top_p is None else top_p, seed=cfg.seed if seed is None else seed,
        thinking=recipe.verifier.thinking, model=model, timeout=cfg.request_timeout,
        max_retries=cfg.max_retries, api_key=api_key or os.environ.get("DSPARK_KIT_API_KEY"),
        **{"unavailable_timeout": cfg.unavailable_timeout, **opt_overrides})
    outfile = Path(outfile)
    errors_file = outfile.with_name(outfile.name + ".errors.jsonl")
    skipped: Counter = Counter()
    source = iter_source(data, skipped=skipped, limit=limit)
    first = next(source, None)  # a missing file / unknown preset fails here: before any output is touched
    rows = itertools.chain([first] if first else [], source)
    if not resume and not overwrite and outfile.exists() and outfile.stat().st_size:
        raise OutputExists(f"{outfile} already holds rows: resume (the default) continues it, "
                           "--overwrite starts it over")
    done, repair = prepare_outfile(outfile, resume)
    if not resume:
        errors_file.unlink(missing_ok=True)
    t0 = time.time()
    endpoints = list(endpoints or cfg.endpoints)
    server = None
    if not endpoints:
        from dspark_kit.engines.lifecycle import ManagedServer
        from dspark_kit.engines.servers import regen_server_plan

        plan = regen_server_plan(res, api_key=opts.api_key)
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
    summary["source_rows"] += sum(skipped.values())  # every row read: done, written, failed, not attempted or unusable
    summary.update({
        "outfile": str(outfile), "errors_file": str(errors_file),
        "already_done": len(done), "resume_repair": repair, "skipped_rows": dict(skipped.most_common()),
        "elapsed_s": round(elapsed, 2), "rows_per_min": round(summary["written"] / elapsed * 60, 1),
        "tokens_per_s": round(summary["completion_tokens"] / elapsed, 1),
        "local_engine": server is not None,
    })
    return summary


def regen_plan(res: Resolved, endpoints: list[str] | None = None, outfile: Path | None = None) -> dict[str, Any]:
    """What regen would do: the endpoints (N servers on M machines) into one resumable output, or
    the recipe engine's chat server it would start when there is none."""
    from urllib.parse import urlparse

    from dspark_kit.engines.servers import regen_server_plan, server_plan

    recipe = res.recipe
    endpoints = list(endpoints or recipe.regen.endpoints)
    command = None if endpoints else regen_server_plan(res).shell_line()
    machines = sorted({urlparse(e if "//" in e else f"http://{e}").hostname or e for e in endpoints})
    per_server = None
    if endpoints and res.engine != "local":  # a server other machines send requests to: 0.0.0.0
        per_server = server_plan(res, "chat", port=recipe.serve.port, host="0.0.0.0").shell_line()
    return {"endpoints": endpoints, "machines": machines, "local_engine_command": command,
            "server_command": per_server, "outfile": str(outfile) if outfile else None,
            "concurrency_per_endpoint": recipe.regen.concurrency}


def regen_plan_lines(plan: dict[str, Any]) -> list[str]:
    if plan["local_engine_command"]:
        return [plan["local_engine_command"]]
    endpoints, machines = plan["endpoints"], plan["machines"]
    lines = [(f"# {len(endpoints)} server(s) on {len(machines)} machine(s) ({', '.join(machines)}): one client here "
             f"spreads rows over all of them ({plan['concurrency_per_endpoint']} in flight each) into one output "
             f"{plan['outfile'] or 'regen.jsonl'}; --resume (default) skips rows already written and retries failed "
             "ones, a server that keeps refusing is dropped and its rows go to the others")]
    if plan["server_command"]:
        lines += [("# start on each server machine (same verifier and thinking mode everywhere; one --port per "
                   "server on a machine):"), f"#   {plan['server_command']}"]
    return lines + [f"endpoint {e}" for e in endpoints]
