"""Tool rows through the real CLI on the tiny recipe: regen -> prepare -> hidden states -> train.

builtin:tiny-tools is OpenAI-format agent traffic (tools, calls, results, answers). The tiny
recipe serves it with `serve.tool_call_parser: hermes` (the local engine parses `<tool_call>`
blocks as vLLM's hermes parser does: tests/test_vllm_real_tools.py), and the tiny verifier's
template is Qwen3's on these rows (tests/test_local_tools.py). The schema costs ~700 tokens in
the tiny tokenizer, hence the longer context. The tiny verifier never learned to call a tool, so
what it answers to these prompts is not the behaviour under test: regen goes through a proxy in
front of the real local engine that plants a call (the one the request asks for) in every other
row's first reply (tests/planting_proxy.py); everything else is the verifier's own. regen must
keep `tools` and send them (the prompt it was served is the template's rendering WITH the
schema), splice the dataset's result under a call and let the verifier go on, report the calls,
and prepare must train the call and never the schema or the result. Replies the verifier runs
to max_tokens are kept (data.keep_truncated): whether it stops on this machine's kernels is not
what this test is about. Never trained on tool results, the tiny verifier often slips a `</think>`
into its reply after one: regen drops those rows by the replies-vs-thinking-mode rule (counted),
with the budget raised here so the rest go on, and prepare follows regen's decision. With regen off, the dataset's own calls are trained, their results are not.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from planting_proxy import PlantingProxy, tool_call
from test_tool_calls import spans

from dspark_kit.data.tiny_tools import TOOLS, tool_conversations
from tests.conftest import TINY_RECIPE

pytestmark = pytest.mark.slow
ROWS = 24
SETS = ["data.source=builtin:tiny-tools", f"data.limit={ROWS}", "train.epochs=1", "data.seq_length=1024",
        "serve.max_model_len=1024", "train.logger=none"]


def _run(wd, stages: str, *sets: str) -> tuple[dict, str]:
    cmd = [sys.executable, "-m", "dspark_kit", "run", str(TINY_RECIPE), "-w", str(wd), "--json", "--stages", stages,
           *[a for s in [*SETS, *sets] for a in ("--set", s)]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {s["stage"]: s for s in json.loads(proc.stdout)["stages"]}, proc.stderr


def _prepared(wd):
    from datasets import load_from_disk

    return load_from_disk(str(wd / "prepared"))


@pytest.fixture()
def planting_engine(tmp_path, tiny_verifier):
    """The real local chat engine for these sets (tool parser on), behind a proxy that plants a call
    in every other first reply of a row (requests are numbered; a row's first reply answers a user)."""
    from dspark_kit.engines.lifecycle import ManagedServer
    from dspark_kit.recipe import load_recipe
    from dspark_kit.resolved import Resolved
    from dspark_kit.stages.server_plan import server_plan

    recipe = load_recipe(TINY_RECIPE, [*SETS, "serve.port=0"])
    server = ManagedServer(server_plan(Resolved(recipe, tmp_path / "engine"), "chat"), tmp_path / "engine.log")
    server.start()
    firsts = [0]

    def every_other_first(_n: int, _planted: int) -> bool:
        firsts[0] += 1
        return firsts[0] % 2 == 1

    try:
        server.wait_healthy(120)
        proxy = PlantingProxy(server.base_url, tool_call(every_other_first))
        try:
            yield proxy
        finally:
            proxy.stop()
    finally:
        server.stop()


def test_tool_rows_regen_prepare_train(tmp_path, tiny_verifier, planting_engine):
    from transformers import AutoTokenizer

    from dspark_kit.data.chat import encode, render

    stages, err = _run(tmp_path / "run", "regen,prepare,hidden-states,train", "data.keep_truncated=true",
                       "data.max_mode_mismatch_fraction=0.8", f"regen.endpoints=[{planting_engine.url}]")
    wd = tmp_path / "run"
    rows = [json.loads(line) for line in (wd / "regen.jsonl").read_text().splitlines()]
    assert len(rows) == ROWS and all(r["tools"] == TOOLS for r in rows)
    calls = sum(r["metadata"]["tool_calls"] for r in rows)
    assert planting_engine.planted >= ROWS // 3 and calls >= planting_engine.planted, (calls, planting_engine.planted)
    assert f"tool rows: {ROWS} written, {calls} calls made by the verifier" in err, err[-3000:]
    # a planted call got the dataset's result spliced under it, and the verifier went on from there
    called = [r for r in rows if r["metadata"]["tool_calls"]]
    for r in called[:4]:
        turns = [t["from"] for t in r["conversations"]]
        assert "tool" in turns and turns[turns.index("tool") + 1] == "gpt", turns
    # the verifier was served the schema: its prompt is the template's rendering with `tools`
    tok = AutoTokenizer.from_pretrained(tiny_verifier)
    source = {i: c for i, c in enumerate(tool_conversations(ROWS, seed=0))}
    for r in [r for r in rows if not r["metadata"]["tool_calls"]][:6]:  # one request: its prompt is exactly that
        first_user = source[r["metadata"]["idx"]]["messages"][:1]
        with_tools = encode(tok, render(tok, first_user, False, add_generation_prompt=True, tools=TOOLS))
        assert r["metadata"]["usage"]["prompt_tokens"] == len(with_tools)
    kept = [r for r in rows if r["metadata"]["mode_check"] == "ok"]
    dropped = ROWS - len(kept)
    assert dropped == 0 or f"dropped {dropped} of {ROWS} rows: reply carries reasoning" in err, err[-3000:]
    meta = json.loads((wd / "prepared" / "prepare_meta.json").read_text())["summary"]
    assert meta["mode_dropped_by_regen"] == dropped and meta["mode_rule"]["rows"] == 0  # regen decided them all
    assert meta["conversations_used"] == len(kept) and meta["tool_calls"] == sum(r["metadata"]["tool_calls"] for r in kept)
    called = [r for r in kept if r["metadata"]["tool_calls"]]
    assert called, "no kept row with a planted call: nothing here tests a call's way into training"
    ds = _prepared(wd)
    trained = []
    for ids, mask in zip(ds["input_ids"], ds["loss_mask"], strict=True):
        text = tok.decode(ids)
        assert "# Tools" in text and '"name": "count_words"' in text  # rendered, as the verifier saw it
        trained += spans(tok, ids, mask)
    assert not any("# Tools" in s or "<tools>" in s or "<tool_response>" in s for s in trained)  # never trained
    assert sum("<tool_call>" in s for s in trained) >= len(called)  # the calls are
    assert stages["train"]["figure"] >= 1.0
    print(f"\n[tools] regen -> train: {calls} calls ({planting_engine.planted} planted) in {ROWS} rows, "
          f"{dropped} dropped by the mode rule; val accept_len {stages['train']['figure']:.3f}")


def test_the_datasets_calls_are_trained_and_its_results_are_not(tmp_path, tiny_verifier):
    from transformers import AutoTokenizer

    stages, err = _run(tmp_path, "prepare,hidden-states,train", "regen.enabled=false")
    tok = AutoTokenizer.from_pretrained(tiny_verifier)
    ds = _prepared(tmp_path)
    trained = [s for ids, mask in zip(ds["input_ids"], ds["loss_mask"], strict=True) for s in spans(tok, ids, mask)]
    assert any('<tool_call>\n{"name": "describe_place"' in s for s in trained)
    assert any('{"name": "rhyme_for"' in s for s in trained)  # the chain's second step too
    assert not any("<tool_response>" in s for s in trained)  # results are context
    assert "tool calls trained" in err
    assert stages["train"]["figure"] >= 1.0
    print(f"\n[tools] dataset calls trained: {len(ds)} rows, val accept_len {stages['train']['figure']:.3f}")
