"""The tiny demo end to end, per stage: `dspark-kit run recipes/tiny-cpu.yaml --workdir TMP --json`.

    .venv/bin/python benchmarks/bench_pipeline.py [--keep DIR] [--json out.json]

CPU seconds (user + sys of the run and every server it started) are reported next to
the wall time: a loaded machine stretches wall time several-fold but CPU time much less.
Per-stage seconds come from the run's state.json (what `run` records); the CLI
overhead is the wall time not spent inside any stage (imports, manifest, state).
A failing stage is reported as such with the stages before it. --keep DIR leaves
the run there (run_all.py reuses it for the train and acceptance benchmarks).
"""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, Row, cli, emit, this_command

GOAL_S = 300  # the Makefile: `make demo` takes "a few minutes" on a laptop CPU


def main() -> None:
    ap = cli(__doc__.splitlines()[0])
    ap.add_argument("--keep", type=Path, help="run in this directory and keep it")
    args = ap.parse_args()
    wd = args.keep or Path(tempfile.mkdtemp(prefix="bench-demo-")) / "run"
    shutil.rmtree(wd, ignore_errors=True)
    cmd = [sys.executable, "-m", "dspark_kit", "run", str(REPO / "recipes" / "tiny-cpu.yaml"),
           "--workdir", str(wd), "--json"]
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    state = json.loads((wd / "state.json").read_text()) if (wd / "state.json").exists() else {}
    rows = []
    for stage, s in state.items():
        status = s.get("status")
        secs = s.get("seconds") if status == "done" else None
        note = f"figure {s.get('figure')}" if status == "done" else f"**{status}**"
        rows.append(Row("demo", f"stage {stage}", secs, "s", notes=note))
    in_stages = sum(s.get("seconds") or 0 for s in state.values())
    ok = proc.returncode == 0
    err = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    rows.append(Row("demo", "whole run (wall)", wall, "s", f"< {GOAL_S} s", ok and wall < GOAL_S,
                    notes="exit 0" if ok else f"exit {proc.returncode}: {err[:160]}"))
    rows.append(Row("demo", "whole run (CPU seconds, user + sys, all processes)", cpu, "s",
                    notes=f"load-resistant: wall on a busy machine grows, CPU time much less; "
                          f"CPU/wall = {cpu / wall:.2f} cores used"))
    rows.append(Row("demo", "CLI overhead outside stages", (wall - in_stages) / wall if wall else None, "of wall",
                    notes=f"{wall - in_stages:.1f}s: interpreter start, imports, manifest, state"))
    emit(rows, args.json, this_command("bench_pipeline.py"))
    if not args.keep:
        shutil.rmtree(wd.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
