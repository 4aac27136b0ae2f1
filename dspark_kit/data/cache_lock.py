"""One process builds a cache entry while the others wait and are told who holds it (the tiny
verifiers' builds, a GGUF verifier's conversion)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from filelock import FileLock


def lock_holder(owner: Path, now: float | None = None) -> str:
    """Who holds the build lock, from the note its holder leaves beside it."""
    try:
        held = json.loads(owner.read_text())
        return f"process {held['pid']} (building for {(now or time.time()) - held['since']:.0f} s)"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def _acquire(lock: FileLock, owner: Path, what: str, log) -> None:
    """Take the lock; when someone has it, say who and since when before waiting."""
    from filelock import Timeout

    try:
        lock.acquire(timeout=0)
    except Timeout:
        log(f"waiting for {what}: {lock_holder(owner)} holds {lock.lock_file}")
        lock.acquire()
    owner.write_text(json.dumps({"pid": os.getpid(), "since": time.time()}))
