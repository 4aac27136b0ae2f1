"""Training rows are exactly the verifier's generations in the context it saw (issue 12).

Checked against Qwen3's own chat template (below, the tools branch left out) and the tiny
verifier's: every row's context is `apply_chat_template(messages[:i], add_generation_prompt=True)`
token for token and its loss span decodes to exactly turn i as the model generated it (think block,
reply, `<|im_end|>`; not the template's `\\n` after it), for reasoning given as `reasoning_content`,
`reasoning`, inline `<think>`, ShareGPT or OpenAI rows, thinking on and off. A bad-row file lands
every line in one bucket with its full reason.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from chat_templates import QWEN3_TEMPLATE

from dspark_kit.data.conversations import ConversationError, normalize, to_sharegpt
from dspark_kit.data.mode_rule import REASONING_WITH_THINKING_OFF
from dspark_kit.data.template_rows import tokenize_conversation
from dspark_kit.jsonl import read_jsonl
from dspark_kit.resolved import Resolved
from dspark_kit.stages.dataset.prepare import UNFINISHED_TRAINED, prepare

TURNS = [("What colour are bananas?", "Bananas are yellow.", "A banana."),
         ("And apples?", "Apples vary.", "Red or green."),
         ("Thanks.", "The user thanks me.", "You are welcome.")]


def canonical(reasoning: bool, system: bool = True) -> list[dict]:
    msgs = [{"role": "system", "content": "Be brief."}] if system else []
    for q, r, a in TURNS:
        msgs.append({"role": "user", "content": q})
        msgs.append({"role": "assistant", "content": a, **({"reasoning_content": r} if reasoning else {})})
    return msgs


def as_form(msgs: list[dict], form: str) -> dict:
    """The same conversation in the shapes users bring."""
    if form == "reasoning_content":
        return {"messages": msgs}
    if form == "reasoning":
        return {"messages": [{**{k: v for k, v in m.items() if k != "reasoning_content"},
                              **({"reasoning": m["reasoning_content"]} if "reasoning_content" in m else {})}
                             for m in msgs]}
    if form == "inline":
        return {"messages": [{"role": m["role"], "content": f"<think>\n{m['reasoning_content']}\n</think>\n\n{m['content']}"
                              if "reasoning_content" in m else m["content"]} for m in msgs]}
    if form == "sharegpt":  # what regen writes
        return {"conversations": to_sharegpt(msgs)}
    raise AssertionError(form)


FORMS = ["reasoning_content", "reasoning", "inline", "sharegpt"]


@pytest.fixture(scope="module")
def tok(qwen3_or_tiny_tok):
    return qwen3_or_tiny_tok


def spans(mask: list[int]) -> list[tuple[int, int]]:
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def check_rows(tok, msgs: list[dict], rows, thinking: bool) -> None:
    """Per assistant turn i: context == template(messages[:i], generation prompt); loss == turn i as generated."""
    turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    pieces = [(ids, s) for ids, mask in rows for s in spans(mask)]
    assert len(pieces) == len(turns)
    for i, (ids, (a, b)) in zip(turns, pieces):
        prompt = tok.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
        assert ids[:a] == tok(prompt, add_special_tokens=False)["input_ids"], f"turn {i}: context"
        m = msgs[i]
        think = f"<think>\n{m.get('reasoning_content', '')}\n</think>\n\n" if thinking else ""
        assert tok.decode(ids[a:b]) == think + m["content"] + "<|im_end|>", f"turn {i}: loss"


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.slow
def test_reasoning_survives_in_every_form_thinking_on(tok, form):
    msgs = canonical(reasoning=True)
    got = normalize(as_form(msgs, form))
    assert [{k: m[k] for k in ("role", "content", "reasoning_content") if k in m} for m in got] == msgs
    rows, _ = tokenize_conversation(tok, got, thinking=True)
    check_rows(tok, msgs, rows, thinking=True)
    first = tok.decode(rows[0][0])
    assert "<think>\nBananas are yellow.\n</think>\n\nA banana.<|im_end|>" in first


@pytest.mark.parametrize("system", [True, False])
@pytest.mark.slow
def test_thinking_off_without_reasoning(tok, system):
    msgs = canonical(reasoning=False, system=system)
    for form in ("reasoning_content", "sharegpt"):
        rows, _ = tokenize_conversation(tok, normalize(as_form(msgs, form)), thinking=False)
        check_rows(tok, msgs, rows, thinking=False)


@pytest.mark.slow
def test_thinking_on_without_reasoning_trains_the_empty_think_block(tok):
    msgs = canonical(reasoning=False)
    rows, _ = tokenize_conversation(tok, normalize({"messages": msgs}), thinking=True)
    check_rows(tok, msgs, rows, thinking=True)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.slow
def test_reasoning_with_thinking_off_is_refused_not_mangled(tok, form):
    # Before: the context ended in "<think>\n" (the common prefix), not the generation prompt.
    with pytest.raises(ConversationError, match="verifier.thinking is false"):
        tokenize_conversation(tok, normalize(as_form(canonical(reasoning=True), form)), thinking=False)


@pytest.mark.slow
def test_tiny_template_renders_like_qwen3(tiny_verifier):
    from transformers import AutoTokenizer

    tiny = AutoTokenizer.from_pretrained(tiny_verifier)
    qwen = AutoTokenizer.from_pretrained(tiny_verifier)
    qwen.chat_template = QWEN3_TEMPLATE
    for reasoning in (True, False):
        for form in FORMS:
            msgs = normalize(as_form(canonical(reasoning), form))
            for n in range(1, len(msgs) + 1):
                for thinking in (True, False):
                    for gen in (True, False):
                        kw = {"tokenize": False, "add_generation_prompt": gen, "enable_thinking": thinking}
                        assert tiny.apply_chat_template(msgs[:n], **kw) == qwen.apply_chat_template(msgs[:n], **kw)


@pytest.mark.slow
def test_truncated_replies_are_skipped_unless_kept(tok):
    cut_inline = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>\nno close"}]}
    cut_length = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "half a"}],
                  "metadata": {"finish_reasons": ["length"]}}
    cut_thinking = {"messages": [{"role": "user", "content": "q"},
                                 {"role": "assistant", "reasoning_content": "still thinking", "content": ""}],
                    "metadata": {"finish_reasons": ["length"]}}
    for row, why, last in ((cut_inline, "reasoning never closed", "no close"),
                           (cut_length, "finish_reason: length", "half a"),
                           (cut_thinking, "finish_reason: length", "still thinking")):
        with pytest.raises(ConversationError, match=why):
            tokenize_conversation(tok, normalize(row), thinking=True)
        [(ids, mask)], _ = tokenize_conversation(tok, normalize(row), thinking=True, keep_truncated=True)
        # data.keep_truncated: trained up to where the verifier stopped; the end-of-turn token (and the
        # think block's close) that the template adds after it were never generated: no loss on them
        trained = tok.decode([i for i, m in zip(ids, mask) if m])
        assert trained.endswith(last) and "<|im_end|>" not in trained, trained
        # the row ends where the verifier stopped: the template's close was never in its context
        assert mask[-1] == 1 and tok.decode(ids).endswith(last), tok.decode(ids)
    # a cut reply with a turn after it: the row keeps the close the verifier read before its next reply
    two = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "half a"},
                             {"from": "human", "value": "go on"}, {"from": "gpt", "value": "done"}],
           "metadata": {"finish_reasons": ["length", "stop"]}}
    rows, _ = tokenize_conversation(tok, normalize(two), thinking=False, keep_truncated=True)
    text = "".join(tok.decode(ids) for ids, _ in rows)
    assert "half a<|im_end|>" in text and text.rstrip().endswith("done<|im_end|>"), text
    trained = ["".join(tok.decode([i]) for i, m in zip(ids, mask) if m) for ids, mask in rows]
    assert "".join(trained).startswith("half a") and "half a<|im_end|>" not in "".join(trained), trained
    finished = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "whole"}],
                "metadata": {"finish_reasons": ["stop"]}}
    [(ids, mask)], _ = tokenize_conversation(tok, normalize(finished), thinking=True, keep_truncated=True)
    assert tok.decode([i for i, m in zip(ids, mask) if m]).endswith("whole<|im_end|>")


# ---- every row in one bucket -----------------------------------------------------------------

GOOD = {"messages": [{"role": "user", "content": "Count from 1 to 3."}, {"role": "assistant", "content": "1, 2, 3."}]}
BAD_LINES = {
    "turn 1: content must be text, got int": json.dumps({"messages": [{"role": "user", "content": "q"},
                                                                      {"role": "assistant", "content": 7}]}),
    "turn 0: unknown role 'wizard'": json.dumps({"messages": [{"role": "wizard", "content": "x"}]}),
    "invalid JSON line (Expecting property name enclosed in double quotes)": "{not json",
    "row must be an object, got list": json.dumps([GOOD]),
    "conversation is empty or not a list": json.dumps({"messages": []}),
    "no user turn": json.dumps({"messages": [{"role": "assistant", "content": "x"}]}),
    "no assistant turn after a user turn": json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
    "truncated reply (finish_reason: length; data.keep_truncated keeps it)": json.dumps(
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "cut"}],
         "metadata": {"finish_reasons": ["length"]}}),
    "truncated reply (reasoning never closed; data.keep_truncated keeps it)": json.dumps(
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>\nno close"}]}),
    REASONING_WITH_THINKING_OFF: json.dumps(
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "r"}]}),
}


def _bad_file(path, n_good: int = 4):
    lines = [json.dumps(GOOD)] * n_good
    for reason, line in BAD_LINES.items():
        lines += [line, line] if reason.startswith("turn 0") else [line]  # one reason twice
    path.write_text("\n".join(lines) + "\n")
    expected = Counter({r: 1 for r in BAD_LINES})
    expected["turn 0: unknown role 'wizard'"] = 2
    return len(lines), expected


@pytest.mark.slow
def test_bad_rows_from_regen_jsonl_are_counted_per_full_reason(tmp_path, tiny_verifier):
    src = tmp_path / "regen.jsonl"
    n_lines, expected = _bad_file(src)
    # one row in the 8 the mode rule judges is dropped by it: a budget that allows it (the rule's own
    # budget is tested in test_mode_rule.py)
    s = prepare(read_jsonl(src), str(tiny_verifier), tmp_path / "prepared", seq_length=128, thinking=False,
                mode_budget=0.5)
    assert s.rejected == expected
    assert s.conversations_in == n_lines == s.conversations_used + sum(s.rejected.values())
    assert s.conversations_used == 4 and s.rows_out == 4
    # judged: 4 good, 2 truncated, 1 with reasoning, 1 without an assistant turn (it fails later)
    assert s.mode_rule.dropped == 1 and s.mode_rule.rows == 8
    saved = json.loads((tmp_path / "prepared" / "prepare_meta.json").read_text())["summary"]
    assert saved["rejected"] == dict(expected)
    # data.keep_truncated: the two cut replies train (up to where they stop) and are counted as changed
    kept = prepare(read_jsonl(src), str(tiny_verifier), tmp_path / "kept", seq_length=128, thinking=False,
                   mode_budget=0.5, keep_truncated=True)
    cut = [r for r in expected if r.startswith("truncated reply")]
    assert len(cut) == 2 and kept.rejected == expected - Counter(cut)
    assert kept.conversations_used == 6 and kept.changed[UNFINISHED_TRAINED] == 2


@pytest.mark.slow
def test_bad_rows_from_data_source_are_counted_too(tmp_path, tiny_recipe, tiny_verifier, capsys):
    """regen.enabled false: prepare reads data.source; the reader's skips reach the summary and the log."""
    from dspark_kit.stages.steps import run_stage

    src = tmp_path / "src.jsonl"
    n_lines, expected = _bad_file(src)
    recipe = tiny_recipe.model_copy(deep=True)
    recipe.regen.enabled = False
    recipe.data.source, recipe.data.limit, recipe.data.seq_length = str(src), None, 128
    recipe.data.max_mode_mismatch_fraction = 0.5  # the one row with reasoning is 1 in 8 judged
    summary = run_stage("prepare", Resolved(recipe, tmp_path))
    assert Counter(summary["rejected"]) == expected
    assert summary["conversations_in"] == n_lines
    err = capsys.readouterr().err
    assert f"prepare: 4 of {n_lines} conversations used" in err and "skipped 2: turn 0: unknown role 'wizard'" in err


