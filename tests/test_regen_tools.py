"""regen on tool-calling chats (issue 31, point 1), against a stub answering in OpenAI's tool-call
format: the request carries the row's `tools`, the verifier's calls are kept as it made them, the
dataset's results are spliced in under the new calls' ids (never invented), a multi-step chain goes
on until the verifier answers in text, and a call the dataset has no result for ends the row with
its reason. The rows then go through prepare on Qwen3's template with the calls trained."""

from __future__ import annotations

import json

import pytest
from aiohttp import web
from test_regen_faults import Stub

from dspark_kit.recipe import Recipe
from dspark_kit.resolved import Resolved
from dspark_kit.stages.dataset.regen import TOOL_RESULT_MISSING, TOOL_RESULT_OTHER, run_regen

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


class ToolStub(Stub):
    """The user's text says how many calls to make (`calls:N`, one per step) and to which tool;
    after the last result the reply is text quoting the results it saw."""

    def __init__(self):
        super().__init__()
        self.bodies: list[dict] = []

    async def chat(self, request):
        body = await request.json()
        self.bodies.append(body)
        msgs = body["messages"]
        user = next(m for m in reversed(msgs) if m["role"] == "user")["content"]
        want = int(user.split("calls:")[1].split()[0]) if "calls:" in user else 0
        tool = "get_time" if "time" in user else "get_weather"
        since = msgs[max(i for i, m in enumerate(msgs) if m["role"] == "user") + 1:]
        made = sum(len(m.get("tool_calls") or []) for m in since)
        msg: dict = {"role": "assistant", "content": None}
        if body.get("tools") and made < want:
            n = len(self.bodies)
            msg["tool_calls"] = [{"id": f"call_{n}", "type": "function",
                                  "function": {"name": tool, "arguments": json.dumps({"city": "Paris"})}}]
        else:
            msg["content"] = "saw " + ",".join(m["content"] for m in since if m["role"] == "tool")
        return web.json_response({"choices": [{"message": msg, "finish_reason": "tool_calls" if "tool_calls" in msg
                                               else "stop"}],
                                  "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})


@pytest.fixture
def stub():
    s = ToolStub()
    yield s
    s.stop()


def chat(question: str, results: list[str], tools=TOOLS, name: str | None = None) -> dict:
    """A dataset row: the question, the original assistant's calls and their results, its answer."""
    msgs = [{"role": "user", "content": question}]
    for k, r in enumerate(results):
        msgs.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": f"orig{k}", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]})
        msgs.append({"role": "tool", "tool_call_id": f"orig{k}", "content": r, **({"name": name} if name else {})})
    msgs.append({"role": "assistant", "content": "the original answer"})
    return {"messages": msgs, **({"tools": tools} if tools else {})}


def regen(tmp_path, stub, rows):
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = Recipe.model_validate({"data": {"source": str(src)}, "regen": {"request_timeout": 5.0}})
    out = tmp_path / "regen.jsonl"
    summary = run_regen(Resolved(recipe, tmp_path), out, endpoints=[stub.url], backoff_base=0.01)
    rows = sorted((json.loads(x) for x in out.read_text().splitlines()), key=lambda r: r["metadata"]["idx"])
    return summary, rows


def test_calls_are_kept_and_the_datasets_results_spliced_in(tmp_path, stub):
    summary, rows = regen(tmp_path, stub, [chat("weather calls:2", ["sunny", "21C"]),
                                           chat("weather calls:0", ["unused"]),
                                           chat("plain question", [], tools=None)])
    assert summary["written"] == 3 and not summary["failed"] and not summary["tool_chains_cut"]
    two = rows[0]
    assert two["tools"] == TOOLS
    assert [(t["from"], t["value"]) for t in two["conversations"]] == [
        ("human", "weather calls:2"), ("gpt", ""), ("tool", "sunny"), ("gpt", ""), ("tool", "21C"), ("gpt", "saw sunny,21C")]
    calls = [t["tool_calls"] for t in two["conversations"] if "tool_calls" in t]
    ids = [c[0]["id"] for c in calls]
    assert [c[0]["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}] * 2
    assert [t["tool_call_id"] for t in two["conversations"] if t["from"] == "tool"] == ids  # the new calls' ids
    assert two["metadata"]["finish_reasons"] == ["tool_calls", "tool_calls", "stop"]
    # every request of a tool row carried its tools, and the history it sent held the calls and results
    sent = [b for b in stub.bodies if b["messages"][0]["content"] == "weather calls:2"]
    assert len(sent) == 3 and all(b["tools"] == TOOLS for b in sent)
    assert sent[2]["messages"][1]["tool_calls"] == calls[0] and sent[2]["messages"][2]["tool_call_id"] == ids[0]
    # the verifier answered without calling: the dataset's result is not spliced in, and it is counted
    assert [t["from"] for t in rows[1]["conversations"]] == ["human", "gpt"]
    assert rows[1]["metadata"]["tool_results_unused"] == 1
    assert "tools" not in rows[2] and not any("tools" in b for b in stub.bodies if b["messages"][0]["content"] == "plain question")


def test_a_call_without_a_dataset_result_ends_the_row(tmp_path, stub):
    summary, rows = regen(tmp_path, stub, [chat("weather calls:3", ["sunny"]),
                                           chat("time calls:1", ["noon"], name="get_weather")])
    assert summary["written"] == 2
    assert summary["tool_chains_cut"] == {TOOL_RESULT_MISSING: 1, TOOL_RESULT_OTHER: 1}
    assert [t["from"] for t in rows[0]["conversations"]] == ["human", "gpt", "tool", "gpt"]  # ends on the call
    assert rows[0]["metadata"]["tool_chain"] == TOOL_RESULT_MISSING
    assert [t["from"] for t in rows[1]["conversations"]] == ["human", "gpt"]  # never a result for another tool
    assert rows[1]["conversations"][1]["tool_calls"][0]["function"]["name"] == "get_time"


@pytest.mark.slow  # prepares with the tiny verifier's tokenizer
def test_regenerated_tool_rows_prepare_with_the_calls_trained(tmp_path, stub, tiny_verifier):
    from chat_templates import QWEN3_TEMPLATE
    from transformers import AutoTokenizer

    from dspark_kit.stages.dataset.prepare import prepare

    _, rows = regen(tmp_path, stub, [chat("weather calls:2", ["sunny", "21C"]), chat("time calls:3", ["noon"])])
    tok = AutoTokenizer.from_pretrained(tiny_verifier)
    tok.chat_template = QWEN3_TEMPLATE
    tok.save_pretrained(tmp_path / "qwen3-tok")
    s = prepare(rows, str(tmp_path / "qwen3-tok"), tmp_path / "prepared", seq_length=4096, thinking=False)
    assert (s.conversations_used, s.with_tools, s.tool_calls, s.rows_out) == (2, 2, 4, 5)
    from datasets import load_from_disk

    spans = set()
    for r in load_from_disk(str(tmp_path / "prepared")):
        ids, mask = r["input_ids"].tolist(), r["loss_mask"].tolist()
        assert "<tools>" in tok.decode(ids)  # the schema is in every row's context
        spans.add(tok.decode([i for i, m in zip(ids, mask, strict=True) if m]))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    assert spans == {call, "saw sunny,21C<|im_end|>", call.replace("get_weather", "get_time")}


def test_tool_calls_parse_whole_and_streamed():
    from dspark_kit.engines.chat_client import MalformedResponse, parse_chat_response

    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Oslo"}'}}
    whole = parse_chat_response({"choices": [{"message": {"content": None, "tool_calls": [call]}}]})
    assert whole["tool_calls"] == [call] and whole["text"] == ""
    chunks = [{"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                                      "function": {"name": "get_time", "arguments": ""}}]}}]},
              {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}}]},
              {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}}]},
              {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]}]
    assert parse_chat_response(chunks)["tool_calls"] == [call]
    assert parse_chat_response({"choices": [{"message": {"content": "hi"}}]})["tool_calls"] is None
    for bad in ([{"function": {"arguments": "{}"}}], [{"function": {"name": "f", "arguments": {"a": 1}}}], "call"):
        with pytest.raises(MalformedResponse):
            parse_chat_response({"choices": [{"message": {"content": None, "tool_calls": bad}}]})
