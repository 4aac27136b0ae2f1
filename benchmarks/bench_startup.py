"""Plan-only commands start fast: `preflight`, `run --dry-run` and `serve --dry-run` on the tiny recipe.

    .venv/bin/python benchmarks/bench_startup.py [--repeats 5] [--json out.json]

Each command runs as a fresh process (what a user types), after one warm-up run (the tiny verifier
unpacked into the cache, speculators' fix probe remembered), `--repeats` times; the median wall time
is reported beside the baseline measured in the same run: a bare interpreter importing torch and
transformers, what every one of these commands used to pay before planning anything. Each row also
says which heavy packages the command imported (read from the process's own sys.modules at exit).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, Row, emit, this_command

GOAL_S = 3.0  # issue: about 3 s on a quiet machine
HEAVY = ("torch", "transformers", "speculators", "vllm")
RECIPE = str(REPO / "recipes" / "tiny-cpu.yaml")

# runs the CLI like its console script, then writes the heavy packages it imported to argv[1]
PROBE = (
    "import atexit, json, sys\n"
    "out = sys.argv.pop(1)\n"
    f"atexit.register(lambda: open(out, 'w').write(json.dumps([m for m in {HEAVY!r} if m in sys.modules])))\n"
    "from dspark_kit.cli import main\n"
    "sys.argv[0] = 'dspark-kit'\n"
    "main()\n"
)


def commands(wd: Path) -> dict[str, list[str]]:
    return {
        "preflight": ["preflight", "-r", RECIPE, "-w", str(wd)],
        "run --dry-run": ["run", RECIPE, "--dry-run", "-w", str(wd)],
        "serve --dry-run": ["serve", "--role", "spec", "--dry-run", "-r", RECIPE, "-w", str(wd)],
    }


def timed(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows: list[Row] = []
    tmp = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    baseline_argv = [sys.executable, "-c", "import torch, transformers"]
    baseline = statistics.median(timed(baseline_argv) for _ in range(args.repeats))
    rows.append(Row("plan-only start-up", "baseline: python -c 'import torch, transformers'", baseline, "s",
                    notes=f"median of {args.repeats}", command=this_command("bench_startup.py")))
    for name, cli in commands(tmp / "run").items():
        imported = tmp / f"{name.split()[0]}.json"
        argv = [sys.executable, "-c", PROBE, str(imported), *cli]
        timed(argv)  # warm-up: the verifier's cache entry, the remembered fix probe
        secs = statistics.median(timed(argv) for _ in range(args.repeats))
        heavy = json.loads(imported.read_text()) if imported.exists() else ["?"]
        rows.append(Row("plan-only start-up", f"dspark-kit {name} (tiny recipe)", secs, "s", f"<= {GOAL_S:g} s",
                        secs <= GOAL_S,
                        notes=(f"median of {args.repeats}, {secs / baseline:.2f}x the baseline; imports "
                               f"{', '.join(heavy) or 'none of ' + '/'.join(HEAVY)}"),
                        command=this_command("bench_startup.py")))
    emit(rows, args.json, this_command("bench_startup.py"))


if __name__ == "__main__":
    main()
