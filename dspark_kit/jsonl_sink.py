"""A resumable JSONL output: append-only, one complete line per row, crash repair on resume.

Rows are streamed, not written temp+rename: a crash keeps every finished row.
Each write is flushed and every `fsync_every` lines fsync'ed (off the writer's thread); a resume cuts a
partial last line, drops unparsable ones and returns the keys already done (read with dspark_kit.jsonl).
A side file of per-key entries (e.g. errors) is compacted after a run to the
latest entry per key, minus the keys that have since succeeded.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson

from dspark_kit.jsonl import BadLine, read_jsonl_raw

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
    done: set[int] = set()
    good: list[bytes] = []
    for raw, row in read_jsonl_raw(path, whole_lines_only=True):
        if isinstance(row, BadLine) and row.torn:  # a partial last line: the rest of its row was never written
            info["truncated_bytes"] = len(raw)
            continue
        try:
            if not isinstance(row, BadLine):
                done.add(int(key(row)))
                good.append(raw)
                continue
        except (ValueError, KeyError, TypeError):
            pass
        info["dropped_lines"] += 1
    if info["truncated_bytes"] or info["dropped_lines"]:
        tmp = path.with_name(path.name + ".repair")
        tmp.write_bytes(b"".join(good))
        os.replace(tmp, path)
    return done, info


class JsonlSink:
    """One complete line per write, flushed at once; an fsync every `fsync_every` lines, at most
    one per `min_interval` seconds.

    The fsync runs on a thread of its own: writers are often an event loop (regen), and an
    fsync takes milliseconds during which no request would be sent or answered. It also holds
    the file, so a write that comes meanwhile waits for it: at thousands of rows a second an
    fsync every 32 rows stalled the loop for a sixth of its time (scripts/bench_regen_client.py),
    hence the floor between fsyncs. A flushed line survives the process dying either way; the
    fsync adds surviving the machine going down, for every line up to the last one it covered:
    at most `fsync_every` lines or `min_interval` seconds of them are at risk. close() waits for
    a last fsync of everything.
    """

    def __init__(self, path: Path, fsync_every: int, min_interval: float = 1.0):
        self.f = path.open("ab")  # orjson writes UTF-8 bytes, one line each
        self.fsync_every, self.unsynced, self.min_interval = max(1, fsync_every), 0, min_interval
        self._wanted, self._closed = threading.Event(), threading.Event()
        self._error: OSError | None = None
        self._syncer = threading.Thread(target=self._sync_loop, name=f"fsync {path.name}", daemon=True)
        self._syncer.start()

    def write(self, obj: dict[str, Any]) -> None:
        if self._error:
            raise self._error
        self.f.write(orjson.dumps(obj, option=orjson.OPT_APPEND_NEWLINE))
        self.f.flush()
        self.unsynced += 1
        if self.unsynced >= self.fsync_every:
            self.unsynced = 0
            self._wanted.set()

    def _sync_loop(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            closing = self._closed.is_set()
            try:
                os.fsync(self.f.fileno())
            except OSError as e:  # disk gone or full: the next write (or close) raises it
                self._error = e
            if closing:
                return
            self._closed.wait(self.min_interval)  # the floor between fsyncs; close() ends it at once

    def close(self) -> None:
        self._closed.set()
        self._wanted.set()
        self._syncer.join()
        self.f.close()
        if self._error:
            raise self._error


def _keyed(path: Path, key: Key) -> Iterator[tuple[int, bytes]]:
    """(key, line) of a side file's entries with a usable key (none when it is missing)."""
    if not path.exists():
        return
    for raw, row in read_jsonl_raw(path):
        try:
            if not isinstance(row, BadLine):
                yield int(key(row)), raw.rstrip(b"\r\n")
        except (ValueError, KeyError, TypeError):
            continue


def keys_in(path: Path, key: Key) -> set[int]:
    """The keys of a side file's entries (none when it is missing)."""
    return {k for k, _ in _keyed(path, key)}


def compact_by_key(path: Path, settled: set[int], key: Key) -> None:
    """One entry per key (the latest), none for the `settled` keys; the file goes when none is left."""
    if not path.exists():
        return
    latest = dict(_keyed(path, key))
    keep = [line for k, line in latest.items() if k not in settled]
    if not keep:
        path.unlink()
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(b"".join(line + b"\n" for line in keep))
    os.replace(tmp, path)
