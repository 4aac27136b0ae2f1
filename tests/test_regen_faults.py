"""Regen against a fault-injecting stub (aiohttp on 127.0.0.1): retries, errors file, dead endpoints."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter

import pytest
from aiohttp import web

from dspark_kit.engines.ports import free_port
from dspark_kit.recipe import Recipe
from dspark_kit.resolved import Resolved
from dspark_kit.stages.dataset.regen import run_regen

BEHAVIOURS = ["ok", "fail-once", "fail-always", "slow", "malformed", "bad-schema", "reject"]
# 200s whose JSON is not a chat completion: a per-row "malformed response", never a crash
ODD_BODIES = {"not-an-object": [1, 2], "choice-not-an-object": {"choices": ["x"]},
              "message-not-an-object": {"choices": [{"message": "hi"}]},
              "usage-not-an-object": {"choices": [{"message": {"content": "x"}}], "usage": "lots"},
              "usage-not-a-number": {"choices": [{"message": {"content": "x"}}], "usage": {"completion_tokens": "two"}}}


class Stub:
    """Answers by the last user message: the behaviour name is the content."""

    def __init__(self, port: int | None = None, owned_by: str | None = None):
        # "vllm": replies carry return_token_ids' ids; "llamacpp": the ids only in logprobs, as
        # llama-server's chat completions; None: no ids (a server that keeps them to itself)
        self.owned_by = owned_by
        self.bodies: list[dict] = []
        self.attempts: Counter = Counter()
        self.released = asyncio.Event()  # "slow" answers only after stop(): never within any timeout
        self.port = port or free_port()
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        assert ready.wait(10)
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def _run(self, ready):
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        ready.set()
        self.loop.run_forever()

    async def models(self, _request):
        return web.json_response({"data": [{"id": "stub", **({"owned_by": self.owned_by} if self.owned_by else {})}]})

    async def chat(self, request):
        body = await request.json()
        self.bodies.append(body)
        kind = body["messages"][-1]["content"]
        self.attempts[kind] += 1
        ok = {"choices": [{"message": {"role": "assistant", "content": f"re:{kind}"}, "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
        if kind == "fail-once" and self.attempts[kind] == 1 or kind == "fail-always":
            return web.json_response({"error": "boom"}, status=500)
        if kind == "slow":
            await self.released.wait()
        if kind == "malformed":
            return web.Response(text='{"choices": [', content_type="application/json")
        if kind == "bad-schema":
            return web.json_response({"choices": []})
        if kind == "reject":
            return web.json_response({"error": {"message": "bad"}}, status=400)
        if kind in ODD_BODIES:
            return web.json_response(ODD_BODIES[kind])
        msg = ok["choices"][0]["message"]
        if kind == "think":  # vLLM --reasoning-parser: reasoning_content, content after </think>
            msg.update(reasoning_content=f"\nwhy {kind}\n", content=f"\n\nre:{kind}")
        if kind == "think-new":  # newer vLLM name
            msg.update(reasoning=f"why {kind}")
        if kind == "think-inline":  # no reasoning parser
            msg["content"] = f"<think>\nwhy {kind}\n</think>\n\nre:{kind}"
        if kind == "cut":
            msg.update(reasoning_content="cut off mid", content=None)
            ok["choices"][0]["finish_reason"] = "length"
        ids = [7, 8, 2]  # "re:", the kind, the end-of-turn token
        if self.owned_by == "vllm" and body.get("return_token_ids"):
            ok["choices"][0]["token_ids"] = ids
        if self.owned_by == "llamacpp" and body.get("logprobs"):  # llama-server's shape
            ok["choices"][0]["logprobs"] = {"content": [
                {"id": i, "token": "t", "bytes": [116], "logprob": -0.1,
                 "top_logprobs": [{"id": i, "token": "t", "bytes": [116], "logprob": -0.1}]} for i in ids]}
        return web.json_response(ok)

    def stop(self):
        self.loop.call_soon_threadsafe(self.released.set)
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def stub():
    s = Stub()
    yield s
    s.stop()


def _recipe(tmp_path, kinds, **regen):
    """request_timeout 5 s: a loaded CI machine may stall a healthy answer for a second."""
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps({"prompt": k}) + "\n" for k in kinds))
    return Recipe.model_validate({"data": {"source": str(src)},
                                  "regen": {"request_timeout": 5.0, "max_retries": 2, **regen}})


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_retries_then_errors_file_and_run_finishes(tmp_path, stub):
    out = tmp_path / "out.jsonl"
    summary = run_regen(Resolved(_recipe(tmp_path, BEHAVIOURS, request_timeout=1.0)), out, endpoints=[stub.url],
                        backoff_base=0.01, concurrency=4)
    rows = {r["metadata"]["idx"]: r for r in _lines(out)}
    assert sorted(rows) == [0, 1]  # ok, fail-once (succeeded on its retry)
    assert rows[1]["conversations"] == [{"from": "human", "value": "fail-once"}, {"from": "gpt", "value": "re:fail-once"}]
    assert rows[0]["metadata"]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    errors = {e["idx"]: e["reason"] for e in _lines(tmp_path / "out.jsonl.errors.jsonl")}
    assert sorted(errors) == [2, 3, 4, 5, 6]
    assert "HTTP 500" in errors[2] and "timeout" in errors[3]
    assert "malformed" in errors[4] and "malformed" in errors[5] and "HTTP 400" in errors[6]
    assert stub.attempts["fail-always"] == 3 and stub.attempts["slow"] == 3  # 1 + max_retries
    assert stub.attempts["reject"] == 1  # a 400 is not retried
    assert summary["written"] == 2 and summary["failed"] == 5 and not summary["all_endpoints_dead"]


@pytest.mark.parametrize("owned_by", ["vllm", "llamacpp"])
def test_each_reply_keeps_the_servers_own_token_ids_vllm_and_llama_server(tmp_path, owned_by):
    """vLLM returns return_token_ids' ids; llama-server ignores that key and lists each generated
    token's id in logprobs, which regen asks of it alone (GET /v1/models: owned_by "llamacpp"),
    also when the endpoint's model is given."""
    s = Stub(owned_by=owned_by)
    try:
        for model in (None, "stub"):
            out = tmp_path / f"{model}.jsonl"
            summary = run_regen(Resolved(_recipe(tmp_path, ["ok", "think"])), out, endpoints=[s.url], model=model)
            assert summary["written"] == 2
            assert [r["conversations"][1]["token_ids"] for r in _lines(out)] == [[7, 8, 2]] * 2
        asked = {bool(b.get("logprobs")) for b in s.bodies}
        assert asked == {owned_by == "llamacpp"}
        assert all(b["return_token_ids"] for b in s.bodies)
    finally:
        s.stop()


