"""Load generator for an OpenAI-compatible chat server (vLLM, vLLM-Ascend, local).

Streams responses so TTFT and TPOT are real, counts output tokens from the
final usage chunk, and reads speculative-decoding acceptance from `/metrics`
deltas (scraped before and after the run). A server that ignores `stream`
and answers with one JSON body still works: TTFT is then the full latency.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dspark_kit import atomic
from dspark_kit.data.conversations import ConversationError, normalize
from dspark_kit.engines import ServerPlan
from dspark_kit.engines.chat_client import ChatClient, RequestFailed
from dspark_kit.engines.prom import MetricsError, server_delta, spec_decode_delta
from dspark_kit.jsonl import BadLine, read_jsonl
from dspark_kit.resolved import Resolved

SCHEMA = "dspark-kit.bench/1"
BUILTIN_DATASET = "builtin"  # eval's held-out prompts of the tiny corpus (stages.heldout.tiny_held_out)


class BenchError(RuntimeError):
    """One line naming the flag / server problem and the fix."""


# ---- prompts ---------------------------------------------------------------


def _first_turn(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """System turns + the first user turn: what the verifier answers from scratch."""
    out = []
    for m in messages:
        out.append(m)
        if m["role"] == "user":
            return out
    return out


def load_prompts(dataset: str, num_prompts: int, res: Resolved, seed: int = 0) -> list[list[dict[str, str]]]:
    """`builtin`: the first `num_prompts` of the tiny corpus's held-out prompts, the ones `eval`
    measures by default on the tiny data (same order, each up to its user turn as eval sends it);
    else a jsonl of chat rows (regen output, OpenAI messages), shuffled by `seed`."""
    if dataset == BUILTIN_DATASET:
        from dspark_kit.stages.evaluation.heldout import tiny_held_out, until_last_user

        return [until_last_user(c) for c in tiny_held_out(res, num_prompts).chats]
    path = Path(dataset)
    if not path.is_file():
        raise BenchError(f"--prompts {dataset}: file not found (pass a regen .jsonl or 'builtin')")
    prompts = []
    for row in read_jsonl(path):
        try:
            if not isinstance(row, BadLine):
                prompts.append(_first_turn(normalize(row)))
        except ConversationError:
            continue  # unusable rows are skipped, as in prepare
    if not prompts:
        raise BenchError(f"--prompts {dataset}: no usable chat rows (need conversations/messages/prompt)")
    random.Random(seed).shuffle(prompts)
    return prompts[:num_prompts]


# ---- one request -------------------------------------------------------------


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


# ---- the run -----------------------------------------------------------------


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
                raise BenchError(f"--endpoint {base_url}: server not reachable "
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


def run_bench(res: Resolved, base_url: str | None = None, label: str | None = None,
              out_dir: str | Path | None = None, *, num_prompts: int | None = None,
              concurrency: int | None = None, max_tokens: int | None = None,
              dataset: str = BUILTIN_DATASET, model: str | None = None, write: bool = True,
              categories: str | list[str] | None = None) -> dict[str, Any]:
    """Benchmark a running server; writes `<out_dir>/bench_<label>.json` + `.md` (unless `write` is
    False: the caller adds to the result and writes it once), returns the result.

    `res` names the model to ask for (served_name) and the K to record without spec metrics.
    `categories` (default bench.categories): prompt sets benchmarked one after another after the
    main load, each with its own /metrics window, so each gets its own acceptance figures."""
    recipe = res.recipe
    b = recipe.bench
    base_url = (base_url or f"http://{recipe.serve.host}:{recipe.serve.port}").rstrip("/")
    label = label or recipe.name
    if not label.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise BenchError(f"--label {label!r}: use letters, digits, '-', '_' or '.' (it names the output file)")
    n = num_prompts or b.num_prompts
    conc = concurrency or b.concurrency
    max_tok = max_tokens or b.max_tokens
    prompts = load_prompts(dataset, n, res)
    sets = _category_sets(res, b.categories if categories is None else categories, n,
                          "--categories" if categories is not None else "bench.categories")

    def send(msgs: list[list[dict[str, str]]], name: str | None, follow_ups=None) -> dict[str, Any]:
        try:
            return asyncio.run(run_load(base_url, name, msgs, concurrency=conc, max_tokens=max_tok,
                                        temperature=recipe.measured_temperature, thinking=recipe.measured_thinking,
                                        preferred_model="" if name else res.served_name, follow_ups=follow_ups))
        except MetricsError as e:
            raise BenchError(str(e)) from None

    load = send(prompts, model)
    result: dict[str, Any] = {
        "schema": SCHEMA, "source": "dspark-kit", "label": label, "base_url": base_url,
        "model": load["model"], "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "dataset": dataset, "num_prompts": len(prompts), "concurrency": conc,
        "max_tokens": max_tok, "temperature": recipe.measured_temperature, "thinking": recipe.measured_thinking,
        "metrics_available": load["metrics_available"], "spec_decode": load["spec_decode"],
        # the server's own view from /metrics (vLLM: tokens, TTFT, TPOT histograms); None without
        "server_metrics": load["server_metrics"],
    }
    result |= served_k(load["spec_decode"], res)
    result |= summarize(load["records"], load["duration_s"])
    if result["completed"] == 0:
        raise BenchError(f"bench: all {len(prompts)} requests failed ({'; '.join(result['errors'])}); "
                         "check the server log and the model name")
    if sets:
        result["categories"] = [category_row(found, send(found.chats, load["model"], found.follow_ups))
                                for found in sets]
    if write:
        write_result(result, Path(out_dir) if out_dir else res.run.bench)
    return result


def _category_sets(res: Resolved, specs: str | list[str], n: int, where: str) -> list:
    from dspark_kit.data.categories import CategoryError, parse_categories
    from dspark_kit.stages.evaluation.heldout import category_prompts

    try:
        return category_prompts(res, parse_categories(specs), n, where=where)
    except CategoryError as e:
        raise BenchError(str(e)) from None


def category_row(found, load: dict[str, Any]) -> dict[str, Any]:
    """One category's figures: its /metrics window's acceptance (None without drafts) and latency."""
    spec = load["spec_decode"] or {}
    s = summarize(load["records"], load["duration_s"])
    return {**found.record(), "acceptance_length": spec.get("acceptance_length"),
            "per_position_acceptance": spec.get("per_position_acceptance") or [], "spec_decode": load["spec_decode"],
            **{k: s[k] for k in ("completed", "failed", "output_throughput", "mean_tpot_ms", "mean_ttft_ms")}}


def served_k(spec_decode: dict | None, res: Resolved) -> dict[str, Any]:
    """The K the server really ran: vLLM (and our engine) export one per-position acceptance
    series per drafted slot, so their count is K; without spec metrics, what the resolver
    decided for the recipe's engine."""
    rates = (spec_decode or {}).get("per_position_acceptance") or []
    if rates:
        return {"num_speculative_tokens": len(rates),
                "num_speculative_tokens_source": "server /metrics (per-position series)"}
    if not spec_decode:
        return {"num_speculative_tokens": None, "num_speculative_tokens_source": "no spec-decode metrics"}
    try:
        k = res.k
        return {"num_speculative_tokens": k.value, "num_speculative_tokens_source": f"resolver: {k.source}"}
    except ValueError as e:
        return {"num_speculative_tokens": None, "num_speculative_tokens_source": f"unknown ({e})"}