def test_prepare_stops_when_regen_output_is_missing(tmp_path, tiny_recipe):
    from dspark_kit.stages.steps import run_stage

    assert tiny_recipe.regen.enabled
    with pytest.raises(ValueError, match="regen.jsonl not found: run regen first") as e:
        run_stage("prepare", Resolved(tiny_recipe, tmp_path))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "prepared").exists()


@pytest.mark.slow
def test_thinking_on_with_no_reasoning_in_the_data_fails_prepare_in_one_line(tmp_path, tiny_verifier):
    src = tmp_path / "regen.jsonl"
    src.write_text(json.dumps(GOOD) + "\n")
    with pytest.raises(ValueError, match="none of 1 rows in thinking mode carries reasoning") as e:
        prepare(read_jsonl(src), str(tiny_verifier), tmp_path / "p", seq_length=128, thinking=True)
    assert "\n" not in str(e.value) and "verifier.thinking: false" in str(e.value)
    assert not (tmp_path / "p").exists()  # nothing half-written


# ---- regen -> prepare with a server that returns reasoning_content ---------------------------


@pytest.mark.parametrize("text, expected", [
    ("<think>\nwhy\n</think>\n\nthe reply", {"reasoning_content": "\nwhy\n", "content": "\n\nthe reply"}),
    ("just a reply", {"reasoning_content": None, "content": "just a reply"}),
    ("<think>\ncut off", {"reasoning_content": "\ncut off", "content": None}),
    ("<think>\n\n</think>\n\n", {"reasoning_content": "\n\n", "content": "\n\n"}),
    ("<think>\nr\n</think>", {"reasoning_content": "\nr\n", "content": None}),
])
def test_local_engine_reasoning_parser_splits_like_vllm(text, expected):
    from dspark_kit.data.reasoning_formats import THINK
    from dspark_kit.engines.local.server import parse_args

    got = THINK.split_reply(text)
    assert {k: got[k] for k in expected} == expected and got["reasoning"] == got["reasoning_content"]
    assert parse_args(["--model", "m", "--reasoning-parser", "qwen3"]).reasoning_parser == "qwen3"


