"""Tool rows through the real CLI on the tiny recipe: regen -> prepare -> hidden states -> train.

builtin:tiny-tools is OpenAI-format agent traffic (tools, calls, results, answers). The tiny
recipe serves it with `serve.tool_call_parser: hermes` (the local engine parses `<tool_call>`
blocks as vLLM's hermes parser does: tests/test_vllm_real_tools.py), and the tiny verifier's
template is Qwen3's on these rows (tests/test_local_tools.py). The schema costs ~700 tokens in
the tiny tokenizer, hence the longer context. The tiny verifier never learned to call a tool,
so its regenerated rows answer in text: regen must say so, keep `tools` and send them (the
prompt it was served is the template's rendering WITH the schema), and train on what the
verifier does. With regen off, the dataset's own calls are trained, their results are not.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
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


def test_tool_rows_regen_prepare_train(tmp_path, tiny_verifier):
    from transformers import AutoTokenizer

    from dspark_kit.data.chat import encode, render

    stages, err = _run(tmp_path, "regen,prepare,hidden-states,train")
    rows = [json.loads(line) for line in (tmp_path / "regen.jsonl").read_text().splitlines()]
    assert len(rows) == ROWS and all(r["tools"] == TOOLS for r in rows)
    calls = sum(r["metadata"]["tool_calls"] for r in rows)
    unused = sum(bool(r["metadata"].get("tool_results_unused")) for r in rows)
    assert f"tool rows: {ROWS} written, {calls} calls made by the verifier" in err, err[-3000:]
    assert calls or f"in {unused} rows it answered in text where the dataset called a tool" in err
    # the verifier was served the schema: its prompt is the template's rendering with `tools`
    tok = AutoTokenizer.from_pretrained(tiny_verifier)
    source = {i: c for i, c in enumerate(tool_conversations(ROWS, seed=0))}
    for r in rows[:6]:
        first_user = source[r["metadata"]["idx"]]["messages"][:1]
        with_tools = encode(tok, render(tok, first_user, False, add_generation_prompt=True, tools=TOOLS))
        if not r["metadata"]["tool_calls"]:  # one request: its prompt is exactly that
            assert r["metadata"]["usage"]["prompt_tokens"] == len(with_tools)
    ds = _prepared(tmp_path)
    assert len(ds) == ROWS
    for ids, mask in zip(ds["input_ids"][:6], ds["loss_mask"][:6], strict=True):
        text = tok.decode(ids)
        assert "# Tools" in text and '"name": "count_words"' in text  # rendered, as the verifier saw it
        assert not any("# Tools" in s or "<tools>" in s for s in spans(tok, ids, mask))  # never trained
    assert stages["train"]["figure"] >= 1.0
    print(f"\n[tools] regen -> train: {calls} verifier calls in {ROWS} rows, {unused} answered in text; "
          f"val accept_len {stages['train']['figure']:.3f}")


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
