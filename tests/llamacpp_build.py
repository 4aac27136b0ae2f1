"""Whether llama.cpp's llama-server (`make llama-cpp`) is there for the tests that run it.

`make test` builds it first (as CI does) and, when that build fails, writes INSTALL_FAILED with one
line; every test that needs the server then fails with that line instead of running. Without the
build and without a failed one (plain `pytest` on a machine that never ran `make llama-cpp`) they
skip with one line naming the fix, except on CI. Mirrors tests/vllm_build.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dspark_kit.specdec.llamacpp_tree import STAMP, llamacpp_dir, server_binary
from tests.vllm_build import on_ci

REPO = Path(__file__).resolve().parent.parent
INSTALL_FAILED = REPO / ".venv.llama-cpp-failed"  # the Makefile's $(LLAMACPP_FAILED)


def llama_server(marker: Path = INSTALL_FAILED) -> Path:
    """llama-server's path, or one line: fail (failed build, or missing on CI) or skip."""
    binary = server_binary()
    if marker.exists():
        pytest.fail(f"llama.cpp build: {marker.read_text().strip()} (its output is above in the `make test` log); "
                    f"the llama.cpp tests need {binary}", pytrace=False)
    if not (llamacpp_dir() / STAMP).exists():
        if on_ci():
            pytest.fail(f"llama-server missing on CI ({binary}): `make test` should have run `make llama-cpp`",
                        pytrace=False)
        pytest.skip(f"llama.cpp's llama-server not built ({binary}): run `make llama-cpp` (`make test` does)")
    return binary
