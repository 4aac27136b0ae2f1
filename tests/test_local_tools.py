"""Tool calls on the local engine and the tiny verifier's template (engines/local/tools.py,
data/tiny_verifier.py, data/tiny_tools.py): what vLLM's hermes parser and Qwen3's template do."""

from __future__ import annotations

import json

import pytest
from chat_templates import QWEN3_TEMPLATE
from transformers.utils.chat_template_utils import _compile_jinja_template

from dspark_kit.data.conversations import normalize, row_tools
from dspark_kit.data.tiny_corpus import conversations
from dspark_kit.data.tiny_tools import TOOLS, tool_conversations
from dspark_kit.data.tiny_verifier import CHAT_TEMPLATE
from dspark_kit.engines.local.tools import refusal, split_tool_calls

CALL = '<tool_call>\n{"name": "count_words", "arguments": {"text": "a b"}}\n</tool_call>'


def test_the_tiny_template_is_qwen3s_on_plain_and_tool_calling_chats():
    """Every prefix of every tiny-tools chat and the plain corpus, both thinking modes, with and
    without the generation prompt: the same text as Qwen3-8B's own template."""
    tiny, qwen3 = _compile_jinja_template(CHAT_TEMPLATE), _compile_jinja_template(QWEN3_TEMPLATE)
    cases = [(m, None) for m in conversations(100)]
    cases += [(row["messages"][:cut], row["tools"]) for row in tool_conversations(30)
              for cut in range(1, len(row["messages"]) + 1)]
    renders = 0
    for msgs, tools in cases:
        for thinking in (True, False):
            for gen in (False, True):
                kw = {"messages": msgs, "tools": tools, "add_generation_prompt": gen, "enable_thinking": thinking}
                assert tiny.render(**kw) == qwen3.render(**kw), (msgs, thinking, gen)
                renders += 1
    assert renders == 4 * len(cases) > 900 and any(t for _, t in cases)


def test_the_tiny_tool_corpus_is_valid_and_deterministic():
    rows = tool_conversations(60, seed=3)
    assert rows == tool_conversations(60, seed=3) and rows != tool_conversations(60, seed=4)
    chains = 0
    for row in rows:
        msgs = normalize(row)
        assert row_tools(row) and [m["role"] for m in msgs][-1] == "assistant"
        calls = [m for m in msgs if m.get("tool_calls")]
        results = [m for m in msgs if m["role"] == "tool"]
        assert len(calls) == len(results) >= 1  # every call has its result, never an invented one
        names = {t["function"]["name"] for t in TOOLS}
        assert all(c["function"]["name"] in names for m in calls for c in m["tool_calls"])
        chains += len(calls) == 2
    assert 0 < chains < len(rows)  # one-step calls and two-step chains


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("just text", "just text", []),
    (CALL, None, [("count_words", {"text": "a b"})]),
    ("let me count.\n" + CALL, "let me count.\n", [("count_words", {"text": "a b"})]),
    (CALL + "\n" + CALL.replace("a b", "c"), None, [("count_words", {"text": "a b"}), ("count_words", {"text": "c"})]),
    ('<tool_call>\n{"name": "rhyme_for", "arguments": {"word": "é"}}', None, [("rhyme_for", {"word": "é"})]),  # cut off
    ("<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),  # stays text
    ('<tool_call>\n{"arguments": {}}\n</tool_call>', '<tool_call>\n{"arguments": {}}\n</tool_call>', []),
])
def test_replies_split_as_vllms_hermes_parser_splits_them(text, content, calls):
    got_content, got = split_tool_calls(text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in got)
    assert len({c["id"] for c in got}) == len(got)
    if calls:
        assert '"é"' in got[-1]["function"]["arguments"] or "é" not in text  # ensure_ascii=False, as vLLM


def test_requests_with_tools_are_refused_as_vllm_refuses_them():
    assert refusal(None, None, enabled=False) is None and refusal(TOOLS, "none", enabled=False) is None
    assert refusal(TOOLS, None, enabled=True) is None and refusal(TOOLS, "auto", enabled=True) is None
    assert "serve.tool_call_parser" in refusal(TOOLS, "auto", enabled=False)
    assert "--enable-auto-tool-choice" in refusal(TOOLS, None, enabled=False)
    assert "guided decoding" in refusal(TOOLS, "required", enabled=True)
    assert "guided decoding" in refusal(TOOLS, {"type": "function", "function": {"name": "x"}}, enabled=True)
    assert "without tools" in refusal(None, "required", enabled=True)
    assert "not one of" in refusal(TOOLS, "sometimes", enabled=True)


def test_serve_tool_call_parser_reaches_the_chat_servers(tmp_path, vllm_cpu_stub):
    from dspark_kit.recipe import load_recipe
    from dspark_kit.resolved import Resolved
    from dspark_kit.stages.server_plan import server_plan
    from tests.conftest import TINY_RECIPE

    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    for engine in ("local", "vllm"):
        r = load_recipe(TINY_RECIPE, [f"serve.engine={engine}", "train.device=cpu"])
        assert r.serve.tool_call_parser == "hermes"  # the tiny recipe serves its tool corpus
        res = Resolved(r, tmp_path, planning=True)
        chat = server_plan(res, "chat", port=8123).argv
        assert chat[chat.index("--enable-auto-tool-choice"):][:3] == flags, engine
        assert "--tool-call-parser" not in server_plan(res, "hidden-states", port=8124).argv
    off = load_recipe(TINY_RECIPE, ["serve.tool_call_parser=null"])
    assert "--tool-call-parser" not in server_plan(Resolved(off, tmp_path, planning=True), "chat", port=8125).argv
    bad = load_recipe(TINY_RECIPE, ["serve.tool_call_parser=mistral"])
    with pytest.raises(ValueError, match="serve.tool_call_parser 'mistral': the local engine parses hermes"):
        server_plan(Resolved(bad, tmp_path, planning=True), "chat", port=8126)
