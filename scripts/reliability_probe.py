"""Measure what docs/RELIABILITY.md promises about the local engine, on loopback, bounded.

Starts the local engine (tiny verifier, chat role) the way the kit does (ManagedServer),
then: (1) load: N concurrent chat requests, R rounds, reporting status counts, latency
p50/p95/max, tokens/s and the worst /health latency while loaded; (2) bad input: every
case from issue 14 sent once, all must be 4xx in OpenAI's error shape and the server
must still answer; (3) abandon: A clients that give up after 0.3 s, then how long until
nothing is in flight and how many tokens were decoded for them; (4) RSS before/after.

    .venv/bin/python scripts/reliability_probe.py --concurrency 16 --rounds 4 --abandon 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BAD_INPUTS = {
    "top_p 1e-300": {"top_p": 1e-300, "temperature": 1.0},  # must decode: 200
    "temperature 1e-300": {"temperature": 1e-300},  # greedy: 200
    "seed 2**70": {"temperature": 1.0, "seed": 2**70},
    "content absent": {"messages": [{"role": "user"}]},
    "content null": {"messages": [{"role": "user", "content": None}]},
    "image part": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    "max_tokens true": {"max_tokens": True},
    "temperature 1e9": {"temperature": 1e9},
    "logprobs": {"logprobs": True},
    "tools": {"tools": [{"type": "function", "function": {"name": "f"}}]},
    "response_format json": {"response_format": {"type": "json_object"}},
    "n 2": {"n": 2},
    "stream": {"stream": True},
    "unknown model": {"model": "other"},
    "over max_model_len": {"max_tokens": 10**6},
}
RAW_INPUTS = {  # bodies json.dumps cannot make valid
    "temperature Infinity": b'{"messages":[{"role":"user","content":"hi"}],"temperature":Infinity}',
    "lone surrogate": b'{"messages":[{"role":"user","content":"\\ud800x"}]}',
    "invalid UTF-8": b'{"messages":[{"role":"user","content":"\xff\xfe"}]}',
    "not JSON": b"{not json",
}


def rss_mb(pid: int) -> float:
    import psutil

    return round(psutil.Process(pid).memory_info().rss / 2**20, 1)


async def main(args) -> dict:
    import httpx

    from dspark_kit.engines.lifecycle import ManagedServer
    from dspark_kit.recipe import load_recipe
    from dspark_kit.resolved import Resolved
    from dspark_kit.stages.server_plan import server_plan

    recipe = load_recipe(REPO / "recipes/tiny-cpu.yaml")
    recipe.serve.extra_args = ["--max-concurrency", str(args.max_concurrency)]
    plan = server_plan(Resolved(recipe), "chat", port=args.port)
    log = Path(args.log)
    out: dict = {"command": plan.shell_line()}
    with ManagedServer(plan, log) as srv:
        srv.wait_healthy(120)
        url = plan.base_url
        pid = srv.proc.pid
        out["rss_start_mb"] = rss_mb(pid)
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=512)) as c:
            model = (await c.get(url + "/v1/models")).json()["data"][0]["id"]

            def body(i: int, **extra) -> dict:
                return {"model": model, "max_tokens": args.max_tokens,
                        "messages": [{"role": "user", "content": f"Request {i}: list three fruits."}],
                        "chat_template_kwargs": {"enable_thinking": False}, **extra}

            # (1) load
            statuses: dict[int, int] = {}
            lat: list[float] = []
            tokens = 0
            health_worst = 0.0
            stop = asyncio.Event()

            async def probe_health():
                nonlocal health_worst
                while not stop.is_set():
                    t0 = time.perf_counter()
                    await c.get(url + "/health")
                    health_worst = max(health_worst, time.perf_counter() - t0)
                    await asyncio.sleep(0.1)

            async def one(i: int):
                nonlocal tokens
                t0 = time.perf_counter()
                r = await c.post(url + "/v1/chat/completions", json=body(i))
                lat.append(time.perf_counter() - t0)
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                if r.status_code == 200:
                    tokens += r.json()["usage"]["completion_tokens"]

            prober = asyncio.create_task(probe_health())
            t0 = time.perf_counter()
            for rnd in range(args.rounds):
                await asyncio.gather(*(one(rnd * args.concurrency + i) for i in range(args.concurrency)))
            wall = time.perf_counter() - t0
            stop.set()
            await prober
            lat.sort()
            out["load"] = {
                "requests": args.rounds * args.concurrency, "concurrency": args.concurrency,
                "statuses": statuses, "wall_s": round(wall, 2),
                "requests_per_s": round(len(lat) / wall, 2), "completion_tokens_per_s": round(tokens / wall, 1),
                "latency_p50_s": round(statistics.median(lat), 3),
                "latency_p95_s": round(lat[int(0.95 * (len(lat) - 1))], 3), "latency_max_s": round(lat[-1], 3),
                "health_worst_s_under_load": round(health_worst, 3)}
            out["rss_after_load_mb"] = rss_mb(pid)

            # (2) bad input
            bad = {}
            for name, extra in BAD_INPUTS.items():
                r = await c.post(url + "/v1/chat/completions", json={**body(0), **extra})
                err = r.json().get("error") if r.status_code >= 400 else None
                shape = err is not None and set(err) == {"message", "type", "param", "code"}
                bad[name] = r.status_code if (r.status_code < 400 or shape) else f"{r.status_code} (bad shape)"
            for name, raw in RAW_INPUTS.items():
                r = await c.post(url + "/v1/chat/completions", content=raw,
                                 headers={"content-type": "application/json"})
                err = r.json().get("error") if r.status_code >= 400 else None
                shape = err is not None and set(err) == {"message", "type", "param", "code"}
                bad[name] = r.status_code if shape else f"{r.status_code} (bad shape)"

            async def chunks():
                yield b'{"prompt": "'
                for _ in range(20):
                    yield b" " * 2**20
                yield b'"}'

            t1 = time.perf_counter()
            r = await c.post(url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
            bad["20 MB chunked body"] = r.status_code
            out["chunked_20mb_rejected_in_s"] = round(time.perf_counter() - t1, 2)
            for path, method in (("/v1/nope", "GET"), ("/v1/chat/completions", "GET")):
                r = await c.request(method, url + path)
                bad[f"{method} {path}"] = r.status_code
            out["bad_inputs"] = bad
            out["server_errors_5xx"] = sum(1 for v in bad.values() if isinstance(v, int) and v >= 500)
            out["healthy_after_bad_inputs"] = (await c.get(url + "/health")).status_code == 200

            # (3) abandoned requests
            before = await c.get(url + "/metrics")

            def gen_tokens(text: str) -> float:
                return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines()
                           if x.startswith("vllm:generation_tokens_total{"))

            async def abandon(i: int):
                async with httpx.AsyncClient(timeout=0.3) as quick:
                    try:
                        await quick.post(url + "/v1/chat/completions", json=body(i, max_tokens=400))
                    except httpx.TimeoutException:
                        pass

            t_start = time.perf_counter()
            await asyncio.gather(*(abandon(i) for i in range(args.abandon)))
            t2 = time.perf_counter()  # the last client has given up

            def running(text: str) -> float:
                return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines()
                           if x.startswith("vllm:num_requests_running{"))

            while True:
                m = (await c.get(url + "/metrics")).text
                if running(m) == 0 or time.perf_counter() - t2 > 60:
                    break
                await asyncio.sleep(0.1)
            out["abandon"] = {"clients": args.abandon, "max_tokens_each": 400,
                              "clients_gave_up_within_s": round(t2 - t_start, 2),
                              "idle_after_last_left_s": round(time.perf_counter() - t2, 2),
                              "tokens_decoded_for_them": gen_tokens(m) - gen_tokens(before.text)}
        out["rss_end_mb"] = rss_mb(pid)
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--abandon", type=int, default=20)
    p.add_argument("--max-concurrency", type=int, default=256)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--log", default="/tmp/reliability_probe.log")
    p.add_argument("--json", default=None, help="also write the figures here")
    res = asyncio.run(main(p.parse_args()))
    text = json.dumps(res, indent=2)
    print(text)
    a = p.parse_args()
    if a.json:
        Path(a.json).write_text(text + "\n")
