"""Write a file so a reader never sees it half-written: temp file, then rename."""

from __future__ import annotations

import os
import threading
from pathlib import Path


def write_text(path: Path, text: str) -> None:
    """The temp file's name is this writer's own (pid and thread): two processes recording into one
    run folder (the trainer nodes of a multi-node job share it) must not rename each other's
    half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
