"""Throughput of the regen client against a zero-latency stub on loopback.

    .venv/bin/python scripts/bench_regen_client.py [--rows 6000] [--concurrency 64] [--pairs 3]

The stub (aiohttp, its own process so it does not share our GIL) answers every
chat request at once. We time (a) dspark_kit.stages.dataset.regen.regen_rows, the real client
path including jsonl writes, and (b) a bare aiohttp client loop, which is the
most the stub can take on this machine, interleaved (b a, a b, ...: benchmarks/common.py
paired_ratios) so load lands on both. Targets: (a) >= 1000 req/s at concurrency 64 on
2 cores; (a) / (b) >= 0.9 (the client costs little beyond what the stub allows).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

REPLY = {"choices": [{"message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
         "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}


def serve_stub(port: int) -> None:
    from aiohttp import web

    body = json.dumps(REPLY).encode()

    async def chat(request):
        await request.read()
        return web.Response(body=body, content_type="application/json")

    async def models(_request):
        return web.json_response({"data": [{"id": "stub"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


async def bare_client(url: str, n: int, concurrency: int) -> float:
    """req/s of the plainest aiohttp loop: one pooled session, `concurrency` workers."""
    import aiohttp

    payload = {"model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    left = n
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        async def worker():
            nonlocal left
            while left > 0:
                left -= 1
                async with s.post(url + "/chat/completions", json=payload) as r:
                    await r.read()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return n / (time.perf_counter() - t0)


def regen_client(url: str, n: int, concurrency: int) -> float:
    """req/s of regen_rows, the stage's own client path, jsonl writes included."""
    from dspark_kit.stages.dataset.regen import RegenOptions, regen_rows

    rows = ((i, [{"role": "user", "content": f"q{i}"}]) for i in range(n))
    opts = RegenOptions(concurrency=concurrency, max_tokens=8, model="stub", seed=None)
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "out.jsonl"
        out.write_bytes(b"")
        t0 = time.perf_counter()
        summary = asyncio.run(regen_rows(rows, [url], out, opts, done=set()))
        rate = summary["written"] / (time.perf_counter() - t0)
        assert summary["written"] == n, summary
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=6000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=3)
    args = ap.parse_args()
    from dspark_kit.engines.ports import free_port

    port = free_port()
    stub = mp.get_context("spawn").Process(target=serve_stub, args=(port,), daemon=True)
    stub.start()
    url = f"http://127.0.0.1:{port}/v1"
    try:
        import httpx

        for _ in range(100):
            try:
                httpx.get(url + "/models")
                break
            except httpx.HTTPError:
                time.sleep(0.05)
        from common import paired_ratios

        regen_client(url, 500, args.concurrency)  # warm-up
        asyncio.run(bare_client(url, 500, args.concurrency))
        pr = paired_ratios(lambda: args.rows / asyncio.run(bare_client(url, args.rows, args.concurrency)),
                           lambda: args.rows / regen_client(url, args.rows, args.concurrency), args.pairs)
    finally:
        stub.terminate()
        stub.join(5)
    ours, stub_cap = args.rows / pr["subject_s"], args.rows / pr["baseline_s"]
    print(json.dumps({"concurrency": args.concurrency, "rows": args.rows,
                      "regen_client_req_per_s": round(ours), "stub_capacity_req_per_s": round(stub_cap),
                      "ratio": round(pr["ratio"], 3), "ratio_lo": round(pr["lo"], 3), "ratio_hi": round(pr["hi"], 3),
                      "pairs": pr["pairs"], "target_req_per_s": 1000, "meets_target": ours >= 1000}, indent=1))


if __name__ == "__main__":
    main()
