"""Regen data sources: builtin corpus, local files, HF preset row mapping."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from dspark_kit.data.sources import PRESETS, SourceError, iter_source, preset_row
from dspark_kit.data.tiny_corpus import conversations
from dspark_kit.recipe import DataCfg


def test_builtin_tiny_chat_is_the_shipped_corpus_with_stable_idx():
    rows = list(iter_source(DataCfg(source="builtin:tiny-chat", limit=5), seed=3))
    assert [i for i, _ in rows] == [0, 1, 2, 3, 4]
    assert [m for _, m in rows] == conversations(5, seed=3)
    assert len(list(iter_source(DataCfg(), limit=7))) == 7


def test_jsonl_bad_rows_are_counted_not_fatal(tmp_path):
    p = tmp_path / "d.jsonl"
    lines = [
        json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}),
        "{not json",
        json.dumps({"conversations": [{"from": "gpt", "value": "only a reply"}]}),
        "",
        json.dumps({"prompt": "p", "response": "r"}),
        json.dumps([1, 2]),
        json.dumps({"conversations": [{"from": "human", "value": "hi"}]}),
    ]
    p.write_text("\n".join(lines) + "\n")
    skipped: Counter = Counter()
    rows = list(iter_source(DataCfg(source=str(p)), skipped=skipped))
    assert [i for i, _ in rows] == [0, 3, 5]
    assert rows[1][1] == [{"role": "user", "content": "p"}, {"role": "assistant", "content": "r"}]
    assert sum(skipped.values()) == 3
    assert any("JSON" in k for k in skipped) and "no user turn" in skipped


def test_limit_counts_source_rows(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(10)))
    assert [i for i, _ in iter_source(DataCfg(source=str(p), limit=4))] == [0, 1, 2, 3]
    assert [i for i, _ in iter_source(DataCfg(source=str(p)), limit=2)] == [0, 1]


def test_json_list_and_parquet(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(3)]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    assert len(list(iter_source(DataCfg(source=str(tmp_path / "d.json"))))) == 3
    from datasets import Dataset

    Dataset.from_list([{"prompt": "x", "response": "y"}, {"prompt": "z", "response": None}]).to_parquet(
        str(tmp_path / "d.parquet"))
    got = list(iter_source(DataCfg(source=str(tmp_path / "d.parquet"))))
    assert [m for _, m in got] == [[{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
                                   [{"role": "user", "content": "z"}]]


@pytest.mark.parametrize("source, msg", [("missing.jsonl", "file not found"), ("builtin:nope", "unknown builtin")])
def test_unusable_sources_raise_one_line(tmp_path, source, msg):
    with pytest.raises(SourceError, match=msg):
        list(iter_source(DataCfg(source=source)))
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(SourceError, match="unsupported extension"):
        list(iter_source(DataCfg(source=str(tmp_path / "d.csv"))))


def test_preset_rows_map_to_messages(monkeypatch):
    import datasets

    from dspark_kit.data.conversations import normalize

    ultrachat = {"prompt": "q", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    magpie = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    gsm8k = {"question": "2+2?", "answer": "4 #### 4"}
    assert normalize(preset_row("ultrachat", ultrachat))[0] == {"role": "user", "content": "q"}
    assert normalize(preset_row("magpie", magpie))[1] == {"role": "assistant", "content": "a"}
    assert normalize(preset_row("gsm8k", gsm8k)) == [{"role": "user", "content": "2+2?"}]

    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append((a, k)) or [gsm8k, {"answer": "x"}])
    skipped: Counter = Counter()
    got = list(iter_source(DataCfg(source="gsm8k"), skipped=skipped))
    assert calls == [(("openai/gsm8k", "main"), {"split": "train"})]
    assert got == [(0, [{"role": "user", "content": "2+2?"}])] and sum(skipped.values()) == 1
    list(iter_source(DataCfg(source="ultrachat", split="test_sft")))
    assert calls[-1] == ((PRESETS["ultrachat"][0], None), {"split": "test_sft"})


def test_source_size_counts_what_iter_source_reads(tmp_path):
    from dspark_kit.data.sources import source_size

    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" + ("\n" if i % 3 == 0 else "") for i in range(10)))
    assert source_size(DataCfg(source=str(p))) == 10 == len(list(iter_source(DataCfg(source=str(p)))))
    assert source_size(DataCfg(source=str(p), limit=4)) == 4
    assert source_size(DataCfg(source="builtin:tiny-chat", limit=7)) == 7
    assert source_size(DataCfg(source="ultrachat")) is None  # not cheap to know: no count


def test_prepare_streams_its_source_and_still_counts_unusable_rows(tmp_path, tiny_recipe):
    """prepare reads data.source as it goes (a 200k-row source is never held in memory); a row
    the reader could not use reaches prepare as a BadLine that says where it was read."""
    from collections.abc import Iterator

    from dspark_kit.resolved import Resolved
    from dspark_kit.resolved.prepare_input import prepare_input_rows

    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"prompt": "q", "response": "r"}) + "\n{bad\n" + json.dumps({"prompt": "q2"}) + "\n")
    recipe = tiny_recipe.model_copy(deep=True)
    recipe.regen.enabled, recipe.data.source = False, str(p)
    rows, total, unusable, _ = prepare_input_rows(Resolved(recipe, tmp_path))
    assert isinstance(rows, Iterator) and total == 3 and not unusable
    from dspark_kit.jsonl import BadLine

    got = list(rows)
    assert len(got) == 3 and not unusable
    assert isinstance(got[1], BadLine) and got[1].where == f"{p}:2" and got[1].line == 2
    assert got[2]["_where"] == f"{p}:3" and got[2]["metadata"] == {"idx": 2}
