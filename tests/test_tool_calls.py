"""Tool-calling conversations through prepare (issue 31, point 1).

On Qwen3's real chat template (tools branch and all): every row's input_ids are the template's
own rendering with the row's `tools`, and the loss mask is exactly each assistant turn's text and
tool calls through `<|im_end|>` (hand-written below), never the schema or a tool result. The same
chat as OpenAI messages or ShareGPT `function_call` / `observation` turns gives the same rows; a
template without tool branches, or a malformed call, is a rejected row with its reason. And
speculators 0.9.0's own prepare-data boundary code, rendering through the same template, makes the
same input_ids; its masks differ only by the `\\n` after each `<|im_end|>` (prepare.py says why).
"""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
from chat_templates import NO_TOOLS_TEMPLATE, QWEN3_TEMPLATE

from dspark_kit.data.conversations import ConversationError, normalize, row_format, row_tools
from dspark_kit.data.template_rows import TEMPLATE_DROPS_CALLS, TEMPLATE_DROPS_TOOLS, turn_rows
from dspark_kit.stages.dataset.prepare import prepare

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = '{"city":"Paris"}'  # as a dataset may hold it: rendered as the object (vLLM's way, below)


def openai_row(reasoning: bool) -> dict:
    r = ({"reasoning_content": "I need the weather."}, {"reasoning_content": "It is sunny."}) if reasoning else ({}, {})
    return {"tools": TOOLS, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", **r[0], "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": CALL}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21C"},
        {"role": "assistant", "content": "Sunny, 21C.", **r[1]}]}


def sharegpt_row() -> dict:
    """LLaMA-Factory's ShareGPT tool shape: tools (bare function schemas) and calls as JSON text,
    results as `observation`, the system prompt as a top-level `system` (it becomes the system turn;
    a row with both that and a system turn is refused, test_data_formats.py)."""
    return {"tools": json.dumps([t["function"] for t in TOOLS]), "system": "Be brief.", "conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": json.loads(CALL)})},
        {"from": "observation", "value": "sunny, 21C"},
        {"from": "gpt", "value": "Sunny, 21C."}]}


CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'


@pytest.fixture()
def qwen3(tiny_verifier):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tiny_verifier)
    t.chat_template = QWEN3_TEMPLATE
    return t


def spans(tok, ids, mask) -> list[str]:
    """The loss-masked runs of a row, decoded."""
    out, run = [], []
    for i, m in zip(ids, mask):
        if m:
            run.append(i)
        elif run:
            out.append(tok.decode(run))
            run = []
    return out + ([tok.decode(run)] if run else [])


def as_vllm_renders(msgs: list[dict]) -> list[dict]:
    """vLLM parses a call's JSON-text arguments into an object before it applies the template
    (vllm/renderers/chat_utils.py, _postprocess_messages); the template writes it back (`tojson`)."""
    out = json.loads(json.dumps(msgs))
    for m in out:
        for c in m.get("tool_calls") or ():
            if isinstance(c["function"]["arguments"], str):
                c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    return out


def template_ids(tok, msgs, **kw) -> list[int]:
    text = tok.apply_chat_template(as_vllm_renders(msgs), tools=TOOLS, tokenize=False, **kw)
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.slow  # the tiny verifier's tokenizer
def test_thinking_off_rows_are_qwen3s_rendering_and_train_the_calls(qwen3):
    row = openai_row(reasoning=False)
    t = turn_rows(qwen3, normalize(row), False, tools=row_tools(row))
    msgs = row["messages"]
    # history renders a call turn without the empty think block its reply had: one row per turn
    assert t.fanned and len(t.rows) == 2
    for (ids, mask), j in zip(t.rows, (2, 4)):
        assert ids == template_ids(qwen3, msgs[: j + 1], enable_thinking=False)
        assert ids[: mask.index(1)] == template_ids(qwen3, msgs[:j], add_generation_prompt=True, enable_thinking=False)
    assert spans(qwen3, *t.rows[0]) == ["Let me check.\n" + CALL_TEXT]
    assert spans(qwen3, *t.rows[1]) == ["Sunny, 21C.<|im_end|>"]
    text = qwen3.decode(t.rows[1][0])
    assert '"name": "get_weather", "description"' in text and "sunny, 21C" in text  # schema, result: context


