"""Local data files and hub datasets as rows, each with where it came from and what reading changed.

`read_file(path, invalid_utf8)` reads a .jsonl/.ndjson file (also gzip- or zstandard-compressed:
`.jsonl.gz`, `.jsonl.zst`), a .json file (a list of rows, or an object holding one), a .parquet
file (pyarrow, batch by batch: no `datasets` builder, so a folder named `parquet` where you run
changes nothing) or a `datasets` `save_to_disk` folder. `read_hub(name, config, split)` loads a hub
dataset through `datasets.load_dataset` (its cache, or HF_HUB_OFFLINE=1 with a cached copy).

Each row comes as a `Record`: `where` ("data.jsonl:12", "data.parquet row 12"), the parsed row or a
`BadLine` (why it is no row), and `changes`: what reading altered in the row (a stripped byte-order
mark, invalid UTF-8 replaced when `data.invalid_utf8: replace`). Bytes that are not UTF-8 are
refused per row by default: a row is never trained with U+FFFD where its text was.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark_kit.jsonl import BadLine

INVALID_UTF8 = "invalid UTF-8 bytes (data.invalid_utf8: replace keeps the row with U+FFFD in their place)"
REPLACED_UTF8 = "invalid UTF-8 bytes replaced by U+FFFD (data.invalid_utf8: replace)"
BOM_STRIPPED = "UTF-8 byte-order mark before the first row stripped"
COMPRESSIONS = (".gz", ".zst")
JSONL = (".jsonl", ".ndjson")
SAVED_MARKERS = ("dataset_dict.json", "dataset_info.json")  # what save_to_disk writes: a DatasetDict, a Dataset


class SourceError(ValueError):
    """The source itself is unusable (missing file, unknown preset, a hub dataset that cannot load)."""


@dataclass(frozen=True)
class Record:
    where: str  # "data.jsonl:12" (file:line), "data.parquet row 12", "hf:NAME:SPLIT row 12"
    row: Any  # the parsed row, or a BadLine
    changes: tuple[str, ...] = ()  # what reading changed in the row (its reasons, counted)
    line: int | None = None  # a jsonl row's 1-based line


def kind_of(path: Path) -> str:
    """The reader a path needs: 'jsonl', 'json', 'parquet' or 'saved' (a save_to_disk folder);
    SourceError for anything else."""
    if path.is_dir():
        if any((path / name).is_file() for name in SAVED_MARKERS):
            return "saved"
        raise SourceError(f"data.source {path}: a folder, but not one `datasets` save_to_disk wrote (no "
                          f"{' or '.join(SAVED_MARKERS)}): give one of its data files")
    name = path.name.lower()
    for c in COMPRESSIONS:
        name = name.removesuffix(c)
    suffix = Path(name).suffix
    if suffix in JSONL:
        return "jsonl"
    if suffix == ".json":
        return "json"
    if suffix == ".parquet" and name == path.name.lower():
        return "parquet"
    raise SourceError(f"data.source {path}: unsupported extension {''.join(path.suffixes[-2:])!r} (use .jsonl, .json or .parquet; "
                      ".jsonl.gz/.jsonl.zst compressed; or a save_to_disk folder; formats: docs/DATA.md)")


def _open(path: Path):
    """The file's bytes, decompressed by its name (.gz, .zst)."""
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise SourceError(f"data.source {path}: a zstandard file needs the `zstandard` package "
                              "(pip install zstandard), or decompress it first (zstd -d)") from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(path.open("rb"), closefd=True))
    return path.open("rb")


def _decode(raw: bytes, invalid_utf8: str) -> tuple[str | None, tuple[str, ...]]:
    """(text, changes); text None when the bytes are not UTF-8 and the policy refuses them."""
    try:
        return raw.decode("utf-8"), ()
    except UnicodeDecodeError:
        if invalid_utf8 != "replace":
            return None, ()
        return raw.decode("utf-8", "replace"), (REPLACED_UTF8,)


