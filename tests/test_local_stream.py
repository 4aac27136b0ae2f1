"""`stream: true` on the local engine: server-sent events as vLLM sends them."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_local_server import _chat, _serve, verifier  # noqa: F401 - verifier is a fixture

from dspark_kit.data.reasoning_formats import THINK
from dspark_kit.engines.local.stream import TextStream

# ---- the text released as it becomes final (no model) -------------------------------------


def _pieces(text_stream: TextStream, tokens: list[int], final: str) -> tuple[list[dict], dict]:
    out = [text_stream.push([t]) for t in tokens]
    return out, text_stream.finish(final)


def _joined(pieces: list[dict], last: dict, key: str) -> str:
    return "".join(p.get(key, "") for p in [*pieces, last])


def test_text_is_released_only_when_final():
    chars = "hello world"
    decode = lambda ids: "".join(chars[i] for i in ids)  # one token per character
    ts = TextStream(decode, frozenset(), stops=["wor"])
    pieces, last = _pieces(ts, list(range(len(chars))), "hello ")
    assert _joined(pieces, last, "text") == "hello "  # the stop string and what follows never go out
    assert "".join(p.get("text", "") for p in pieces[:3]) == "h"  # "el" is held: it could begin a stop string
    # a stop token is not text; an incomplete character waits for the rest of its bytes
    ts = TextStream(lambda ids: {(1,): "a", (1, 2): "a\ufffd", (1, 2, 3): "aé"}[tuple(i for i in ids)],
                    frozenset([9]), stops=[])
    assert ts.push([1]) == {"text": "a"} and ts.push([2]) == {} and ts.push([3]) == {"text": "é"}
    assert ts.push([9]) == {} and ts.finish("aé") == {}


def test_reasoning_is_split_like_the_whole_reply():
    text = "<think>\nplan it\n</think>\n\nthe answer"
    ts = TextStream(lambda ids: text[: len(ids)], frozenset(), stops=[], field="content",
                    split=THINK.split_reply)
    pieces, last = _pieces(ts, list(range(len(text))), text)
    whole = THINK.split_reply(text)
    assert _joined(pieces, last, "reasoning_content") == whole["reasoning_content"]
    assert _joined(pieces, last, "content") == whole["content"]
    assert not any("<think" in p.get("content", "") or "</think" in p.get("reasoning_content", "")
                   for p in [*pieces, last])


# ---- the engine over HTTP ------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(verifier):  # noqa: F811
    s = _serve(verifier, "--served-model-name", "tiny")
    yield s
    s.stop()


def _events(url: str, path: str, body: dict) -> list[str]:
    """Raw `data:` payloads of one streamed request, in order."""
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Describe the red fox in the forest."}],
        "max_tokens": 24, "chat_template_kwargs": {"enable_thinking": False}}


@pytest.mark.slow
def test_chat_stream_matches_whole_reply_in_vllm_shape(server):
    whole = _chat(server.url, CHAT["messages"][0]["content"], max_tokens=24).json()
    events = _events(server.url, "/v1/chat/completions",
                     {**CHAT, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "tiny" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    body, usage = chunks[:-1], chunks[-1]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]  # include_usage: a last chunk
    assert all("usage" not in c for c in body)
    assert len(body) > 3  # token by token, not one piece
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in body)
    assert text == whole["choices"][0]["message"]["content"]
    assert [c["choices"][0]["finish_reason"] for c in body] == [None] * (len(body) - 1) + [
        whole["choices"][0]["finish_reason"]]
    assert [t for c in body for t in c["choices"][0]["token_ids"]] == whole["choices"][0]["token_ids"]


@pytest.mark.slow
def test_openai_client_streams_chat_and_completions(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0)
    whole = client.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=24,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    t0, first, parts, usage = time.perf_counter(), None, [], None
    for chunk in client.chat.completions.create(
            model="tiny", messages=CHAT["messages"], max_tokens=24, stream=True,
            stream_options={"include_usage": True}, extra_body={"chat_template_kwargs": {"enable_thinking": False}}):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - t0
            parts.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    total = time.perf_counter() - t0
    assert "".join(parts) == whole.choices[0].message.content
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert first < total  # the first text arrives before the reply is done: TTFT is real

    prompt = whole.usage.prompt_tokens * [5]
    ref = client.completions.create(model="tiny", prompt=prompt, max_tokens=12)
    streamed = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=12, stream=True,
                                              stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == ref.choices[0].text
    assert streamed[-1].choices == [] and streamed[-1].usage.completion_tokens == ref.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == ref.choices[0].finish_reason


@pytest.mark.slow
def test_stream_stop_strings_and_continuous_usage(server):
    whole = _chat(server.url, CHAT["messages"][0]["content"], max_tokens=24).json()["choices"][0]["message"]["content"]
    stop = whole.split()[2]  # a word the reply really contains
    cut = _chat(server.url, CHAT["messages"][0]["content"], max_tokens=24, stop=[stop]).json()["choices"][0]
    events = [json.loads(e) for e in _events(server.url, "/v1/chat/completions", {
        **CHAT, "stop": [stop], "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})[:-1]]
    body = events[:-1]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in body) == cut["message"]["content"]
    assert body[-1]["choices"][0]["finish_reason"] == cut["finish_reason"] == "stop"
    counts = [c["usage"]["completion_tokens"] for c in body]
    assert counts == sorted(counts) and all("usage" in c for c in body)


@pytest.mark.slow
def test_client_leaving_mid_stream_stops_decoding(verifier):  # noqa: F811
    s = _serve(verifier, "--token-delay-ms", "50")
    engine = s.engine
    try:
        body = {"prompt": [1, 5, 6], "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
            next(r.iter_lines())  # the first event: decoding is under way; then hang up
        deadline = time.time() + 30
        while engine.aborted == 0 or engine.in_flight:
            assert time.time() < deadline, "decoding went on after the client left"
            time.sleep(0.05)
        # the decoder is free again (nothing in flight, the abandoned request aborted): a short request
        # is answered, and the abandoned one decoded far fewer than its 400 tokens
        aborted = engine.aborted
        short = httpx.post(s.url + "/v1/completions", json={"prompt": [1, 5], "max_tokens": 1}, timeout=30)
        assert short.is_success and short.json()["usage"]["completion_tokens"] == 1
        assert engine.aborted == aborted and not engine.in_flight
    finally:
        s.stop()
