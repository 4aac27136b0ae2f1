"""Load generator against real HTTP servers on 127.0.0.1 (aiohttp stubs for SSE/JSON/faults)."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
import typer
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, generate_latest
from typer.testing import CliRunner

from dspark_kit.recipe import recipe_from_dict
from dspark_kit.resolved import Resolved
from dspark_kit.stages.serving.bench import BenchError, bench_endpoint, load_prompts

REPO = Path(__file__).resolve().parent.parent
TOKENS_PER_REPLY = 6
FIRST_TOKEN_DELAY = 0.15
TOKEN_GAP = 0.03
# spec-decode counters each request adds: 4 drafts of 3 tokens, accepted per position 3, 2, 1
DRAFTS, DRAFT_TOKENS, PER_POS = 4, 12, (3, 2, 1)


class StubServer:
    """An OpenAI chat server that streams (SSE), answers JSON, or rejects streaming like
    our local engine; /metrics exposes vLLM spec-decode counters via prometheus_client."""

    def __init__(self, mode: str = "stream", restart_after: int | None = None, served_before: int = 0):
        self.mode, self.restart_after = mode, restart_after
        self.bodies: list[dict] = []
        self._new_registry(start=served_before)  # counts from requests before the benchmark

    def _new_registry(self, start: int) -> None:
        self.reg = CollectorRegistry()
        lab = ["model_name", "engine"]
        self.drafts = Counter("vllm:spec_decode_num_drafts", "", lab, registry=self.reg).labels("stub", "0")
        self.tokens = Counter("vllm:spec_decode_num_draft_tokens", "", lab, registry=self.reg).labels("stub", "0")
        self.acc = Counter("vllm:spec_decode_num_accepted_tokens", "", lab, registry=self.reg).labels("stub", "0")
        pp = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "", [*lab, "position"], registry=self.reg)
        self.per_pos = [pp.labels("stub", "0", str(i)) for i in range(len(PER_POS))]
        for _ in range(start):
            self._count()

    def _count(self) -> None:
        self.drafts.inc(DRAFTS)
        self.tokens.inc(DRAFT_TOKENS)
        self.acc.inc(sum(PER_POS))
        for c, v in zip(self.per_pos, PER_POS):
            c.inc(v)

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "stub", "object": "model"}]})

    async def metrics(self, request):
        return web.Response(body=generate_latest(self.reg), content_type="text/plain")

    async def chat(self, request):
        body = await request.json()
        self.bodies.append(body)
        if self.restart_after is not None and len(self.bodies) == self.restart_after:
            self._new_registry(start=0)  # counters back to zero, as after a crash + restart
        self._count()
        usage = {"prompt_tokens": 7, "completion_tokens": TOKENS_PER_REPLY, "total_tokens": 7 + TOKENS_PER_REPLY}
        if body.get("stream") and self.mode == "reject-stream":
            return web.json_response({"error": {"message": "stream: not supported"}}, status=400)
        if not body.get("stream") or self.mode == "json":
            await asyncio.sleep(FIRST_TOKEN_DELAY + TOKEN_GAP * (TOKENS_PER_REPLY - 1))
            return web.json_response({"choices": [{"index": 0, "message": {"role": "assistant", "content": "w " * 6},
                                                   "finish_reason": "stop"}], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(FIRST_TOKEN_DELAY)
        for i in range(TOKENS_PER_REPLY):
            if i:
                await asyncio.sleep(TOKEN_GAP)
            chunk = {"choices": [{"index": 0, "delta": {"content": f"w{i} "}, "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        return resp


@pytest.fixture
def serve():
    """Start a StubServer on a free loopback port in a thread; yields (stub, base_url)."""
    started = []

    def _start(stub: StubServer):
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        state = {}

        async def boot():
            app = web.Application()
            app.add_routes([web.get("/v1/models", stub.models), web.get("/metrics", stub.metrics),
                            web.post("/v1/chat/completions", stub.chat)])
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            state["runner"] = runner
            state["port"] = runner.addresses[0][1]
            ready.set()

        thread = threading.Thread(target=lambda: (loop.run_until_complete(boot()), loop.run_forever()), daemon=True)
        thread.start()
        assert ready.wait(10)
        started.append((loop, thread, state))
        return stub, f"http://127.0.0.1:{state['port']}"

    yield _start
    for loop, thread, state in started:
        asyncio.run_coroutine_threadsafe(state["runner"].cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


# A verifier the stubs do not serve (the client then takes the first served model); being no
# built-in, it needs no model build.
UNSERVED = "/models/not-served"


def _recipe(tmp_path, thinking=False):
    return recipe_from_dict({"name": "t", "workdir": str(tmp_path / "run"),
                             "verifier": {"path": UNSERVED, "thinking": thinking},
                             "bench": {"num_prompts": 6, "concurrency": 3, "max_tokens": 16, "temperature": 0.0}})


def test_streaming_latency_and_acceptance(serve, tmp_path):
    stub, url = serve(StubServer("stream", served_before=5))  # earlier traffic must not count
    r = bench_endpoint(Resolved(_recipe(tmp_path, thinking=True)), url, label="ckpt1")
    assert r["completed"] == 6 and r["failed"] == 0 and r["streamed"] is True
    assert r["total_output_tokens"] == 6 * TOKENS_PER_REPLY
    # the stub's sleeps bound TTFT and whole-request latency from below; a busy machine only adds
    # to them (not to TPOT or ITL: a client stalled at the first token sees the rest arrive at once)
    assert r["mean_ttft_ms"] >= FIRST_TOKEN_DELAY * 1000 * 0.9
    assert r["mean_e2el_ms"] >= (FIRST_TOKEN_DELAY + TOKEN_GAP * (TOKENS_PER_REPLY - 1)) * 1000 * 0.9
    assert r["mean_tpot_ms"] > 0 and 0 <= r["median_itl_ms"] <= r["mean_e2el_ms"]
    # TPOT excludes the first token: per request, and so in the means (every reply has the
    # same length), latency = TTFT + TPOT x (tokens - 1), whatever the load
    assert r["mean_e2el_ms"] == pytest.approx(r["mean_ttft_ms"] + r["mean_tpot_ms"] * (TOKENS_PER_REPLY - 1))
    s = r["spec_decode"]
    n = 6
    assert s["num_drafts"] == n * DRAFTS
    assert s["acceptance_length"] == pytest.approx(1 + sum(PER_POS) / DRAFTS)
    assert s["acceptance_rate"] == pytest.approx(sum(PER_POS) / DRAFT_TOKENS)
    assert s["per_position_acceptance"] == pytest.approx([v / DRAFTS for v in PER_POS])
    body = stub.bodies[0]
    assert body["model"] == "stub"  # recipe's served name is not listed: first served model
    assert body["chat_template_kwargs"] == {"enable_thinking": True}
    assert body["stream_options"] == {"include_usage": True} and body["temperature"] == 0.0
    out = tmp_path / "run" / "bench"
    assert json.loads((out / "bench_ckpt1.json").read_text())["label"] == "ckpt1"
    assert "acceptance length" in (out / "bench_ckpt1.md").read_text()


@pytest.mark.parametrize("mode", ["json", "reject-stream"])
def test_non_streaming_servers(serve, tmp_path, mode):
    stub, url = serve(StubServer(mode))
    r = bench_endpoint(Resolved(_recipe(tmp_path)), url, label=mode, out_dir=tmp_path / "o")
    assert r["completed"] == 6 and r["streamed"] is False
    assert r["total_output_tokens"] == 6 * TOKENS_PER_REPLY
    # without streaming the first token time is unknown: TTFT is the whole latency
    assert r["mean_ttft_ms"] == pytest.approx(r["mean_e2el_ms"])
    if mode == "reject-stream":  # one rejected streamed try, then plain JSON for everything
        assert sum(1 for b in stub.bodies if b.get("stream")) <= 3
        assert sum(1 for b in stub.bodies if not b.get("stream")) == 6


def test_restarted_server_is_an_error(serve, tmp_path):
    _, url = serve(StubServer("json", restart_after=4, served_before=20))
    with pytest.raises(BenchError, match="restarted"):
        bench_endpoint(Resolved(_recipe(tmp_path)), url, label="x", out_dir=tmp_path / "o")


def test_unreachable_server(tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(BenchError, match="--endpoint"):
        bench_endpoint(Resolved(_recipe(tmp_path)), f"http://127.0.0.1:{port}", label="x", out_dir=tmp_path / "o")


def test_prompts_from_jsonl(tmp_path):
    p = tmp_path / "regen.jsonl"
    rows = [{"id": "a", "conversations": [{"from": "human", "value": "hi 1"}, {"from": "gpt", "value": "yo"},
                                         {"from": "human", "value": "again"}]},
            {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi 2"}]},
            {"nothing": True}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    res = Resolved(_recipe(tmp_path))
    prompts = load_prompts(str(p), 10, res)
    assert sorted(m[-1]["content"] for m in prompts) == ["hi 1", "hi 2"]
    assert all(m[-1]["role"] == "user" for m in prompts)
    assert len(load_prompts("builtin", 4, res)) == 4
    with pytest.raises(BenchError, match="--prompts"):
        load_prompts(str(tmp_path / "missing.jsonl"), 3, res)


def test_builtin_prompts_are_evals_held_out_prompts(tmp_path):
    """The served engine measures the same acceptance as eval only on the same prompts: bench's
    builtin dataset is eval's default (held-out) prompt set for the tiny recipe, in eval's order."""
    from dspark_kit.measure.eval_prompts import load_eval_prompts, until_last_user
    from dspark_kit.recipe import load_recipe
    from dspark_kit.stages.prompts import prompt_source

    recipe = load_recipe(REPO / "recipes" / "tiny-cpu.yaml", [f"workdir={tmp_path / 'run'}"])
    res = Resolved(recipe, planning=True)
    n = recipe.eval.num_prompts
    assert recipe.bench.num_prompts == n and recipe.bench.max_tokens == recipe.eval.max_new_tokens
    # no DIR/prepared: nothing to compare prompts with, so no tokenizer is needed either
    evals = load_eval_prompts(prompt_source(res), tokenizer=None, limit=max(n, 16))  # what evaluate_checkpoint asks for
    assert evals.held_out is True and evals.ids[:n] == [f"tiny-heldout-{i}" for i in range(n)]
    bench = load_prompts("builtin", n, res)
    assert bench == [until_last_user(c) for c in evals.chats[:n]]
    assert len({m[-1]["content"] for m in bench}) > 1 and all(m[-1]["role"] == "user" for m in bench)
    assert load_prompts("builtin", 100, res)[:n] == bench  # more prompts extend the same list


def test_cli_bench_then_compare(serve, tmp_path):
    from dspark_kit.cli import bench as bench_cli

    app = typer.Typer()
    bench_cli.register(app)
    app.command("noop")(lambda: None)  # keep `bench` a named subcommand
    _, url = serve(StubServer("stream"))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: t\nworkdir: {tmp_path / 'run'}\nverifier: {{path: {UNSERVED}}}\n"
                      "bench: {num_prompts: 3, concurrency: 3}\n")
    runner = CliRunner()
    for label in ("a", "b"):
        res = runner.invoke(app, ["bench", "-r", str(recipe), "--endpoint", url, "--label", label, "--json"])
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["label"] == label
    a, b = (tmp_path / "run" / "bench" / f"bench_{x}.json" for x in "ab")
    res = runner.invoke(app, ["bench", "--compare", str(a), str(b), "--out", str(tmp_path / "cmp.md")])
    assert res.exit_code == 0, res.output
    header = next(line for line in res.stdout.splitlines() if line.startswith("| metric"))
    assert header.split("|")[2:4] == [" a ", " b "]
    assert (tmp_path / "cmp.md").is_file() and (tmp_path / "cmp.png").stat().st_size > 1000
    res = runner.invoke(app, ["bench", "--compare"])
    assert res.exit_code == 2


def test_cli_bench_workdir(serve, tmp_path):
    """bench takes -w/--workdir like every other command: results go to DIR/bench."""
    from dspark_kit.cli import app

    _, url = serve(StubServer("stream"))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: t\nworkdir: {tmp_path / 'recipe-run'}\nverifier: {{path: {UNSERVED}}}\n"
                      "bench: {num_prompts: 2, concurrency: 2}\n")
    for flag, wd in (("-w", tmp_path / "w1"), ("--workdir", tmp_path / "w2")):
        res = CliRunner().invoke(app, ["bench", "-r", str(recipe), flag, str(wd), "--endpoint", url, "--label", "x"])
        assert res.exit_code == 0, res.output
        assert json.loads((wd / "bench" / "bench_x.json").read_text())["completed"] == 2
        assert str(wd / "bench" / "bench_x.json") in res.output
    assert not (tmp_path / "recipe-run").exists()


@pytest.mark.slow
def test_against_local_engine(tmp_path, tiny_verifier):
    """Real local engine (role chat, tiny verifier): it streams, so TTFT is the first token's time."""
    import sys

    from dspark_kit.engines import ServerPlan
    from dspark_kit.engines.lifecycle import ManagedServer
    from dspark_kit.engines.ports import free_port

    model = tiny_verifier
    port = free_port()
    plan = ServerPlan([sys.executable, "-m", "dspark_kit.engines.local.server", "--model", str(model),
                       "--role", "chat", "--port", str(port), "--device", "cpu"], "127.0.0.1", port)
    recipe = recipe_from_dict({"name": "it", "workdir": str(tmp_path / "run"),
                               "bench": {"num_prompts": 2, "concurrency": 2, "max_tokens": 8}})
    with ManagedServer(plan, tmp_path / "server.log") as server:
        server.wait_healthy(600)  # a hang, not a busy machine
        r = bench_endpoint(Resolved(recipe), server.base_url, label="local")
    assert r["completed"] == 2 and r["failed"] == 0
    assert 0 < r["total_output_tokens"] <= 2 * 8
    assert r["output_throughput"] > 0 and r["mean_e2el_ms"] > 0
    assert r["metrics_available"] is True
    assert r["spec_decode"] is None  # role chat has no draft
    assert r["streamed"] is True and 0 < r["mean_ttft_ms"] < r["mean_e2el_ms"] and r["mean_tpot_ms"] > 0


