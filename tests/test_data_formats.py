"""The formats people have (issue 55): Alpaca, TRL prompt/completion (conversational and plain),
`datasets` save_to_disk folders, compressed jsonl, hub datasets through `datasets.load_dataset`
(exercised offline on a dataset cached here), and names that are never mistaken for paths or the
other way round."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from dspark_kit.data.conversations import normalize, row_format
from dspark_kit.data.sources import SourceError, hub_source, iter_source
from dspark_kit.recipe import DataCfg

QA = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}]
ROWS = [{"messages": [{"role": "user", "content": f"q{i}?"}, {"role": "assistant", "content": f"a{i}."}]}
        for i in range(3)]


def msgs(source, **cfg) -> list[list[dict]]:
    return [m for _, m in iter_source(DataCfg(source=str(source), **cfg))]


def test_alpaca_rows():
    row = {"instruction": "Add the numbers.", "input": "2 and 2", "output": "4."}
    assert row_format(row) == "Alpaca"
    assert normalize(row) == [{"role": "user", "content": "Add the numbers.\n2 and 2"},
                              {"role": "assistant", "content": "4."}]
    assert normalize({"instruction": "Say hi.", "input": "", "output": "Hi.", "system": "Be brief.",
                      "history": [["Hello?", "Hello."]]}) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": "Hi."}]


def test_trl_rows_conversational_with_a_system_turn_and_plain():
    conv = {"prompt": [{"role": "system", "content": "Be brief."}, QA[0]], "completion": [QA[1]]}
    assert row_format(conv) == "TRL prompt/completion"
    assert normalize(conv) == [{"role": "system", "content": "Be brief."}, *QA]
    assert normalize({"prompt": "What is 2+2?", "completion": "4."}) == QA
    assert normalize({"prompt": "What is 2+2?", "response": "4."}) == QA  # prompt/response as before


def test_save_to_disk_folders(tmp_path):
    from datasets import Dataset, DatasetDict

    Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    assert msgs(tmp_path / "one") == [normalize(r) for r in ROWS]
    DatasetDict({"train": Dataset.from_list(ROWS[:2]), "test": Dataset.from_list(ROWS[2:])}).save_to_disk(
        str(tmp_path / "dict"))
    assert len(msgs(tmp_path / "dict")) == 2 and len(msgs(tmp_path / "dict", split="test")) == 1
    with pytest.raises(SourceError, match="splits train, test; set data.split"):
        msgs(tmp_path / "dict", split="validation")
    (tmp_path / "plain").mkdir()
    with pytest.raises(SourceError, match="not one `datasets` save_to_disk wrote"):
        msgs(tmp_path / "plain")


def test_gzip_jsonl(tmp_path):
    with gzip.open(tmp_path / "d.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in ROWS)
    assert msgs(tmp_path / "d.jsonl.gz") == [normalize(r) for r in ROWS]


def test_zstandard_jsonl(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    data = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    (tmp_path / "d.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
    assert msgs(tmp_path / "d.jsonl.zst") == [normalize(r) for r in ROWS]


def test_zstandard_missing_is_one_line(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "zstandard", None)  # import fails as when it is not installed
    (tmp_path / "d.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd")
    with pytest.raises(SourceError, match="needs the `zstandard` package"):
        msgs(tmp_path / "d.jsonl.zst")


def test_parquet_beside_a_folder_named_parquet(tmp_path, monkeypatch):
    """`-w parquet` makes a folder named parquet; reading a .parquet file from there must not load it."""
    from datasets import Dataset

    Dataset.from_list(ROWS).to_parquet(str(tmp_path / "d.parquet"))
    # a folder named parquet holding a saved dataset: `datasets.load_dataset("parquet", ...)` loaded it
    # and failed with "...saved using `save_to_disk`"
    Dataset.from_list([{"a": 1}]).save_to_disk(str(tmp_path / "parquet"))
    monkeypatch.chdir(tmp_path)
    assert msgs("d.parquet") == [normalize(r) for r in ROWS]


# ---- hub datasets through datasets.load_dataset, offline ------------------------------------------


def cache_hub_dataset(cache: Path, repo: str, split: str, rows: list[dict]) -> None:
    """Write `rows` where `datasets` keeps a downloaded hub dataset (<cache>/<org>___<name>/default/
    <version>/<hash>: the split's arrow file and dataset_info.json), as a download would have."""
    import datasets
    from datasets import Dataset
    from datasets.arrow_writer import ArrowWriter

    org, name = repo.split("/")
    folder = cache / f"{org}___{name}" / "default" / "0.0.0" / "0123456789abcdef"
    folder.mkdir(parents=True)
    ds = Dataset.from_list(rows)
    with ArrowWriter(path=str(folder / f"{name}-{split}.arrow")) as w:
        w.write_table(ds.data.table)
        n, nbytes = w.finalize()
    splits = datasets.SplitDict({split: datasets.SplitInfo(split, num_bytes=nbytes, num_examples=n, dataset_name=name)})
    datasets.DatasetInfo(features=ds.features, config_name="default", dataset_name=name,
                         splits=splits).write_to_directory(str(folder))


@pytest.fixture()
def hub_cache(tmp_path, monkeypatch):
    import datasets

    assert datasets.config.HF_HUB_OFFLINE  # tests never reach the hub (conftest sets HF_HUB_OFFLINE=1)
    cache = tmp_path / "hf-datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.chdir(tmp_path)
    return cache


def test_hf_source_loads_through_datasets_offline(hub_cache):
    cache_hub_dataset(hub_cache, "local-org/tiny_chats", "train_sft", ROWS)
    assert msgs("hf:local-org/tiny_chats:train_sft") == [normalize(r) for r in ROWS]
    with pytest.raises(SourceError, match="cannot load 'local-org/tiny_chats' split 'test' through datasets"):
        msgs("hf:local-org/tiny_chats:test")


def test_the_reference_runs_name_maps_to_the_hub(hub_cache):
    """`ultrachat_200k:train_sft` is HuggingFaceH4/ultrachat_200k's train_sft split, read through
    datasets (here: its cached copy), not a file path."""
    assert hub_source("ultrachat_200k:train_sft", DataCfg()) == (
        "ultrachat_200k", "HuggingFaceH4/ultrachat_200k", None, "train_sft")
    assert hub_source("hf:org/name:cfg:test", DataCfg())[1:] == ("org/name", "cfg", "test")
    assert hub_source("data.jsonl", DataCfg()) is None
    cache_hub_dataset(hub_cache, "HuggingFaceH4/ultrachat_200k", "train_sft", ROWS[:2])
    assert len(msgs("ultrachat_200k:train_sft")) == 2


def test_names_and_paths_never_mistaken(hub_cache):
    from dspark_kit.recipe.load import resolve_path

    base = hub_cache.parent
    for name in ("hf:org/x:train", "ultrachat_200k:train_sft", "gsm8k"):
        assert resolve_path(("data", "source"), name, base) == name  # a name stays a name
    assert resolve_path(("data", "source"), "d.jsonl", base) == str(base / "d.jsonl")
    # a local file named like a preset is read from disk
    (base / "gsm8k").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    with pytest.raises(SourceError, match="unsupported extension"):  # read as the local file it is
        msgs("gsm8k")
    # a hub name that is also a local folder would be read from disk by datasets: refused
    (base / "org" / "chats").mkdir(parents=True)
    with pytest.raises(SourceError, match="is also a local path here"):
        msgs("hf:org/chats:train")
    with pytest.raises(SourceError, match="a hub dataset is hf:NAME"):
        msgs("someone/chats:train")
    with pytest.raises(SourceError, match="write hf:NAME:SPLIT"):
        msgs("hf:a:b:c:d")


def test_two_assistant_turns_in_a_row_name_the_cause():
    from transformers import AutoTokenizer

    from dspark_kit.data.conversations import ConversationError
    from dspark_kit.data.template_rows import conversation_texts

    tok = AutoTokenizer.from_pretrained(Path(__file__).resolve().parent / "fixtures" / "tiny_tokenizer")
    two = [QA[0], QA[1], {"role": "assistant", "content": "Also 4."}]
    with pytest.raises(ConversationError, match="turns 1 and 2: two assistant turns in a row") as e:
        conversation_texts(tok, two, thinking=False)
    assert "thinking mode" not in str(e.value)