def test_logprobs_without_ids_are_not_token_ids():
    """OpenAI's own logprobs name tokens by text only: no ids are made up from them."""
    from dspark_kit.engines.chat_client import parse_chat_response

    text_only = {"content": [{"token": "hi", "logprob": -0.1, "bytes": [104, 105], "top_logprobs": []}]}
    out = parse_chat_response({"choices": [{"message": {"content": "hi"}, "logprobs": text_only}]})
    assert out["token_ids"] is None
    with pytest.raises(Exception, match="token_ids is not a list of token ids"):
        parse_chat_response({"choices": [{"message": {"content": "hi"},
                                          "logprobs": {"content": [{"id": "x", "token": "hi"}]}}]})


def test_resume_retries_only_failed_rows(tmp_path, stub):
    out = tmp_path / "out.jsonl"
    recipe = _recipe(tmp_path, ["ok", "fail-once", "ok"], max_retries=0)
    first = run_regen(Resolved(recipe), out, endpoints=[stub.url], backoff_base=0.01)
    assert (first["written"], first["failed"]) == (2, 1)
    errors = tmp_path / "out.jsonl.errors.jsonl"
    assert [e["idx"] for e in _lines(errors)] == [1]
    second = run_regen(Resolved(recipe), out, endpoints=[stub.url], backoff_base=0.01)
    assert (second["written"], second["already_done"], second["skipped_already_done"]) == (1, 2, 2)
    assert sorted(r["metadata"]["idx"] for r in _lines(out)) == [0, 1, 2]
    assert not _lines(errors)  # the retried failure succeeded: its entry is gone


