"""Issue 14: bad input gets a 4xx in OpenAI's error shape, never a 500 or a silent 200.

Each case below was a 500 (traceback in the log) or a 200 on the old server.
"""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_local_server import ThreadServer, _metric, _serve, verifier  # noqa: F401 (fixture)

from dspark_kit.engines.local.server import Engine, build_generator, create_app, parse_args

pytestmark = pytest.mark.slow  # every test serves the tiny verifier


@pytest.fixture(scope="module")
def server(verifier):  # noqa: F811
    s = _serve(verifier, "--served-model-name", "tiny", "--max-model-len", "512")
    yield s
    s.stop()


def _chat_body(content="hi", **extra):
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4,
            "chat_template_kwargs": {"enable_thinking": False}, **extra}


def _assert_openai_error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status and err["message"]


@pytest.mark.parametrize("extra", [
    {"top_p": 1e-300, "temperature": 1.0},  # was: invalid multinomial distribution
    {"temperature": 1e-300},  # was: probability tensor contains inf/nan
])
def test_extreme_but_legal_sampling_values_decode(server, extra):
    r = httpx.post(server.url + "/v1/chat/completions", json=_chat_body(**extra), timeout=60)
    assert r.status_code == 200, r.text


def test_seed_outside_int64_is_400_not_overflow(server):
    r = httpx.post(server.url + "/v1/chat/completions", json=_chat_body(temperature=1.0, seed=2**70))
    _assert_openai_error(r, 400)
    ok = httpx.post(server.url + "/v1/chat/completions", json=_chat_body(temperature=1.0, seed=2**63 - 1),
                    timeout=60)
    assert ok.status_code == 200, ok.text