@pytest.mark.slow
def test_regen_with_reasoning_parser_keeps_reasoning_into_prepared_rows(tmp_path, tiny_recipe, tiny_verifier):
    """thinking on: regen's local engine runs with --reasoning-parser qwen3 (reasoning comes back in
    message.reasoning_content, as from vLLM); the rows store it; prepare trains on it."""
    import random

    from datasets import load_from_disk
    from transformers import AutoTokenizer

    from dspark_kit.data.tiny_corpus import thinking_reply
    from dspark_kit.stages.dataset.regen import run_regen
    from dspark_kit.stages.server_plan import regen_server_plan
    from dspark_kit.stages.steps import run_stage

    rng = random.Random(5)
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps({"prompt": thinking_reply(rng)[0]}) + "\n" for _ in range(3)))
    recipe = tiny_recipe.model_copy(deep=True)
    recipe.verifier.thinking = True
    recipe.data.source, recipe.data.limit, recipe.regen.max_tokens = str(src), None, 160
    from dspark_kit.resolved import Resolved

    assert "--reasoning-parser" in regen_server_plan(Resolved(recipe)).argv
    summary = run_regen(Resolved(recipe), tmp_path / "regen.jsonl", concurrency=3)
    assert (summary["written"], summary["failed"], summary["not_attempted"]) == (3, 0, 0)
    replies = [json.loads(line)["conversations"][1] for line in (tmp_path / "regen.jsonl").read_text().splitlines()]
    assert all("reasoning_content" in r and "<think>" not in r["value"] for r in replies)
    assert sum(bool(r["reasoning_content"].strip()) for r in replies) >= 2
    prepared = run_stage("prepare", Resolved(recipe, tmp_path))
    assert prepared["conversations_used"] == 3 and prepared["with_reasoning"] >= 2
    tok = AutoTokenizer.from_pretrained(tiny_verifier)
    ds = load_from_disk(str(tmp_path / "prepared"))
    trained = sorted(tok.decode([i for i, m in zip(ids, mask) if m]) for ids, mask in zip(ds["input_ids"], ds["loss_mask"]))
    expected = sorted(f"<think>\n{r['reasoning_content'].strip()}\n</think>\n\n{r['value'].lstrip()}<|im_end|>"
                      for r in replies)
    assert trained == expected


@pytest.mark.slow
def test_cli_prepare_json_shows_every_reason(tmp_path, tiny_verifier):
    from typer.testing import CliRunner

    from dspark_kit.cli import app

    n_lines, expected = _bad_file(tmp_path / "regen.jsonl")
    recipe = str(Path(__file__).resolve().parent.parent / "recipes" / "tiny-cpu.yaml")
    # the one row with reasoning is 1 of the 8 the mode rule judges: a budget that allows it
    res = CliRunner().invoke(app, ["prepare", "-r", recipe, "-w", str(tmp_path), "--json",
                                   "--set", "data.max_mode_mismatch_fraction=0.5"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["rejected"] == dict(expected) and summary["conversations_in"] == n_lines
    assert summary["conversations_used"] + sum(summary["rejected"].values()) == n_lines