@pytest.mark.slow  # the tiny verifier's tokenizer
def test_thinking_on_with_reasoning_is_one_row_the_full_rendering(qwen3):
    row = openai_row(reasoning=True)
    t = turn_rows(qwen3, normalize(row), True, tools=row_tools(row))
    assert not t.fanned and len(t.rows) == 1
    ids, mask = t.rows[0]
    assert ids == template_ids(qwen3, row["messages"])
    assert spans(qwen3, ids, mask) == [
        "<think>\nI need the weather.\n</think>\n\nLet me check.\n" + CALL_TEXT,
        "<think>\nIt is sunny.\n</think>\n\nSunny, 21C.<|im_end|>"]


@pytest.mark.slow  # the tiny verifier's tokenizer
def test_sharegpt_function_call_rows_equal_openai_rows(qwen3):
    a, b = openai_row(False), sharegpt_row()
    a["messages"][2]["content"] = ""  # a ShareGPT call turn carries the call alone
    assert (row_format(a), row_format(b)) == ("OpenAI messages", "ShareGPT")
    assert row_tools(b) == row_tools(a) == TOOLS
    ours = normalize(b)
    assert [m["role"] for m in ours] == ["system", "user", "assistant", "tool", "assistant"]
    assert ours[2]["tool_calls"] == [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    rows = turn_rows(qwen3, ours, False, tools=row_tools(b)).rows
    assert rows == turn_rows(qwen3, normalize(a), False, tools=row_tools(a)).rows
    assert spans(qwen3, *rows[0]) == [CALL_TEXT]


def test_tools_render_as_vllm_hands_them_to_the_template():
    """vLLM's request model: type + function {name, description, parameters; strict and
    defer_loading when set}, other keys dropped, absent ones null; a bare schema is wrapped."""
    bare = {"parameters": {"type": "object"}, "name": "f", "x-vendor": 1, "strict": True}
    assert row_tools({"tools": [bare, {"type": "function", "function": {"name": "g"}}]}) == [
        {"type": "function", "function": {"name": "f", "description": None, "parameters": {"type": "object"},
                                          "strict": True}},
        {"type": "function", "function": {"name": "g", "description": None, "parameters": None}}]
    assert list(row_tools({"tools": [bare]})[0]["function"]) == ["name", "description", "parameters", "strict"]


@pytest.mark.parametrize(("row", "reason"), [
    ({"tools": "[{not json", "messages": [{"role": "user", "content": "q"}]}, "tools is not valid JSON"),
    ({"tools": {"name": "x"}, "messages": [{"role": "user", "content": "q"}]}, "tools must be a list"),
    ({"tools": [{"type": "retrieval"}], "messages": [{"role": "user", "content": "q"}]}, "only function tools"),
    ({"tools": [{"description": "no name"}], "messages": [{"role": "user", "content": "q"}]}, "needs a function name"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": '{"arguments": {}}'}]},
     "turn 1: a tool call needs a function name"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "",
                                                       "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}]},
     "turn 1: tool call arguments must be a JSON object"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "",
                                                       "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]},
     "turn 1: tool call arguments is not valid JSON"),
])
def test_malformed_tool_rows_name_their_reason(row, reason):
    with pytest.raises(ConversationError, match=reason):
        normalize(row) and row_tools(row)


@pytest.mark.slow  # writes a prepared dataset
def test_prepare_accounts_for_every_tool_row(tmp_path, tiny_verifier, qwen3, capsys):
    """Rows in both formats and a bad one: the log names each format read and every reject; with the
    template without tool branches a tool row is refused, never trained as an empty reply."""
    from transformers import AutoTokenizer

    qwen3.save_pretrained(tmp_path / "qwen3-tok")
    rows = [openai_row(False), sharegpt_row(), {"conversations": [{"from": "human", "value": "q"},
                                                                 {"from": "function_call", "value": "{oops"}]}]
    s = prepare(rows, str(tmp_path / "qwen3-tok"), tmp_path / "out", seq_length=4096, thinking=False)
    assert (s.conversations_in, s.conversations_used, s.rows_out) == (3, 2, 4)
    assert s.formats == Counter({"ShareGPT": 2, "OpenAI messages": 1})
    assert (s.with_tools, s.tool_calls) == (2, 2)
    assert list(s.rejected) == ["turn 1: tool call is not valid JSON (Expecting property name enclosed in double quotes)"]
    log = capsys.readouterr().err
    assert "read as ShareGPT (2 rows), OpenAI messages (1 rows)" in log and "2 tool calls trained" in log

    no_tools = AutoTokenizer.from_pretrained(tiny_verifier)
    no_tools.chat_template = NO_TOOLS_TEMPLATE
    no_tools.save_pretrained(tmp_path / "no-tools-tok")
    with pytest.raises(ValueError, match="no trainable rows"):
        prepare(rows[:2], str(tmp_path / "no-tools-tok"), tmp_path / "tiny", seq_length=4096, thinking=False)
    assert TEMPLATE_DROPS_TOOLS in capsys.readouterr().err


@pytest.mark.slow  # the tiny verifier's tokenizer
def test_a_template_that_drops_calls_refuses_the_row(tiny_verifier):
    """A template without tool branches: a call would render as an empty reply."""
    from transformers import AutoTokenizer

    row = openai_row(False)
    tok = AutoTokenizer.from_pretrained(tiny_verifier)
    tok.chat_template = NO_TOOLS_TEMPLATE
    with pytest.raises(ConversationError, match=f"turn 2: {re.escape(TEMPLATE_DROPS_CALLS)}"):
        turn_rows(tok, normalize(row), False)


def _speculators_rows(monkeypatch, tok, rows: list[dict], max_length: int = 4096) -> list[tuple[list, list]]:
    """speculators 0.9.0's prepare-data boundary rows for `rows`; its render endpoint (vLLM's
    /v1/chat/completions/render: parse call arguments, apply the chat template with the request's
    tools, tokenize without added special tokens) answered in process from the same tokenizer."""
    from speculators.data_generation import preprocessing

    def render(endpoint, messages, *, add_generation_prompt, tools=None, truncate_prompt_tokens=None, **_):
        text = tok.apply_chat_template(as_vllm_renders(messages), tools=tools, tokenize=False,
                                       add_generation_prompt=add_generation_prompt)
        return tok(text, add_special_tokens=False)["input_ids"][:truncate_prompt_tokens]

    monkeypatch.setattr(preprocessing, "render_conversation", render)
    batch = {"conversations": [r["messages"] for r in rows], "tools": [json.dumps(r["tools"]) for r in rows]}
    out = preprocessing._preprocess_batch(batch, False, "http://render.invalid", max_length)
    return [(ids.tolist(), mask.tolist()) for ids, mask in zip(out["input_ids"], out["loss_mask"], strict=True)]


def _without_newline_after_im_end(tok, ids, mask) -> list[int]:
    """speculators' mask less the template's `\\n` after each `<|im_end|>` (never generated)."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    return [0 if k and ids[k - 1] == end and tok.decode([ids[k]]).strip() == "" else m for k, m in enumerate(mask)]


@pytest.mark.slow
@pytest.mark.parametrize("reasoning", [False, True])
def test_speculators_prepare_data_makes_the_same_rows(monkeypatch, qwen3, reasoning):
    """speculators renders without enable_thinking (the template's default: thinking on)."""
    row = openai_row(reasoning)
    theirs = _speculators_rows(monkeypatch, qwen3, [row])
    ours = turn_rows(qwen3, normalize(row), True, tools=row_tools(row))
    assert len(theirs) == 2
    if reasoning:  # history keeps reasoning after the last user turn: one row for both turns
        (ids, mask), = ours.rows
        assert ids == theirs[1][0] and ids[: len(theirs[0][0])] == theirs[0][0]
        union = [max(a, b) for a, b in zip(theirs[0][1] + [0] * (len(ids) - len(theirs[0][1])), theirs[1][1])]
        assert mask == _without_newline_after_im_end(qwen3, ids, union)
    else:
        assert [ids for ids, _ in ours.rows] == [ids for ids, _ in theirs]
        for (ids, mask), (_, their_mask) in zip(ours.rows, theirs):
            assert mask == _without_newline_after_im_end(qwen3, ids, their_mask) != their_mask
