"""docs/DATA.md stays true: each example block is prepared as a data source, and every row is read
as the format the page names, used whole, with its replies (and nothing else) trained; each
refused example is dropped with the reason the page gives."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from data_helpers import prepared_texts, run_prepare

from dspark_kit.data.conversations import normalize

DOC = Path(__file__).resolve().parents[1] / "docs" / "DATA.md"
BLOCK = re.compile(r"<!-- (example|refused): (.+?) -->\n```jsonl\n(.*?)```", re.DOTALL)
BLOCKS = BLOCK.findall(DOC.read_text())


def test_the_page_has_an_example_of_every_format():
    from dspark_kit.data.conversations import FORMATS

    assert {name for kind, name, _ in BLOCKS if kind == "example"} == set(FORMATS.values())


@pytest.mark.parametrize("kind,name,rows", BLOCKS, ids=[f"{k}:{n}" for k, n, _ in BLOCKS])
def test_each_example_prepares_as_the_page_says(tmp_path, kind, name, rows):
    import json

    src = tmp_path / "example.jsonl"
    src.write_text(rows)
    n = len(rows.strip().splitlines())
    if kind == "refused":
        with pytest.raises(ValueError, match="no trainable rows"):
            run_prepare(tmp_path, src)
        entries = [json.loads(line) for line in (tmp_path / "run" / "prepared.errors.jsonl").read_text().splitlines()]
        assert [e["action"] for e in entries] == ["dropped"] * n and all(name in e["reason"] for e in entries)
        return
    s, entries, _ = run_prepare(tmp_path, src)
    assert s["formats"] == {name: n} and s["conversations_used"] == n and not entries
    trained = "".join(t for _, t in prepared_texts(tmp_path))
    for row in map(json.loads, rows.strip().splitlines()):
        for m in normalize(row):
            if m["role"] == "assistant":
                assert m["content"] + "<|im_end|>" in trained
            else:
                assert m["content"] not in trained
