"""A resumable JSONL output: append-only, one complete line per row, crash repair on resume.

Rows are streamed, not written temp+rename: a crash keeps every finished row.
Each write is flushed and every `fsync_every` lines fsync'ed; a resume cuts a
partial last line, drops unparsable ones and returns the keys already done.
A side file of per-key entries (e.g. errors) is compacted after a run to the
latest entry per key, minus the keys that have since succeeded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

Key = Callable[[dict[str, Any]], Any]


def open_for_resume(path: Path, resume: bool, key: Key) -> tuple[set[int], dict[str, int]]:
    """Keys (as ints) of the rows already in `path`; without resume (or no file) start it empty.

    On resume a partial last line is cut and unparsable lines dropped (counted in the info dict).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    info = {"truncated_bytes": 0, "dropped_lines": 0}
    if not resume or not path.exists():
        path.write_bytes(b"")
        return set(), info
    data = path.read_bytes()
    keep = data[: data.rfind(b"\n") + 1]  # up to the last complete line (or nothing)
    info["truncated_bytes"] = len(data) - len(keep)
    done: set[int] = set()
    good: list[bytes] = []
    for line in keep.splitlines(keepends=True):
        try:
            done.add(int(key(json.loads(line))))
            good.append(line)
        except (ValueError, KeyError, TypeError):
            info["dropped_lines"] += 1
    if info["truncated_bytes"] or info["dropped_lines"]:
        tmp = path.with_name(path.name + ".repair")
        tmp.write_bytes(b"".join(good))
        os.replace(tmp, path)
    return done, info


class JsonlSink:
    """One complete line per write; flush always, fsync every N lines."""

    def __init__(self, path: Path, fsync_every: int):
        self.f = path.open("a", encoding="utf-8")
        self.fsync_every, self.unsynced = max(1, fsync_every), 0

    def write(self, obj: dict[str, Any]) -> None:
        self.f.write(json.dumps(obj, ensure_ascii=False) + "\n")
        self.f.flush()
        self.unsynced += 1
        if self.unsynced >= self.fsync_every:
            self.sync()

    def sync(self) -> None:
        os.fsync(self.f.fileno())
        self.unsynced = 0

    def close(self) -> None:
        self.sync()
        self.f.close()


def compact_by_key(path: Path, settled: set[int], key: Key) -> None:
    """One entry per key (the latest), none for the `settled` keys; the file goes when none is left."""
    if not path.exists():
        return
    latest: dict[int, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            latest[int(key(json.loads(line)))] = line
        except (ValueError, KeyError, TypeError):
            continue
    keep = [line for k, line in latest.items() if k not in settled]
    if not keep:
        path.unlink()
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
    os.replace(tmp, path)