class CategoryStub(StubServer):
    """Accepts less on GSM8K-style prompts (one accepted token fewer at the last position), so each
    category's /metrics window has figures of its own."""

    def _count(self) -> None:
        super()._count()
        last = self.bodies[-1]["messages"][-1]["content"] if self.bodies else ""
        if not last.startswith("Natalia"):  # counters only go up: the other prompts get one more
            self.acc.inc(1)
            self.per_pos[-1].inc(1)


def test_categories_each_get_their_window_and_compare_side_by_side(serve, tmp_path):
    from dspark_kit.measure.bench_tables import compare

    gsm = tmp_path / "gsm8k.jsonl"
    gsm.write_text(json.dumps({"question": "Natalia sold 48 clips. How many?", "answer": "#### 72"}) + "\n")
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"prompt": f"hello {i}"}) + "\n" for i in range(5)))
    _, url = serve(CategoryStub("stream"))
    files = []
    for label in ("a", "b"):
        r = bench_endpoint(Resolved(_recipe(tmp_path)), url, label=label, num_prompts=2,
                      categories=f"gsm8k={gsm},chat={chat}")
        files.append(tmp_path / "run" / "bench" / f"bench_{label}.json")
    cats = {c["category"]: c for c in r["categories"]}
    assert list(cats) == ["gsm8k", "chat"] and cats["gsm8k"]["count"] == 1 and cats["chat"]["count"] == 2
    # one request of 4 drafts accepting 3, 2, 1; two requests accepting 3, 2, 2 each
    assert cats["gsm8k"]["acceptance_length"] == pytest.approx(1 + 6 / 4)
    assert cats["gsm8k"]["per_position_acceptance"] == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    assert cats["chat"]["acceptance_length"] == pytest.approx(1 + 14 / 8)
    assert cats["chat"]["per_position_acceptance"] == pytest.approx([6 / 8, 4 / 8, 4 / 8])
    md, written = compare(files, tmp_path / "cmp.md")
    table = md.split("**Acceptance per category**")[1]
    assert "| category | a | b |" in table
    assert "| gsm8k | 2.500 (0.75, 0.50, 0.25) | 2.500 (0.75, 0.50, 0.25) |" in table
    assert "| chat | 2.750 (0.75, 0.50, 0.50) |" in table
    assert any(p.name == "cmp_categories.png" and p.stat().st_size > 1000 for p in written)
    with pytest.raises(BenchError, match="category 'nope': unknown"):
        bench_endpoint(Resolved(_recipe(tmp_path)), url, label="c", categories="nope")


def test_mt_benchs_second_turn_follows_the_servers_reply_in_the_same_window(serve, tmp_path):
    mt = tmp_path / "mt.jsonl"
    mt.write_text("".join(json.dumps({"prompt": [f"Write about {i}.", "Now shorter."]}) + "\n" for i in range(2)))
    stub = CategoryStub("stream")
    _, url = serve(stub)
    r = bench_endpoint(Resolved(_recipe(tmp_path)), url, label="mt", num_prompts=2, categories=f"mt-bench={mt}")
    (cat,) = r["categories"]
    assert cat["count"] == 2 and cat["turns"] == 2 and cat["completed"] == 4  # two questions, two turns each
    seconds = [b["messages"] for b in stub.bodies if len(b["messages"]) == 3]
    assert len(seconds) == 2
    for msgs in seconds:  # the streamed reply, reassembled, is the history the second turn carries
        assert msgs[1] == {"role": "assistant", "content": "".join(f"w{i} " for i in range(TOKENS_PER_REPLY))}
        assert msgs[2] == {"role": "user", "content": "Now shorter."} and msgs[0]["content"].startswith("Write about")
    assert cat["spec_decode"]["num_drafts"] == 4 * DRAFTS  # both turns counted in the one window
