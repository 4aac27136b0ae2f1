"""Eval prompts the draft never trained on: speculators' validation split, or the tiny held-out set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark_kit.data.chat import render
from dspark_kit.data.tiny_corpus import conversations
from dspark_kit.measure.eval_prompts import EvalError, load_eval_prompts, until_last_user
from dspark_kit.recipe import load_recipe
from dspark_kit.resolved import Resolved
from dspark_kit.stages.prompts import prompt_source

pytestmark = pytest.mark.slow  # the tiny verifier's tokenizer, and prepare

TINY = Path(__file__).resolve().parents[1] / "recipes" / "tiny-cpu.yaml"
RATIO = 0.75


@pytest.fixture(scope="module")
def tok(tiny_verifier):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_verifier)


@pytest.fixture(scope="module")
def prepared_run(tmp_path_factory, tiny_verifier) -> Resolved:
    """A jsonl data source (some conversations twice, as real data has them) prepared like a run
    (the tests only read it)."""
    from dspark_kit.stages.steps import run_stage

    tmp_path = tmp_path_factory.mktemp("heldout-run")
    chats = conversations(48, seed=3)
    rows = [{"id": f"c{i}", "messages": m} for i, m in enumerate(chats)]
    rows += [{"id": f"dup{i}", "messages": chats[i]} for i in range(0, 48, 3)]  # 16 copies
    src = tmp_path / "data.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = load_recipe(TINY, [f"workdir={tmp_path / 'run'}", f"data.source={src}", "data.limit=1000",
                                "regen.enabled=false", f"train.train_data_ratio={RATIO}"])
    res = Resolved(recipe)
    run_stage("prepare", res)
    return res


def _split_texts(res: Resolved, tok) -> tuple[list[str], list[str]]:
    """Decoded prepared rows, train and validation, split the way the trainer splits them."""
    from datasets import load_from_disk

    data = load_from_disk(str(res.run.prepared))
    texts = [tok.decode(ids) for ids in data["input_ids"]]
    cut = int(len(texts) * RATIO)
    return texts[:cut], texts[cut:]


def test_validation_split_prompts_are_held_out(prepared_run, tok):
    res = prepared_run
    found = load_eval_prompts(prompt_source(res), tok, limit=64)
    train, val = _split_texts(res, tok)
    assert found.held_out is True and "validation split" in found.source
    assert len(found.chats) >= 3
    for chat in found.chats:
        prompt = render(tok, until_last_user(chat), False, add_generation_prompt=True)
        assert any(prompt in t for t in val)  # a reply the trainer validates on...
        assert not any(prompt in t for t in train)  # ...and never trains on
    # the duplicates matter: some validation prompts are training prompts too, and were left out
    both = [t for t in val if any(t[: t.index("<|im_start|>assistant")] in u for u in train)]
    assert both, "the data should hold a prompt in both splits for this test to mean something"
    rec = found.record(4)
    assert rec["count"] == 4 and rec["ids"] == found.ids[:4] and rec["trained_prompts"] == 0


def test_from_data_and_files_are_taken_as_given_and_counted(prepared_run, tmp_path, tok):
    res = prepared_run
    found = load_eval_prompts(prompt_source(res), tok, from_data=True, limit=12)
    assert found.held_out is False and found.trained is not None and found.trained > 0  # first rows: trained on
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "Describe the big cat."}) + "\nCount from 3 to 9.\n")
    mine = load_eval_prompts(prompt_source(res), tok, prompts_file=f)
    assert mine.held_out is None and mine.ids == ["row-0", "row-1"] and len(mine.chats) == 2


def test_tiny_data_uses_its_held_out_set(tmp_path, tok):
    recipe = load_recipe(TINY, [f"workdir={tmp_path / 'run'}"])
    found = load_eval_prompts(prompt_source(Resolved(recipe)), tok, limit=8)
    assert found.ids == [f"tiny-heldout-{i}" for i in range(8)] and found.held_out is True
    assert "not checked" in found.source  # no DIR/prepared to compare with


def test_other_data_without_a_validation_split_is_one_line(tmp_path, tok):
    recipe = load_recipe(TINY, [f"workdir={tmp_path / 'run'}", f"data.source={tmp_path / 'x.jsonl'}"])
    with pytest.raises(EvalError, match=r"no prepared data .* pass --prompts FILE") as e:
        load_eval_prompts(prompt_source(Resolved(recipe)), tok)
    assert "\n" not in str(e.value)


def test_bench_builtin_prompts_are_evals_validation_prompts_on_other_data(prepared_run, tok):
    """On data with no held-out set of its own, bench's `builtin` prompts are eval's default ones
    (speculators' validation split, in eval's order), so the served gate compares acceptance on the
    prompts eval measured; before, bench sent the tiny corpus's held-out set whatever the data."""
    from dspark_kit.stages.serving.bench import prompt_set

    res = prepared_run
    evals = load_eval_prompts(prompt_source(res), tok, limit=16)  # what evaluate_checkpoint asks for
    sent, source = prompt_set("builtin", 4, res)
    assert sent == [until_last_user(c) for c in evals.chats[:4]] and "validation split" in source
    assert prompt_set("builtin", 8, res)[0][:4] == sent  # more prompts extend the same list