def write_result(result: dict[str, Any], out_dir: Path) -> Path:
    """`bench_<label>.json` + `.md` in out_dir (temp file then rename)."""
    from dspark_kit.stages.reporting.report import bench_markdown

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"bench_{result['label']}.json"
    atomic.write_text(path, json.dumps(result, indent=2) + "\n")
    atomic.write_text(path.with_suffix(".md"), bench_markdown([result]) + "\n")
    return path


def stage_bench(res: Resolved, server: ServerPlan | None = None) -> dict[str, Any]:
    """Pipeline stage: serve verifier + draft (role spec; `server`: the stage plan's), benchmark it, stop it."""
    import re

    from dspark_kit.engines.servers import running_server
    from dspark_kit.stages.evaluation.served_gate import ServedGateError, enforce, side_by_side

    label = re.sub(r"[^A-Za-z0-9._-]", "_", Path(res.recipe.serve.checkpoint).name) or "spec"
    with running_server(res, "spec", plan=server) as url:
        r = run_bench(res, url, label=f"spec-{label}", write=False)  # written once, with the gate's verdict
    try:
        verdict = enforce(res, r)
    except ServedGateError as e:
        write_result(r | {"in_process": {"passed": False, "error": str(e)}}, res.run.bench)
        raise BenchError(f"bench: {e}") from None
    write_result(r | {"in_process": verdict}, res.run.bench)  # served and in-process side by side
    spec = r["spec_decode"] or {}
    return {"acceptance_length": spec.get("acceptance_length"), "output_throughput": r["output_throughput"],
            "mean_tpot_ms": r["mean_tpot_ms"], "num_speculative_tokens": r["num_speculative_tokens"],
            "in_process": verdict, "served_vs_in_process": side_by_side(verdict),
            "path": str(res.run.bench_file(r["label"]))}