def test_repeated_prompts_are_dropped_by_reason_and_resume_keeps_each_rows_index(tmp_path, stub):
    """regen.repeated_prompts: drop sends a prompt once (greedy regen would write its reply again);
    the repeats are counted and listed once, and the rows sent keep their source index."""
    from dspark_kit.data.sources import REPEATED_PROMPT

    out = tmp_path / "out.jsonl"
    kinds = ["a", "b", "a", "c", "b"]
    recipe = _recipe(tmp_path, kinds, repeated_prompts="drop")
    first = run_regen(Resolved(recipe), out, endpoints=[stub.url], backoff_base=0.01)
    rows = {r["metadata"]["idx"]: r["conversations"][1]["value"] for r in _lines(out)}
    assert rows == {0: "re:a", 1: "re:b", 3: "re:c"} and stub.attempts == Counter(a=1, b=1, c=1)
    assert first["skipped_rows"] == {REPEATED_PROMPT: 2} and first["source_rows"] == 5
    errors = tmp_path / "out.jsonl.errors.jsonl"
    assert [(e["idx"], e["reason"]) for e in _lines(errors)] == [(2, REPEATED_PROMPT), (4, REPEATED_PROMPT)]
    second = run_regen(Resolved(recipe), out, endpoints=[stub.url], backoff_base=0.01)
    assert (second["written"], second["skipped_already_done"]) == (0, 3) and len(_lines(errors)) == 2
    kept = run_regen(Resolved(_recipe(tmp_path, kinds)), out, endpoints=[stub.url], backoff_base=0.01)
    assert kept["written"] == 2 and sorted(r["metadata"]["idx"] for r in _lines(out)) == [0, 1, 2, 3, 4]


def test_assistant_turns_regen_folds_or_drops_are_counted_as_changed_rows(tmp_path, stub, capsys):
    """Regen asks one reply per run of assistant turns after a prompt: two in a row become one
    reply, an opening one is not regenerated. Each such row is counted by reason, in the summary
    and the CLI's lines, over every row read (a resume counts them again, as the source's changes)."""
    from dspark_kit.stages.dataset.regen_turns import MERGED_REPLIES, OPENING_REPLY

    def chat(*turns):
        return {"messages": [{"role": r, "content": c} for r, c in turns]}

    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in [
        chat(("user", "a"), ("assistant", "x"), ("assistant", "y"), ("user", "b"), ("assistant", "z")),
        chat(("assistant", "hello"), ("user", "c"), ("assistant", "w")),
        chat(("system", "s"), ("user", "d"), ("assistant", "v"), ("user", "e"), ("assistant", "u")),
    ]))
    recipe = Recipe.model_validate({"data": {"source": str(src)}, "regen": {"request_timeout": 5.0}})
    out = tmp_path / "out.jsonl"
    summary = run_regen(Resolved(recipe), out, endpoints=[stub.url], backoff_base=0.01)
    rows = {r["metadata"]["idx"]: [t["value"] for t in r["conversations"]] for r in _lines(out)}
    assert rows == {0: ["a", "re:a", "b", "re:b"], 1: ["c", "re:c"], 2: ["s", "d", "re:d", "e", "re:e"]}
    assert summary["changed_rows"] == {MERGED_REPLIES: 1, OPENING_REPLY: 1}

    from typer.testing import CliRunner

    from dspark_kit.cli import app
    from dspark_kit.recipe import dump_recipe

    (tmp_path / "r.yaml").write_text(dump_recipe(recipe))
    res = CliRunner().invoke(app, ["regen", "-r", str(tmp_path / "r.yaml"), "-e", stub.url, "-o", str(out)])
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())  # the console wraps long lines
    assert f"changed 1: {MERGED_REPLIES}" in said and f"changed 1: {OPENING_REPLY}" in said


def test_a_resumed_regen_bar_counts_only_the_rows_left(tmp_path, stub):
    """The progress bar's total is what this run has to do, so its ETA is not the whole set's: rows
    a resumed output holds (and only those within the limit) are taken off."""
    from dspark_kit.stages.dataset.regen import rows_to_regen

    out = tmp_path / "out.jsonl"
    recipe = _recipe(tmp_path, ["ok", "fail-once", "ok"], max_retries=0)
    run_regen(Resolved(recipe), out, endpoints=[stub.url], backoff_base=0.01)  # rows 0 and 2 written
    assert rows_to_regen(Resolved(recipe), 3, out) == 1
    assert rows_to_regen(Resolved(recipe), 2, out) == 1  # row 2 is past a limit of 2: not counted
    assert rows_to_regen(Resolved(recipe), 3, out, resume=False) == 3
    assert rows_to_regen(Resolved(recipe), 3, tmp_path / "none.jsonl") == 3


