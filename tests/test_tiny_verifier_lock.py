"""A process waiting for the tiny verifier's build says who holds the lock and for how long."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

from filelock import FileLock

from dspark_kit.data.tiny_verifier import (
    TinySpec,
    ensure_tiny_verifier,
    lock_holder,
    tiny_verifier_dir,
)


def test_a_waiting_build_names_the_holder_then_uses_its_result(tmp_path: Path):
    out = tiny_verifier_dir(TinySpec(), tmp_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    lock, owner = FileLock(str(out) + ".lock"), Path(str(out) + ".lock.owner")
    lock.acquire()
    owner.write_text(json.dumps({"pid": 4242, "since": time.time() - 30}))
    said: list[str] = []
    waiting = threading.Event()

    def log(line: str) -> None:
        said.append(line)
        if line.startswith("waiting for"):
            waiting.set()

    result: list[Path] = []
    t = threading.Thread(target=lambda: result.append(ensure_tiny_verifier(TinySpec(), tmp_path, log=log)))
    t.start()
    assert waiting.wait(30), said
    held = re.search(r"process 4242 \(building for (\d+) s\) holds .*\.lock$", said[0])
    assert held and int(held.group(1)) >= 30, said  # since 30 s before: no upper bound on a busy machine
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"")  # the holder finished the build
    owner.unlink()
    lock.release()
    t.join(30)
    assert result == [out] and len(said) == 1  # nothing built a second time
    assert not owner.exists() and not lock.is_locked


def test_an_unreadable_owner_note_is_another_process(tmp_path: Path):
    note = tmp_path / "x.lock.owner"
    assert lock_holder(note) == "another process"
    note.write_text(json.dumps({"pid": os.getpid(), "since": 100.0}))
    assert lock_holder(note, now=160.0) == f"process {os.getpid()} (building for 60 s)"
