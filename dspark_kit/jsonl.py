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


def read_jsonl(path: Path, *, errors: str = "replace", whole_lines_only: bool = False) -> Iterator[Any | BadLine]:
    """Each non-blank line of `path`, parsed, or a BadLine; read lazily (stop early for a sample).

    `errors`: how undecodable bytes are read ("strict": UnicodeDecodeError). `whole_lines_only`: a
    last line without its newline is a BadLine even if it parses (a resume must cut it: the rest
    of that row was never written)."""
    for _raw, row in read_jsonl_raw(path, errors=errors, whole_lines_only=whole_lines_only):
        yield row


def read_jsonl_raw(path: Path, *, errors: str = "replace",
                   whole_lines_only: bool = False) -> Iterator[tuple[bytes, Any | BadLine]]:
    """read_jsonl with each line's bytes beside it, for a caller that rewrites the lines it keeps."""
    with Path(path).open("rb") as f:
        for raw in f:
            text = raw.decode("utf-8", errors)
            if not text.strip():
                continue
            torn = not raw.endswith(b"\n")
            if torn and whole_lines_only:
                yield raw, BadLine(text, "torn last line (no newline)", torn=True)
                continue
            try:
                yield raw, json.loads(text)
            except json.JSONDecodeError as e:
                yield raw, BadLine(text.rstrip("\r\n"), f"invalid JSON line ({e.msg})", torn=torn)
