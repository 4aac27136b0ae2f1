"""JsonlSink: every line flushed at once, fsyncs off the writer's thread (an event loop must not
wait on the disk), a last fsync on close that covers every line, a failed fsync surfaced."""

from __future__ import annotations

import errno
import json
import os
import threading

import pytest

from dspark_kit.jsonl_sink import JsonlSink


def test_lines_are_flushed_and_fsyncs_run_beside_the_writer(tmp_path, monkeypatch):
    real, calls = os.fsync, []

    def fsync(fd):
        calls.append((threading.current_thread(), os.fstat(fd).st_size))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    path = tmp_path / "out.jsonl"
    sink = JsonlSink(path, fsync_every=2)
    for i in range(5):
        sink.write({"idx": i, "text": "é"})
        assert len(path.read_bytes().splitlines()) == i + 1  # on disk (page cache) at once, whole lines
    sink.close()
    assert [json.loads(line)["idx"] for line in path.read_bytes().splitlines()] == list(range(5))
    assert calls and all(thread is not threading.main_thread() for thread, _ in calls)
    assert calls[-1][1] == path.stat().st_size  # the last fsync came after the last line


def test_a_failed_fsync_is_raised_to_the_writer(tmp_path, monkeypatch):
    def full(_fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    sink = JsonlSink(tmp_path / "out.jsonl", fsync_every=1)
    sink.write({"idx": 0})
    with pytest.raises(OSError, match="No space left"):
        sink.close()


def test_fsyncs_are_at_least_min_interval_apart_and_close_still_covers_every_line(tmp_path, monkeypatch):
    real, sizes = os.fsync, []

    def fsync(fd):
        sizes.append(os.fstat(fd).st_size)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    path = tmp_path / "out.jsonl"
    sink = JsonlSink(path, fsync_every=2, min_interval=60)
    for i in range(100):
        sink.write({"idx": i})
    sink.close()  # does not wait out the interval
    assert len(sizes) <= 2 and sizes[-1] == path.stat().st_size  # not 50: one, then the last on close


# ---- the one reader (dspark_kit.jsonl) -------------------------------------------------------


def test_read_jsonl_names_bad_lines_and_tolerates_a_torn_last_line(tmp_path):
    from dspark_kit.jsonl import BadLine, read_jsonl

    f = tmp_path / "rows.jsonl"
    f.write_bytes(b'{"i": 0}\n\nnot json\n{"i": 1}\n{"i": 2, "te')  # blank skipped; the writer died mid-row
    rows = list(read_jsonl(f))
    assert rows[0] == {"i": 0} and rows[2] == {"i": 1} and len(rows) == 4
    assert rows[1] == BadLine("not json", "invalid JSON line (Expecting value)", torn=False, line=3)
    assert isinstance(rows[3], BadLine) and rows[3].torn and rows[3].text == '{"i": 2, "te'


def test_read_jsonl_whole_lines_only_cuts_a_last_line_that_parses(tmp_path):
    """A resume's rule: a row whose newline never reached the disk is torn, even if it parses."""
    from dspark_kit.jsonl import BadLine, read_jsonl

    f = tmp_path / "rows.jsonl"
    f.write_bytes(b'{"i": 0}\n{"i": 1}')
    assert list(read_jsonl(f)) == [{"i": 0}, {"i": 1}]  # a hand-written file without a final newline
    *_, last = read_jsonl(f, whole_lines_only=True)
    assert isinstance(last, BadLine) and last.torn


def test_read_jsonl_decodes_with_replacement_unless_strict(tmp_path):
    from dspark_kit.jsonl import read_jsonl

    f = tmp_path / "rows.jsonl"
    f.write_bytes(b'{"t": "caf\xe9"}\n')
    assert list(read_jsonl(f)) == [{"t": "caf\ufffd"}]
    with pytest.raises(UnicodeDecodeError):
        list(read_jsonl(f, errors="strict"))
