"""Mixtures per row end to end (issue 31, point 2): regen sends and records each row's draw (a stub
server answers), a resumed regen draws the same, prepare renders each row in the mode it was
generated in (or, without a record, the recipe's draw for it), preflight reads a mixture."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from aiohttp import web
from test_regen_faults import Stub

from dspark_kit.recipe import Recipe
from dspark_kit.recipe.mixture import TEMPERATURE, THINKING, choose
from dspark_kit.resolved import Resolved
from dspark_kit.stages.dataset.regen import run_regen

HALF = {True: 0.5, False: 0.5}
TEMPS = {0.0: 0.5, 0.7: 0.5}


class ModeStub(Stub):
    """Answers `re:<user text>`, with reasoning when the request asks for thinking mode; keeps every body."""

    def __init__(self):
        super().__init__()
        self.bodies: list[dict] = []

    async def chat(self, request):
        body = await request.json()
        self.bodies.append(body)
        user = body["messages"][-1]["content"]
        msg = {"role": "assistant", "content": f"re:{user}"}
        if body["chat_template_kwargs"]["enable_thinking"]:
            msg["reasoning_content"] = f"why {user}"
        return web.json_response({"choices": [{"message": msg, "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})


@pytest.fixture
def stub():
    s = ModeStub()
    yield s
    s.stop()


def _source(tmp_path: Path, n: int, turns: int = 2) -> Path:
    """Row i asks `q<i>-<turn>` per turn: a request names its row."""
    src = tmp_path / "src.jsonl"
    with src.open("w") as f:
        for i in range(n):
            msgs = []
            for t in range(turns):
                msgs += [{"role": "user", "content": f"q{i}-{t}"}, {"role": "assistant", "content": "old"}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    return src


def _recipe(src: Path, **over) -> Recipe:
    return Recipe.model_validate({"data": {"source": str(src)}, "verifier": {"thinking": over.pop("thinking", HALF)},
                                  "regen": {"request_timeout": 5.0, "temperature": TEMPS, **over}})


def _rows(path: Path) -> dict[int, dict]:
    return {r["metadata"]["idx"]: r for r in map(json.loads, path.read_text().splitlines())}


def test_regen_sends_and_records_each_rows_draw(tmp_path, stub):
    recipe = _recipe(_source(tmp_path, 40))
    out = tmp_path / "regen.jsonl"
    summary = run_regen(Resolved(recipe, tmp_path), out, endpoints=[stub.url], backoff_base=0.01)
    rows = _rows(out)
    assert summary["written"] == 40 and sorted(rows) == list(range(40))
    sent: dict[int, set] = {}
    for body in stub.bodies:  # every request of a row (both turns) asks for the row's draw
        idx = int(body["messages"][0]["content"][1:].split("-")[0])
        sent.setdefault(idx, set()).add((body["chat_template_kwargs"]["enable_thinking"], body["temperature"]))
    for idx, row in rows.items():
        meta = row["metadata"]
        assert meta["thinking"] == choose(HALF, 42, THINKING, idx) == recipe.row_thinking(idx)
        assert meta["temperature"] == choose(TEMPS, 42, TEMPERATURE, idx)
        assert sent[idx] == {(meta["thinking"], meta["temperature"])}
        replies = [t for t in row["conversations"] if t["from"] == "gpt"]
        assert len(replies) == 2 and all(("reasoning_content" in t) == meta["thinking"] for t in replies)
    drawn = Counter((r["metadata"]["thinking"], r["metadata"]["temperature"]) for r in rows.values())
    assert len(drawn) == 4, drawn  # both modes, both temperatures, in every pairing


def test_a_resumed_regen_draws_what_the_first_run_drew(tmp_path, stub):
    recipe = _recipe(_source(tmp_path, 30, turns=1), seed=7)
    out = tmp_path / "regen.jsonl"
    run_regen(Resolved(recipe, tmp_path), out, endpoints=[stub.url], backoff_base=0.01)
    first = _rows(out)
    kept = out.read_text().splitlines()[:10]  # as if the run had stopped after 10 rows
    out.write_text("\n".join(kept) + "\n")
    stub.bodies.clear()
    summary = run_regen(Resolved(recipe, tmp_path), out, endpoints=[stub.url], backoff_base=0.01)
    assert summary["skipped_already_done"] == 10 and summary["written"] == 20 and len(stub.bodies) == 20
    again = _rows(out)
    assert sorted(again) == list(range(30))
    for idx, row in again.items():
        for key in ("thinking", "temperature"):
            assert row["metadata"][key] == first[idx]["metadata"][key]
        assert row["conversations"] == first[idx]["conversations"]


def test_plain_values_are_sent_and_recorded_as_before(tmp_path, stub):
    recipe = _recipe(_source(tmp_path, 6, turns=1), thinking=True, temperature=0.3)
    out = tmp_path / "regen.jsonl"
    run_regen(Resolved(recipe, tmp_path), out, endpoints=[stub.url], backoff_base=0.01)
    assert {(r["metadata"]["thinking"], r["metadata"]["temperature"]) for r in _rows(out).values()} == {(True, 0.3)}
    assert {(b["chat_template_kwargs"]["enable_thinking"], b["temperature"]) for b in stub.bodies} == {(True, 0.3)}


# ---- prepare renders each row in its own mode (the tiny verifier's template) --------------------


def _prepared(path: Path, tok) -> list[tuple[str, str]]:
    """(context, trained text) per prepared row, the context up to the first trained token."""
    from datasets import load_from_disk

    data = load_from_disk(str(path)).with_format(None)
    out = []
    for ids, mask in zip(data["input_ids"], data["loss_mask"], strict=True):
        first = mask.index(1)
        out.append((tok.decode(ids[:first]), tok.decode([i for i, m in zip(ids, mask, strict=True) if m])))
    return out


def _row_of(context: str) -> int:
    return int(context.rsplit("q", 1)[1].split("-")[0])


EMPTY_THINK = "<think>\n\n</think>\n\n"


@pytest.mark.slow  # the tiny verifier's tokenizer
def test_prepare_renders_regen_rows_in_the_mode_they_were_generated_in(tmp_path, stub, tiny_verifier):
    from transformers import AutoTokenizer

    from dspark_kit.stages.dataset.prepare import prepare

    recipe = _recipe(_source(tmp_path, 24, turns=1), temperature=0.0)
    out = tmp_path / "regen.jsonl"
    run_regen(Resolved(recipe, tmp_path), out, endpoints=[stub.url], backoff_base=0.01)
    modes = {idx: r["metadata"]["thinking"] for idx, r in _rows(out).items()}
    assert set(modes.values()) == {True, False}
    # seed 999 draws other modes than regen's seed 42 did: the recorded mode must win
    assert any(choose(HALF, 999, THINKING, i) != m for i, m in modes.items())
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    s = prepare(rows, str(tiny_verifier), tmp_path / "prepared", seq_length=256, thinking=HALF, mixture_seed=999)
    assert s.thinking_rows == Counter({str(m).lower(): n for m, n in Counter(modes.values()).items()})
    tok = AutoTokenizer.from_pretrained(tiny_verifier)
    seen = set()
    for context, trained in _prepared(tmp_path / "prepared", tok):
        idx = _row_of(context)
        seen.add(idx)
        if modes[idx]:  # thinking: the verifier wrote the think block, so it is trained
            assert trained.startswith(f"<think>\nwhy q{idx}-0\n</think>\n\nre:q{idx}-0"), trained
        else:  # off: the template pre-fills an empty block into the prompt; the reply follows it
            assert context.endswith(EMPTY_THINK) and trained.startswith(f"re:q{idx}-0") and "<think>" not in trained
    assert seen == set(modes)
    meta = json.loads((tmp_path / "prepared" / "prepare_meta.json").read_text())
    assert meta["thinking"] == {"true": 0.5, "false": 0.5} and sum(meta["summary"]["thinking_rows"].values()) == 24


@pytest.mark.slow  # the tiny verifier's tokenizer
def test_prepare_draws_the_mode_of_a_source_row_without_a_record(tmp_path, tiny_verifier):
    """regen off: the data source's rows have no recorded mode; each gets the recipe's draw for its index."""
    from transformers import AutoTokenizer

    from dspark_kit.stages.steps import run_stage

    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}-0"},
                                                    {"role": "assistant", "content": f"a{i}"}]}) + "\n"
                           for i in range(24)))
    recipe = Recipe.model_validate({"data": {"source": str(src), "seq_length": 256},
                                    "verifier": {"thinking": HALF}, "regen": {"enabled": False, "seed": 5}})
    res = Resolved(recipe, tmp_path / "run")
    s = run_stage("prepare", res)
    modes = {i: recipe.row_thinking(i) for i in range(24)}
    assert s["thinking_rows"] == {str(m).lower(): n for m, n in sorted(Counter(modes.values()).items())}
    tok = AutoTokenizer.from_pretrained(tiny_verifier)
    for context, trained in _prepared(res.run.prepared, tok):
        idx = _row_of(context)
        if modes[idx]:  # thinking: the template renders the reply's (empty) think block in the reply
            assert not context.endswith(EMPTY_THINK) and trained.startswith(f"{EMPTY_THINK}a{idx}"), trained
        else:
            assert context.endswith(EMPTY_THINK) and trained.startswith(f"a{idx}"), trained


@pytest.mark.slow  # the tiny verifier's tokenizer
def test_a_mixture_without_a_row_index_is_a_rejected_row_not_a_guess(tmp_path, tiny_verifier):
    from dspark_kit.data.template_rows import NO_MODE_TO_DRAW
    from dspark_kit.stages.dataset.prepare import prepare

    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
             "metadata": {"thinking": False}}]
    s = prepare(rows, str(tiny_verifier), tmp_path / "p", seq_length=64, thinking=HALF)
    assert s.rejected == Counter({NO_MODE_TO_DRAW: 1}) and s.conversations_used == 1


# ---- preflight reads a mixture (docs/PITFALLS.md, pitfall 4) -------------------------------------


@pytest.mark.slow  # the tiny verifier (the run fixture's checkpoint names it)
def test_preflight_takes_a_mixtures_rows_and_names_a_mode_outside_it(tiny_recipe, tmp_path, tiny_verifier):
    from test_preflight import _write_checkpoint, _write_hidden_states
    from transformers import AutoTokenizer

    from dspark_kit.stages.preflight.checks import run_preflight

    def pitfall_4(recipe: Recipe) -> list[str]:
        return [f.message for f in run_preflight(Resolved(recipe, tmp_path), probes=False) if f.pitfall == 4]

    mask_id = AutoTokenizer.from_pretrained(tiny_verifier).convert_tokens_to_ids("<|MASK|>")
    _write_hidden_states(tmp_path)
    _write_checkpoint(tmp_path, tiny_verifier, mask_id)
    tiny_recipe.serve.max_model_len = 512
    tiny_recipe.verifier.thinking = HALF
    rows = [{"conversations": [{"from": "human", "value": "hi"},
                               {"from": "gpt", "value": "re", **({"reasoning_content": "why"} if mode else {})}],
             "metadata": {"idx": i, "finish_reasons": ["stop"], "thinking": mode}} for i, mode in enumerate([True, False])]
    (tmp_path / "regen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "prepared" / "prepare_meta.json").write_text(json.dumps({"thinking": {"true": 0.5, "false": 0.5}}))
    assert pitfall_4(tiny_recipe) == []  # both modes recorded, reasoning in thinking rows, prepared with the mixture
    tiny_recipe.verifier.thinking = {True: 0.0, False: 1.0}  # thinking never drawn now: the rows disagree
    found = pitfall_4(tiny_recipe)
    # each row is judged in its recorded mode (the rows agree with theirs); the recipe disagrees with both
    assert any("enable_thinking=[False, True]" in m for m in found), found
    assert any("prepared data was rendered with thinking=" in m for m in found), found


@pytest.mark.slow  # the tiny verifier's tokenizer, and prepare
def test_eval_finds_validation_conversations_of_both_modes(tmp_path, tiny_verifier):
    """A mixture's validation rows start from prompts in each row's own mode: eval must match each
    conversation in the mode prepare rendered it in, not in the one mode it measures."""
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    from dspark_kit.data.chat import render
    from dspark_kit.data.tiny_corpus import conversations
    from dspark_kit.measure.eval_prompts import load_eval_prompts, until_last_user
    from dspark_kit.stages.prompts import prompt_source
    from dspark_kit.stages.steps import run_stage

    src = tmp_path / "data.jsonl"
    src.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations(48, seed=3)))
    recipe = Recipe.model_validate({"data": {"source": str(src), "seq_length": 256}, "verifier": {"thinking": HALF},
                                    "regen": {"enabled": False}, "train": {"train_data_ratio": 0.5}})
    res = Resolved(recipe, tmp_path / "run")
    run_stage("prepare", res)
    tok = AutoTokenizer.from_pretrained(tiny_verifier)
    found = load_eval_prompts(prompt_source(res), tok, limit=64)
    texts = [tok.decode(ids) for ids in load_from_disk(str(res.run.prepared))["input_ids"]]
    train, val = texts[: len(texts) // 2], texts[len(texts) // 2:]
    modes = [recipe.row_thinking(int(i.rsplit("#", 1)[1])) for i in found.ids]
    assert set(modes) == {True, False}, modes  # measured in one mode, found in both
    for chat, mode in zip(found.chats, modes, strict=True):
        prompt = render(tok, until_last_user(chat), mode, add_generation_prompt=True)
        assert any(prompt in t for t in val) and not any(prompt in t for t in train)
