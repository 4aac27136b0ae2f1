"""Regen against real local engines (subprocesses on 127.0.0.1): output, sharding, crash + resume."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from dspark_kit.data.sources import iter_source
from dspark_kit.engines.lifecycle import ManagedServer
from dspark_kit.recipe import Recipe, dump_recipe
from dspark_kit.resolved import Resolved
from dspark_kit.stages.dataset.regen import run_regen
from dspark_kit.stages.server_plan import server_plan

pytestmark = pytest.mark.slow
RECIPE = {"regen": {"max_tokens": 16, "concurrency": 8, "request_timeout": 60},
          "data": {"source": "builtin:tiny-chat"}, "serve": {"port": 0}}  # two engines: a free port each


@pytest.fixture(scope="module")
def engines(tmp_path_factory, tiny_verifier):
    """Two local engines; the second one slowed so a SIGKILL lands mid-run."""
    logs = tmp_path_factory.mktemp("logs")
    recipe = Recipe.model_validate(RECIPE)
    servers = [ManagedServer(server_plan(Resolved(recipe), "chat"), logs / "a.log"),
               ManagedServer(server_plan(Resolved(recipe), "chat", extra_args=["--token-delay-ms", "8"]), logs / "b.log")]
    for s in servers:
        s.start()
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda s: s.wait_healthy(120), servers))
        yield [s.base_url for s in servers]
    finally:
        for s in servers:
            s.stop()


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_20_rows_at_concurrency_8(engines, tmp_path):
    recipe = Recipe.model_validate(RECIPE)
    out = tmp_path / "regen.jsonl"
    summary = run_regen(Resolved(recipe), out, endpoints=[engines[0]], limit=20)
    rows = _rows(out)
    assert summary["written"] == 20 and summary["failed"] == 0 and len(rows) == 20
    source = dict(iter_source(recipe.data, limit=20))
    for row in rows:
        msgs = source[row["metadata"]["idx"]]
        conv = row["conversations"]
        assert [t["value"] for t in conv if t["from"] == "human"] == [m["content"] for m in msgs if m["role"] == "user"]
        assert [t["from"] for t in conv] == ["human" if m["role"] == "user" else "gpt" for m in msgs]
        assert len(row["metadata"]["finish_reasons"]) == sum(m["role"] == "assistant" for m in msgs)
        assert row["metadata"]["usage"]["completion_tokens"] <= 16 * len(row["metadata"]["finish_reasons"])
        # each reply keeps the engine's own token ids (return_token_ids), counted in usage
        ids = [t["token_ids"] for t in conv if t["from"] == "gpt"]
        assert sum(map(len, ids)) == row["metadata"]["usage"]["completion_tokens"]
    # the first reply is what the engine answers to the first user turn alone (greedy, thinking off)
    row = rows[0]
    first_user = source[row["metadata"]["idx"]][0]
    direct = httpx.post(engines[0] + "/v1/chat/completions", timeout=60, json={
        "messages": [first_user], "max_tokens": 16, "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert row["conversations"][1]["value"] == direct["choices"][0]["message"]["content"]
    again = httpx.post(engines[0] + "/v1/chat/completions", timeout=60, json={
        "messages": [first_user], "max_tokens": 16, "chat_template_kwargs": {"enable_thinking": False},
        "return_token_ids": True}).json()
    assert row["conversations"][1]["token_ids"] == again["choices"][0]["token_ids"]


def test_two_engines_both_serve_rows(engines, tmp_path):
    out = tmp_path / "regen.jsonl"
    summary = run_regen(Resolved(Recipe.model_validate(RECIPE)), out, endpoints=engines, limit=16, concurrency=2)
    served = {e["url"]: e["rows"] for e in summary["endpoints"]}
    assert sum(served.values()) == 16 and all(n > 0 for n in served.values()), served
    assert {r["metadata"]["endpoint"] for r in _rows(out)} == set(served)


def _count(out: Path) -> int:
    return len(out.read_bytes().splitlines()) if out.exists() else 0


def _cli(recipe_file: Path, out: Path, endpoint: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "dspark_kit", "regen", "-r", str(recipe_file), "--endpoint", endpoint,
            "--limit", "20", "--concurrency", "4", "--out", str(out), *extra]


def test_sigkill_at_random_moments_then_resume_gives_exactly_20_rows(engines, tmp_path):
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(dump_recipe(Recipe.model_validate(RECIPE)))
    out = tmp_path / "regen.jsonl"
    rng = random.Random(os.getpid())
    partial_counts = []
    for _ in range(3):
        before = _count(out)
        proc = subprocess.Popen(_cli(recipe_file, out, engines[1]), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300  # a hang, not a busy machine
        while _count(out) == before and proc.poll() is None:  # this run is writing rows now
            assert time.monotonic() < deadline, "regen wrote no row"
            time.sleep(0.02)
        time.sleep(rng.uniform(0, 0.5))  # then a random moment of the run
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        partial_counts.append(_count(out))
    # a crash in the middle of a write leaves a cut line: simulate the worst case too
    with out.open("a") as f:
        f.write('{"id": "regen-999", "conversations": [{"from": "hum')
    done = subprocess.run(_cli(recipe_file, out, engines[1], "--json"), capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["resume_repair"]["truncated_bytes"] > 0
    lines = out.read_text().splitlines()
    rows = [json.loads(line) for line in lines]  # every line is valid JSON
    assert len(rows) == 20 and sorted(r["metadata"]["idx"] for r in rows) == list(range(20))
    assert min(partial_counts) < 20, f"the kills never interrupted a run: {partial_counts}"


def test_no_endpoint_starts_and_stops_a_local_engine(tmp_path):
    recipe = Recipe.model_validate({**RECIPE, "serve": {"port": 0, "startup_timeout": 120}})
    out = tmp_path / "regen.jsonl"
    summary = run_regen(Resolved(recipe), out, limit=3)
    assert summary["local_engine"] and summary["written"] == 3
    engine_url = summary["endpoints"][0]["url"]
    with pytest.raises(httpx.ConnectError):  # stopped after the run
        httpx.get(engine_url.removesuffix("/v1") + "/health")
    assert (tmp_path / "regen.jsonl.engine.log").exists()