def test_refused_endpoint_leaves_rotation_and_others_take_its_rows(tmp_path, stub):
    dead = f"http://127.0.0.1:{free_port()}"
    out = tmp_path / "out.jsonl"
    summary = run_regen(Resolved(_recipe(tmp_path, ["ok"] * 12, unavailable_timeout=0)), out, endpoints=[dead, stub.url],
                        model="stub", concurrency=3, backoff_base=0.01, dead_after=2)
    assert sorted(r["metadata"]["idx"] for r in _lines(out)) == list(range(12))
    by_url = {e["url"]: e for e in summary["endpoints"]}
    assert "connection refused" in by_url[dead + "/v1"]["dead"] and by_url[dead + "/v1"]["rows"] == 0
    assert by_url[stub.url]["rows"] == 12 and summary["failed"] == 0


def test_only_endpoint_refused_run_finishes_and_reports(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}/v1"
    out = tmp_path / "out.jsonl"
    summary = run_regen(Resolved(_recipe(tmp_path, ["ok"] * 5, unavailable_timeout=0)), out, endpoints=[dead], model="m",
                        concurrency=2, backoff_base=0.01, dead_after=2)
    assert summary["all_endpoints_dead"] and summary["written"] == 0
    errors = _lines(tmp_path / "out.jsonl.errors.jsonl")
    assert errors and all("connection refused" in e["reason"] for e in errors)