def _bad_bytes(raw: bytes) -> str:
    """Where a row's first undecodable byte is, for the errors file."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"byte 0x{raw[e.start]:02x} at column {e.start + 1}"
    return ""


def _jsonl(path: Path, invalid_utf8: str) -> Iterator[Record]:
    with _open(path) as f:
        for number, raw in enumerate(f, 1):
            changes: tuple[str, ...] = ()
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw, changes = raw[3:], (BOM_STRIPPED,)
            if not raw.strip():
                continue
            where = f"{path}:{number}"
            text, more = _decode(raw, invalid_utf8)
            if text is None:
                yield Record(where, BadLine(_bad_bytes(raw), INVALID_UTF8, line=number, where=where), line=number)
                continue
            try:
                yield Record(where, json.loads(text), changes + more, number)
            except json.JSONDecodeError as e:
                yield Record(where, BadLine(text.rstrip("\r\n")[:200], f"invalid JSON line ({e.msg})",
                                                  line=number, where=where),
                             line=number)


def _surrogates(obj: Any) -> bool:
    """Whether a parsed value holds bytes `surrogateescape` kept (text that was not UTF-8)."""
    if isinstance(obj, str):
        return any("\udc80" <= c <= "\udcff" for c in obj)
    if isinstance(obj, dict):
        return any(_surrogates(k) or _surrogates(v) for k, v in obj.items())
    if isinstance(obj, list):
        return any(_surrogates(v) for v in obj)
    return False


def _replaced(obj: Any) -> Any:
    if isinstance(obj, str):
        return obj.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    if isinstance(obj, dict):
        return {_replaced(k): _replaced(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_replaced(v) for v in obj]
    return obj


def _json(path: Path, invalid_utf8: str) -> Iterator[Record]:
    """A .json file: a list of rows, an object holding one ({"data": [...]}), or a jsonl file named .json.
    Text that is not UTF-8 is judged per row, as in a jsonl file."""
    with _open(path) as f:
        raw = f.read()
    bom = raw.startswith(b"\xef\xbb\xbf")
    try:  # bytes that are not UTF-8 are kept as surrogates, judged per row below
        data = json.loads((raw[3:] if bom else raw).decode("utf-8", "surrogateescape"))
    except json.JSONDecodeError:
        yield from _jsonl(path, invalid_utf8)  # a .json file that is really jsonl
        return
    if isinstance(data, dict):
        data = next((v for v in data.values() if isinstance(v, list)), [data])
    for i, row in enumerate(data):
        changes = (BOM_STRIPPED,) if bom and i == 0 else ()
        where = f"{path} row {i + 1}"
        if _surrogates(row):
            if invalid_utf8 != "replace":
                yield Record(where, BadLine("", INVALID_UTF8, line=i + 1, where=where))
                continue
            row, changes = _replaced(row), (*changes, REPLACED_UTF8)
        yield Record(where, row, changes)


def _parquet(path: Path) -> Iterator[Record]:
    import pyarrow.parquet as pq

    n = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            n += 1
            yield Record(f"{path} row {n}", row)


def _rows_of(dataset: Any, where: str) -> Iterator[Record]:
    for i, row in enumerate(dataset):
        yield Record(f"{where} row {i + 1}", row)


def _saved(path: Path, split: str | None) -> Iterator[Record]:
    from datasets import DatasetDict, load_from_disk

    try:
        data = load_from_disk(str(path))
    except (OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise SourceError(f"data.source {path}: `datasets` cannot load this folder ({type(e).__name__}: "
                          f"{first[:300]})") from None
    if isinstance(data, DatasetDict):
        name = split or ("train" if "train" in data else next(iter(data)) if len(data) == 1 else None)
        if name not in data:
            raise SourceError(f"data.source {path}: a saved DatasetDict with splits {', '.join(data)}; "
                              f"set data.split to one of them")
        data = data[name]
    yield from _rows_of(data, str(path))


def read_file(path: Path, invalid_utf8: str = "refuse", split: str | None = None) -> Iterator[Record]:
    """The records of a local file or save_to_disk folder (kind_of names the reader)."""
    if not path.exists():
        raise SourceError(f"data.source {path}: file not found (a .jsonl/.json/.parquet path, a save_to_disk "
                          "folder, builtin:tiny-chat, a preset or hf:NAME[:CONFIG]:SPLIT; docs/DATA.md)")
    kind = kind_of(path)
    if kind == "jsonl":
        return _jsonl(path, invalid_utf8)
    if kind == "json":
        return _json(path, invalid_utf8)
    if kind == "parquet":
        return _parquet(path)
    return _saved(path, split)


def read_hub(name: str, config: str | None, split: str, label: str) -> Iterator[Record]:
    """A hub dataset's split through `datasets.load_dataset` (downloaded and cached by `datasets`;
    offline, HF_HUB_OFFLINE=1 reads its cached copy). `label`: the data.source as written.

    A name that is also a local path would be read from disk by `datasets`: refused, so a hub
    name is never a local folder's by accident (give the path itself, without hf:)."""
    if Path(name).expanduser().exists():
        raise SourceError(f"data.source {label}: {name!r} is also a local path here, which `datasets` would "
                          f"read instead of the hub dataset; for the local data give its path without hf:, for "
                          "the hub dataset run from another folder")
    from datasets import load_dataset

    try:
        data = load_dataset(name, config, split=split)
    except Exception as e:  # noqa: BLE001 - any failure to load is one line naming the source
        first = (str(e).strip().splitlines() or [""])[0]
        raise SourceError(f"data.source {label}: cannot load {name!r}"
                          f"{f' config {config!r}' if config else ''} split {split!r} through datasets "
                          f"({type(e).__name__}: {first[:300]}); offline (HF_HUB_OFFLINE=1) only a cached "
                          "copy loads") from None
    return _rows_of(data, label)
