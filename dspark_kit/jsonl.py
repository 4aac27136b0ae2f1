"""The one JSONL reader: every jsonl the kit reads (data sources, regen output and its side files,
eval prompts, bench datasets) goes through `read_jsonl`; each caller decides what a bad line means."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class BadLine:
    """A line that is not a row: its text (decoded), why, and whether it is a torn last line (no
    newline after it: a writer that died mid-line)."""

    text: str
    reason: str
    torn: bool = False
    line: int | None = None  # 1-based line in its file (a data source's other readers: the row's position)
    where: str | None = None  # "file:line" or "file row N", set by a reader that knows its source


def read_jsonl(path: Path, *, errors: str = "replace", whole_lines_only: bool = False) -> Iterator[Any | BadLine]:
    """Each non-blank line of `path`, parsed, or a BadLine; read lazily (stop early for a sample).

    `errors`: how undecodable bytes are read ("strict": UnicodeDecodeError). `whole_lines_only`: a
    last line without its newline is a BadLine even if it parses (a resume must cut it: the rest
    of that row was never written)."""
    for _raw, row in read_jsonl_raw(path, errors=errors, whole_lines_only=whole_lines_only):
        yield row


def read_jsonl_numbered(path: Path, *, errors: str = "replace") -> Iterator[tuple[int, Any | BadLine]]:
    """read_jsonl with each row's 1-based line number (a BadLine carries its own too)."""
    for number, (_raw, row) in _numbered(path, errors, False):
        yield number, row


def read_jsonl_raw(path: Path, *, errors: str = "replace",
                   whole_lines_only: bool = False) -> Iterator[tuple[bytes, Any | BadLine]]:
    """read_jsonl with each line's bytes beside it, for a caller that rewrites the lines it keeps."""
    for _number, item in _numbered(path, errors, whole_lines_only):
        yield item


BOM = b"\xef\xbb\xbf"  # a UTF-8 byte-order mark: some editors start a file with it; not part of the row


def _numbered(path: Path, errors: str, whole_lines_only: bool) -> Iterator[tuple[int, tuple[bytes, Any | BadLine]]]:
    with Path(path).open("rb") as f:
        for number, raw in enumerate(f, 1):
            text = raw.decode("utf-8", errors)
            if number == 1 and text.startswith("\ufeff"):
                text = text[1:]
            if not text.strip():
                continue
            torn = not raw.endswith(b"\n")
            if torn and whole_lines_only:
                yield number, (raw, BadLine(text, "torn last line (no newline)", torn=True, line=number))
                continue
            try:
                yield number, (raw, json.loads(text))
            except json.JSONDecodeError as e:
                yield number, (raw, BadLine(text.rstrip("\r\n"), f"invalid JSON line ({e.msg})", torn=torn,
                                            line=number))