def test_cli_json_summary_and_dry_run(tmp_path, stub):
    from typer.testing import CliRunner

    from dspark_kit.cli import app
    from dspark_kit.recipe import dump_recipe

    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(dump_recipe(_recipe(tmp_path, ["ok", "ok", "reject"], max_failed_fraction=0.5)))
    out = tmp_path / "o.jsonl"
    runner = CliRunner()
    dry = runner.invoke(app, ["regen", "-r", str(recipe_file), "-e", stub.url, "--dry-run", "--json"])
    assert dry.exit_code == 0 and json.loads(dry.stdout)["details"]["endpoints"] == [stub.url] and not out.exists()
    res = runner.invoke(app, ["regen", "-r", str(recipe_file), "-e", stub.url, "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert (summary["written"], summary["failed"]) == (2, 1) and len(_lines(out)) == 2


def test_a_server_that_rejects_every_request_fails_regen(tmp_path, stub):
    """Reproduced: "0 rows written, 4 failed" exited 0 (and the endpoint line said "4 errors, ok");
    the next stage then blamed data.source. Past regen.max_failed_fraction regen exits 1 with the reasons."""
    from typer.testing import CliRunner

    from dspark_kit.cli import app
    from dspark_kit.recipe import dump_recipe

    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(dump_recipe(_recipe(tmp_path, ["reject"] * 4)))
    res = CliRunner().invoke(app, ["regen", "-r", str(recipe_file), "-e", stub.url, "-o", str(tmp_path / "o.jsonl")])
    assert res.exit_code == 1, res.output
    assert "every row failed" in res.stderr and "HTTP 400" in res.stderr and "regen.max_failed_fraction" in res.stderr
    assert "4 errors, up" in res.stderr  # not "ok"
    within = tmp_path / "within.yaml"  # one failure in twenty: within the default budget
    within.write_text(dump_recipe(_recipe(tmp_path, ["ok"] * 19 + ["reject"], max_failed_fraction=0.05)))
    assert CliRunner().invoke(app, ["regen", "-r", str(within), "-e", stub.url,
                                    "-o", str(tmp_path / "o2.jsonl")]).exit_code == 0


def test_bad_source_fails_fast_without_hanging(tmp_path, stub):
    from dspark_kit.data.sources import SourceError

    recipe = Recipe.model_validate({"data": {"source": str(tmp_path / "missing.jsonl")}})
    with pytest.raises(SourceError, match="file not found"):
        run_regen(Resolved(recipe), tmp_path / "o.jsonl", endpoints=[stub.url])
    assert stub.attempts == Counter()


def test_endpoint_urls_are_normalised():
    from dspark_kit.stages.dataset.regen import normalize_endpoint

    assert normalize_endpoint("10.0.0.5:8000") == "http://10.0.0.5:8000/v1"
    assert normalize_endpoint("https://h/v1/") == "https://h/v1"


def test_reasoning_from_the_server_is_stored_explicitly(tmp_path, stub):
    from dspark_kit.data.conversations import normalize

    out = tmp_path / "out.jsonl"
    kinds = ["think", "think-new", "think-inline", "ok", "cut"]
    summary = run_regen(Resolved(_recipe(tmp_path, kinds)), out, endpoints=[stub.url], backoff_base=0.01)
    assert summary["written"] == 5
    rows = {r["metadata"]["idx"]: r for r in _lines(out)}
    gpt = {i: r["conversations"][1] for i, r in rows.items()}
    # a parser's "\nwhy think\n" + "\n\nre:think" is cut as Qwen3's template cuts inline tags, so the
    # history sent back and the training render are exactly what the model generated
    assert gpt[0] == {"from": "gpt", "value": "re:think", "reasoning_content": "why think"}
    assert gpt[1]["reasoning_content"] == "why think-new" and gpt[1]["value"] == "re:think-new"
    assert gpt[2] == {"from": "gpt", "value": "re:think-inline", "reasoning_content": "why think-inline"}
    assert "reasoning_content" not in gpt[3]
    assert rows[4]["metadata"]["finish_reasons"] == ["length"] and gpt[4]["reasoning_content"] == "cut off mid"
    assert normalize(rows[4])[1]["finish_reason"] == "length"  # prepare skips it as truncated


def test_server_restarted_within_unavailable_timeout_loses_no_row(tmp_path):
    """Before: 5 refusals in a row (~4 s) killed the endpoint; in-flight rows failed, the rest vanished."""
    stub = Stub()
    box = {"stub": stub, "done": 0, "restarted": threading.Event()}

    def bounce():
        box["stub"].stop()
        time.sleep(1.5)
        box["stub"] = Stub(port=stub.port)
        box["restarted"].set()

    def on_row(row):
        box["done"] += 1
        if box["done"] == 5:
            threading.Thread(target=bounce, daemon=True).start()

    out = tmp_path / "out.jsonl"
    try:
        summary = run_regen(Resolved(_recipe(tmp_path, ["ok"] * 40, unavailable_timeout=30)), out, endpoints=[stub.url],
                            model="stub", concurrency=4, backoff_base=0.05, backoff_cap=0.3, on_row=on_row)
    finally:
        box["restarted"].wait(10)
        box["stub"].stop()
    assert box["stub"] is not stub  # the server really went away mid-run
    assert (summary["written"], summary["failed"], summary["not_attempted"]) == (40, 0, 0)
    assert sorted(r["metadata"]["idx"] for r in _lines(out)) == list(range(40))


def test_every_row_is_accounted_when_all_endpoints_are_gone(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}/v1"
    out = tmp_path / "out.jsonl"
    summary = run_regen(Resolved(_recipe(tmp_path, ["ok"] * 35, unavailable_timeout=0.3)), out, endpoints=[dead], model="m",
                        concurrency=4, backoff_base=0.01, dead_after=2)
    assert summary["all_endpoints_dead"] and summary["written"] == 0
    assert summary["failed"] + summary["not_attempted"] == 35 == summary["source_rows"]
    assert summary["not_attempted"] > 0
    assert len(_lines(tmp_path / "out.jsonl.errors.jsonl")) == summary["failed"]


def test_no_resume_with_a_bad_dataset_or_without_overwrite_keeps_the_output(tmp_path, stub):
    """Before: --no-resume --data typo.jsonl emptied a 40-row output and deleted its errors file."""
    from dspark_kit.data.sources import SourceError
    from dspark_kit.stages.dataset.regen import OutputExists

    out = tmp_path / "out.jsonl"
    recipe = _recipe(tmp_path, ["ok"] * 40)
    run_regen(Resolved(recipe), out, endpoints=[stub.url])
    errors = tmp_path / "out.jsonl.errors.jsonl"
    errors.write_text(json.dumps({"idx": 99, "reason": "x"}) + "\n")
    before = out.read_bytes()
    with pytest.raises(SourceError, match="file not found"):
        run_regen(Resolved(recipe), out, endpoints=[stub.url], resume=False, dataset=str(tmp_path / "typo.jsonl"))
    with pytest.raises(OutputExists, match="--overwrite"):
        run_regen(Resolved(recipe), out, endpoints=[stub.url], resume=False)
    assert out.read_bytes() == before and len(before.splitlines()) == 40 and errors.exists()
    summary = run_regen(Resolved(recipe), out, endpoints=[stub.url], resume=False, overwrite=True, limit=3)
    assert summary["written"] == 3 and len(_lines(out)) == 3 and not errors.exists()


def test_cli_writes_into_the_run_folder_and_refuses_to_truncate(tmp_path, stub):
    from typer.testing import CliRunner

    from dspark_kit.cli import app
    from dspark_kit.recipe import dump_recipe

    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(dump_recipe(_recipe(tmp_path, ["ok", "ok"])))
    runner = CliRunner()
    wd = tmp_path / "run"
    res = runner.invoke(app, ["regen", "-r", str(recipe_file), "-e", stub.url, "-w", str(wd), "--json"])
    assert res.exit_code == 0, res.output
    assert len(_lines(wd / "regen.jsonl")) == 2 and json.loads(res.stdout)["outfile"] == str(wd / "regen.jsonl")
    bad = runner.invoke(app, ["regen", "-r", str(recipe_file), "-e", stub.url, "-w", str(wd), "--no-resume",
                              "--data", str(tmp_path / "typo.jsonl")])
    assert bad.exit_code != 0 and "file not found" in bad.output and len(_lines(wd / "regen.jsonl")) == 2
    again = runner.invoke(app, ["regen", "-r", str(recipe_file), "-e", stub.url, "-w", str(wd), "--no-resume"])
    assert again.exit_code != 0 and "--overwrite" in again.output and len(_lines(wd / "regen.jsonl")) == 2


@pytest.mark.slow
def test_a_stopped_run_names_the_command_that_resumes_its_own_stages(tmp_path, stub):
    """SIGTERM (scancel, kill) during `run --stages regen`: the command it prints resumes regen alone,
    not the whole pipeline (it once dropped --stages: pasted, it ran every stage after regen too)."""
    import os
    import signal
    import subprocess
    import sys

    from dspark_kit.recipe import dump_recipe

    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(dump_recipe(_recipe(tmp_path, ["slow"], endpoints=[stub.url], request_timeout=600.0)))
    cmd = [sys.executable, "-m", "dspark_kit", "run", str(recipe_file), "--stages", "regen", "-w", str(tmp_path / "w"),
           "--set", "regen.concurrency=1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 120
    while not stub.attempts["slow"] and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert stub.attempts["slow"], "regen never sent its request"
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out + err
    line = next(ln for ln in err.splitlines() if "resumes" in ln)
    assert f"--set regen.concurrency=1 --stages regen -w {tmp_path / 'w'}` resumes" in line, line


def test_server_still_starting_is_waited_for(tmp_path):
    """No --model: GET /models is retried while the server refuses connections (within the window)."""
    port, box = free_port(), {}
    timer = threading.Timer(1.0, lambda: box.setdefault("stub", Stub(port=port)))
    timer.start()
    try:
        summary = run_regen(Resolved(_recipe(tmp_path, ["ok"] * 3, unavailable_timeout=20, max_retries=0)),
                            tmp_path / "out.jsonl", endpoints=[f"http://127.0.0.1:{port}/v1"], backoff_base=0.05)
    finally:
        timer.join()
        box["stub"].stop()
    assert summary["written"] == 3 and summary["endpoints"][0]["model"] == "stub"


def test_odd_reply_bodies_are_failed_rows(tmp_path, stub):
    out = tmp_path / "out.jsonl"
    summary = run_regen(Resolved(_recipe(tmp_path, ["ok", *ODD_BODIES], max_retries=0)), out, endpoints=[stub.url])
    assert summary["written"] == 1 and summary["failed"] == len(ODD_BODIES)
    reasons = [e["reason"] for e in _lines(tmp_path / "out.jsonl.errors.jsonl")]
    assert len(reasons) == len(ODD_BODIES) and all(r.startswith("malformed response") for r in reasons), reasons


def test_a_bug_in_the_request_path_stops_the_run(tmp_path, stub, monkeypatch):
    """Before: any exception in a worker (here a bug building the row) became a per-row "failed"
    and the run completed; now only failed requests are rows' failures and a bug surfaces."""
    from dspark_kit.stages.dataset import regen

    def broken(_history):
        raise ZeroDivisionError("a bug in the row builder")

    monkeypatch.setattr(regen, "to_sharegpt", broken)
    out = tmp_path / "out.jsonl"
    with pytest.raises(ZeroDivisionError, match="a bug in the row builder"):
        run_regen(Resolved(_recipe(tmp_path, ["ok"] * 20)), out, endpoints=[stub.url], concurrency=3)
    assert out.read_text() == "" and not _lines(tmp_path / "out.jsonl.errors.jsonl")