def test_completions_max_tokens_null_means_up_to_the_context(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": None}, timeout=120)
    assert r.status_code == 200, r.text


def _raw_post(url, path, raw: bytes, content_type="application/json"):
    return httpx.post(url + path, content=raw, headers={"content-type": content_type}, timeout=30)


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user"}]},
    {"messages": [{"role": "user", "content": None}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
    {"messages": [{"role": "user", "content": "x"}], "max_tokens": True},
    {"messages": [{"role": "user", "content": "x"}], "temperature": 1e9},
    {"messages": [{"role": "user", "content": "x"}], "logprobs": True},
    {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
    {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
    {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
    {"messages": [{"role": "user", "content": "x"}], "frobnicate": 1},
])
def test_requests_vllm_refuses_are_400(server, body):
    r = httpx.post(server.url + "/v1/chat/completions", json={"max_tokens": 4, **body} if "max_tokens" not in body
                   else body, timeout=30)
    _assert_openai_error(r, 400)


def test_non_finite_temperature_and_lone_surrogate_are_400(server):
    # json.dumps writes Infinity and keeps "\ud800" as an escape: what a client can send
    inf = json.dumps(_chat_body(temperature=float("inf"))).encode()
    _assert_openai_error(_raw_post(server.url, "/v1/chat/completions", inf), 400)
    lone = json.dumps(_chat_body("\ud800x")).encode()
    _assert_openai_error(_raw_post(server.url, "/v1/chat/completions", lone), 400)
    lone_prompt = json.dumps({"prompt": "\udfffy", "max_tokens": 2}).encode()
    _assert_openai_error(_raw_post(server.url, "/v1/completions", lone_prompt), 400)


def test_404_405_and_invalid_utf8_use_the_openai_error_shape(server):
    _assert_openai_error(httpx.get(server.url + "/v1/nope"), 404)
    _assert_openai_error(httpx.get(server.url + "/v1/chat/completions"), 405)
    _assert_openai_error(_raw_post(server.url, "/v1/chat/completions", b'{"messages": "\xff\xfe"}'), 400)
    _assert_openai_error(_raw_post(server.url, "/v1/chat/completions", b"{not json"), 400)


def test_max_model_len_is_enforced(server):
    long = " ".join(["word"] * 700)
    r = httpx.post(server.url + "/v1/chat/completions", json=_chat_body(long), timeout=60)
    _assert_openai_error(r, 400)
    assert "512" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["max_model_len"] == 512


def _http_reply(sock: socket.socket) -> tuple[int, dict]:
    """Status and JSON body of one HTTP/1.1 response read off a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        more = sock.recv(65536)
        assert more, f"connection closed before a response: {data!r}"
        data += more
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        more = sock.recv(65536)
        assert more, "connection closed mid-response"
        body += more
    return int(lines[0].split()[1]), json.loads(body)


def test_chunked_upload_over_the_cap_is_413_while_reading(server):
    """No Content-Length, and a body whose last chunk never comes: only a server that counts
    while reading can answer (the old one buffered all of it, then tokenized it)."""
    def chunk(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:  # 60 s: a hang
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n" + chunk(b'{"prompt": "'))
        for _ in range(20):  # 20 MB, over the 16 MB cap; stop once the server has answered
            if select.select([sock], [], [], 0)[0]:
                break
            try:
                sock.sendall(chunk(b" " * 2**20))
            except (BrokenPipeError, ConnectionResetError):
                break
        status, body = _http_reply(sock)
    assert status == 413, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 413 and err["message"]


class GatedTokenizer:
    """The verifier's tokenizer, recording the size of each text it tokenizes; text holding
    GATE waits for `release` once it has set `entered`."""

    def __init__(self, tok):
        self._tok, self.sizes = tok, []
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, text, *args, **kw):
        self.sizes.append(len(text))
        if isinstance(text, str) and "GATE" in text:
            self.entered.set()
            assert self.release.wait(120), "the test never released the tokenizer"
        return self._tok(text, *args, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def test_health_answers_while_a_prompt_tokenizes_and_a_huge_one_is_refused_untokenized(verifier):  # noqa: F811
    path, model, tok = verifier
    gated = GatedTokenizer(tok)
    args = parse_args(["--model", path, "--max-model-len", "512"])
    s = ThreadServer(create_app(Engine(args, model, gated, build_generator(args, model))))
    try:
        big = json.dumps({"prompt": "abc " * 1_200_000, "max_tokens": 1}).encode()  # ~5 MB
        _assert_openai_error(_raw_post(s.url, "/v1/completions", big), 400)  # over max_model_len
        assert max(gated.sizes, default=0) < 2**20, "a 5 MB prompt was tokenized before being refused"
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(httpx.post, s.url + "/v1/completions", json={"prompt": "hello GATE", "max_tokens": 1},
                               timeout=120)
            assert gated.entered.wait(60), held.result() if held.done() else "the prompt never reached the tokenizer"
            # tokenizing runs off the event loop: /health answers while the tokenizer is held
            # (on the loop, this request would wait for a release that only comes after it)
            assert httpx.get(s.url + "/health", timeout=30).status_code == 200
            assert not held.done()
            gated.release.set()
            assert held.result().status_code == 200, held.result().text
    finally:
        gated.release.set()
        s.stop()


@pytest.mark.parametrize("rid", ["trail\n", "x\n", "ok\r"])
def test_request_id_with_trailing_newline_is_refused(verifier, tmp_path, rid):  # noqa: F811
    s = _serve(verifier, "--role", "hidden-states", "--layer-ids", "1,2,4", "--storage-path", str(tmp_path))
    try:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": [1, 5], "max_tokens": 1, "request_id": rid})
        _assert_openai_error(r, 400)
        assert list(tmp_path.iterdir()) == []
    finally:
        s.stop()


def test_abandoned_requests_stop_decoding(verifier):  # noqa: F811
    s = _serve(verifier, "--token-delay-ms", "20")
    engine = s.engine
    try:
        # ignore_eos: every request would decode 200 tokens, so only cancellation ends them early
        body = json.dumps({"prompt": [1, 5, 6], "max_tokens": 200, "ignore_eos": True}).encode()

        async def abandon(n):
            async def one():
                async with httpx.AsyncClient(timeout=0.3) as c:
                    try:
                        await c.post(s.url + "/v1/completions", content=body,
                                     headers={"content-type": "application/json"})
                    except httpx.TimeoutException:
                        pass  # the client gives up and closes the connection
            await asyncio.gather(*(one() for _ in range(n)))

        asyncio.run(abandon(10))
        # 10 x 200 tokens x 20 ms = 40 s of decoding if nobody noticed the clients left; the
        # deadline only bounds a hang, the counts below tell cancelled from finished
        deadline = time.time() + 60
        while engine.in_flight and time.time() < deadline:
            time.sleep(0.1)
        assert engine.in_flight == 0 and engine.aborted >= 9
        gen = _metric(httpx.get(s.url + "/metrics", timeout=30).text, "vllm:generation_tokens_total")
        # fewer than one request's 200: the one decoding stopped mid-way, the queued never began
        assert gen < 200, f"{gen} tokens decoded for clients that had left"
    finally:
        s.stop()


def test_tiny_prompt_still_served_and_sockets_closed(server):
    # sanity after the fault cases: the server still answers normal requests
    r = httpx.post(server.url + "/v1/chat/completions", json=_chat_body(), timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    with socket.create_connection(("127.0.0.1", server.port), timeout=5):
        pass


def test_local_plan_enforces_max_model_len_and_vets_extra_args(tiny_recipe):
    from typer.testing import CliRunner

    from dspark_kit.cli import app
    from dspark_kit.resolved import Resolved
    from dspark_kit.stages.server_plan import server_plan

    tiny_recipe.serve.max_model_len = 300
    tiny_recipe.serve.extra_args = ["--max-concurrency", "4"]
    argv = server_plan(Resolved(tiny_recipe), "chat", port=8123).argv
    assert argv[argv.index("--max-model-len") + 1] == "300" and argv[-2:] == ["--max-concurrency", "4"]
    assert parse_args(["--model", "m", *argv[argv.index("--role"):]]).max_model_len == 300
    tiny_recipe.serve.extra_args = ["--enforce-eager"]  # a vLLM flag the local engine does not have
    with pytest.raises(ValueError, match="not options of the local engine"):
        server_plan(Resolved(tiny_recipe), "chat", port=8123)
    r = CliRunner().invoke(app, ["serve", "--role", "chat", "--dry-run", "--set",
                                 'serve.extra_args=["--enforce-eager"]'])
    assert r.exit_code == 2 and "--enforce-eager" in r.output and len(r.output.strip().splitlines()) == 1


def test_spec_role_refuses_top_p_it_cannot_honour(verifier):  # noqa: F811
    from dspark_kit.engines.local.api import ApiError, CompletionRequest

    path, model, tok = verifier
    args = parse_args(["--model", path, "--role", "spec", "--draft", "unused"])
    engine = Engine(args, None, tok, object(), config=model.config)
    with pytest.raises(ApiError, match="top_p"):
        engine.check_model(CompletionRequest(prompt=[1], temperature=1.0, top_p=0.5))
    engine.check_model(CompletionRequest(prompt=[1], temperature=0.0, top_p=0.5))  # greedy: top_p moot


# ---- fuzz: any JSON a client can send gets < 500 ------------------------------------

_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20))
_value = st.recursive(_scalar, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                      st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=6)
_message = st.fixed_dictionaries({}, optional={
    "role": st.one_of(st.sampled_from(["user", "assistant", "system", "tool", "wizard"]), _scalar),
    "content": st.one_of(st.text(max_size=30), _value,
                         st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                         "text": st.one_of(st.text(max_size=10), _scalar)}),
                                  max_size=2))})
_chat = st.fixed_dictionaries({"messages": st.one_of(st.lists(_message, max_size=3), _value)}, optional={
    "max_tokens": st.one_of(st.integers(-2, 6), _scalar), "temperature": _scalar, "top_p": _scalar,
    "seed": _scalar, "n": _scalar, "stop": st.one_of(_scalar, st.lists(st.text(max_size=4), max_size=2)),
    "logprobs": _scalar, "response_format": _value, "chat_template_kwargs": _value,
    "add_generation_prompt": _scalar, "continue_final_message": _scalar, "stream": _scalar,
    "return_token_ids": _scalar, "x-unknown": _value})
_completion = st.fixed_dictionaries({"prompt": st.one_of(st.text(max_size=30), st.lists(
    st.integers(-5, 2000), max_size=6), _value)}, optional={
    "max_tokens": st.one_of(st.integers(-2, 6), _scalar), "temperature": _scalar, "top_p": _scalar,
    "seed": _scalar, "echo": _scalar, "suffix": _scalar, "request_id": _scalar, "logprobs": _scalar})


@pytest.fixture(scope="module")
def fuzz_server(verifier):  # noqa: F811
    s = _serve(verifier, "--max-model-len", "64")
    yield s
    s.stop()


def _post_fuzzed(server, path, body):
    raw = json.dumps(body, allow_nan=True).encode()  # ensure_ascii: lone surrogates travel as \udXXX
    r = httpx.post(server.url + path, content=raw,
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=_chat)
def test_fuzzed_chat_bodies_never_get_a_5xx(fuzz_server, body):
    _post_fuzzed(fuzz_server, "/v1/chat/completions", body)


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=_completion)
def test_fuzzed_completion_bodies_never_get_a_5xx(fuzz_server, body):
    _post_fuzzed(fuzz_server, "/v1/completions", body)
