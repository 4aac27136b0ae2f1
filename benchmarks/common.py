"""Shared helpers for the benchmark scripts: timing, result rows, tables.

Every benchmark measures ours and a baseline in the same run and reports the
ratio, so a slow or noisy machine still gives a stable answer. A script prints
a markdown table and, with `--json PATH`, writes its rows for run_all.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("DSPARK_KIT_CACHE", "/tmp/dkcache" if Path("/tmp/dkcache").is_dir() else "")
if not os.environ["DSPARK_KIT_CACHE"]:
    del os.environ["DSPARK_KIT_CACHE"]  # use the package default (~/.cache/dspark-kit)
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclass
class Row:
    """One measured figure: `value` against `goal` (a text such as '>= 0.8x')."""

    benchmark: str
    figure: str
    value: float | str | None
    unit: str = ""
    goal: str = ""
    met: bool | None = None  # None: no goal, or not measured
    notes: str = ""
    command: str = ""


def trained_demo_run(workdir: Path | None, tmp: Path) -> Path:
    """`workdir` when it holds a trained tiny run (checkpoints/), else one trained into tmp/run by
    the real CLI (prepare -> hidden-states -> train on recipes/tiny-cpu.yaml)."""
    import subprocess

    if workdir and (Path(workdir) / "checkpoints").is_dir():
        return Path(workdir)
    wd = tmp / "run"
    subprocess.run([sys.executable, "-m", "dspark_kit", "run", str(REPO / "recipes" / "tiny-cpu.yaml"), "--stages",
                    "prepare,hidden-states,train", "--workdir", str(wd), "--json"],
                   check=True, stdout=subprocess.DEVNULL)
    return wd


def train_through_cli(wd: Path, sets: list[str]) -> dict:
    """regen -> prepare -> hidden states -> train on the tiny recipe with the real CLI; prepare's
    summary (a resumed run skips what is done)."""
    import subprocess

    subprocess.run([sys.executable, "-m", "dspark_kit", "run", str(REPO / "recipes" / "tiny-cpu.yaml"), "-w", str(wd),
                    "--stages", "regen,prepare,hidden-states,train", "--json",
                    *(a for s in sets for a in ("--set", s))], check=True, stdout=subprocess.DEVNULL, cwd=REPO)
    return json.loads((wd / "prepared" / "prepare_meta.json").read_text())["summary"]


def best_of(fn: Callable[[], object], repeats: int = 3) -> tuple[float, object]:
    """Minimum wall time over `repeats` runs (the least disturbed one) and the last result."""
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times), result


def paired_runs(baseline: Callable[[], object], subject: Callable[[], object], pairs: int = 3) -> tuple[list, list]:
    """Run baseline and subject interleaved (B S, S B, B S ...): each side's results, pair by pair."""
    b_r, s_r = [], []
    for i in range(max(1, pairs)):
        if i % 2:  # alternate which side goes first: A B, B A, A B ...
            s_r.append(subject())
            b_r.append(baseline())
        else:
            b_r.append(baseline())
            s_r.append(subject())
    return b_r, s_r


def ratio_summary(b_t: list[float], s_t: list[float]) -> dict:
    """paired_ratios' answer for per-pair figures already measured (b_t[i] and s_t[i] one pair)."""
    ratios = [b / s for b, s in zip(b_t, s_t, strict=True)]
    return {"ratio": statistics.median(ratios), "lo": min(ratios), "hi": max(ratios), "pairs": len(ratios),
            "baseline_s": statistics.median(b_t), "subject_s": statistics.median(s_t)}


def paired_ratios(baseline: Callable[[], float], subject: Callable[[], float], pairs: int = 3) -> dict:
    """Interleave baseline and subject (B S, S B, B S ...) and take the ratio within each pair.

    Each callable returns its own elapsed seconds. Load that lands on one pair lands on
    both of its sides, so the median per-pair ratio means the same on a quiet or a busy
    machine; the spread (min..max over pairs) shows how much the load moved it.
    Returns {"ratio": median baseline/subject time (>1 = subject faster), "lo", "hi",
    "pairs", "baseline_s", "subject_s"} (times: medians).
    """
    return ratio_summary(*paired_runs(baseline, subject, pairs))


def spread(r: dict) -> str:
    return f"median of {r['pairs']} interleaved pairs, range {r['lo']:.3f}-{r['hi']:.3f}"


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
    return "—" if v is None else str(v)


def table(rows: list[Row]) -> str:
    head = "| benchmark | figure | value | goal | met | notes |\n|---|---|---|---|---|---|\n"
    mark = {True: "yes", False: "**no**", None: "—"}
    return head + "\n".join(
        f"| {r.benchmark} | {r.figure} | {fmt(r.value)}{' ' + r.unit if r.unit and r.value is not None else ''} "
        f"| {r.goal or '—'} | {mark[r.met]} | {r.notes} |" for r in rows)


def cli(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--json", type=Path, help="also write the rows here (run_all.py reads it)")
    return ap


def emit(rows: list[Row], json_path: Path | None, command: str) -> None:
    for r in rows:
        r.command = r.command or command
    print(table(rows))
    if json_path:
        tmp = json_path.with_name(json_path.name + ".tmp")
        tmp.write_text(json.dumps([asdict(r) for r in rows], indent=1))
        tmp.replace(json_path)


def this_command(script: str, extra: str = "") -> str:
    return f".venv/bin/python benchmarks/{script}{' ' + extra if extra else ''}"
