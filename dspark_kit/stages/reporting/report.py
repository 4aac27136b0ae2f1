"""Run report: training curves, per-epoch validation, eval and bench tables.

`build_report(run_dir)` reads what a run left behind (tensorboard events from
speculators' logger, `checkpoints/<epoch>/val_metrics.json`, `eval/*.json`,
`bench/*.json`) and writes `run_dir/report/report.md` + PNGs. Anything missing
is listed as "not run". Also renders the checkpoint comparison table used by
`dspark-kit bench --compare`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dspark_kit import atomic
from dspark_kit.engines.prom import MetricsError
from dspark_kit.measure.bench_tables import (
    NA,
    bench_markdown,
    category_png,
    fmt,
    load_bench_result,
    per_position_png,
    table,
)
from dspark_kit.progress import STANDALONE, Reporter
from dspark_kit.resolved import Resolved
from dspark_kit.rundir import RunDir, bench_result_files, epoch_dirs
from dspark_kit.specdec.acceptance import per_position
from dspark_kit.stages.plan import StagePlan

TRAIN_LOSS_TAG = "train/loss"
VAL_PREFIX = "val/"
# speculators 0.9.0 (train/trainer.py val_epoch, models/dspark/metrics.py): `<metric>_epoch`
VAL_ROWS = [("loss_epoch", "val loss"), ("accept_len_epoch", "accept_len"),
            ("accept_rate_epoch", "accept_rate"), ("full_acc_epoch", "full_acc"),
            ("eal_epoch", "greedy accept_len (eal)")]


# ---- training logs -----------------------------------------------------------


def read_scalars(log_dir: Path) -> dict[str, list[tuple[float, int, float]]]:
    """tag -> [(wall_time, step, value)] over every event file under log_dir."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    dirs = sorted({p.parent for p in log_dir.rglob("events.out.tfevents*")}) if log_dir.is_dir() else []
    merged: dict[str, list[tuple[float, int, float]]] = {}
    for d in dirs:
        acc = EventAccumulator(str(d), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            merged.setdefault(tag, []).extend((e.wall_time, e.step, e.value) for e in acc.Scalars(tag))
    for events in merged.values():
        events.sort()
    return merged


def val_by_epoch(run_dir: Path, scalars: dict[str, list]) -> dict[int, dict[str, float]]:
    """epoch -> {metric_epoch: value}; val_metrics.json wins over tensorboard order."""
    epochs: dict[int, dict[str, float]] = {}
    for tag, events in scalars.items():
        if tag.startswith(VAL_PREFIX):
            for i, (_, _, v) in enumerate(events):  # one val event per epoch, in time order
                epochs.setdefault(i, {})[tag[len(VAL_PREFIX):]] = v
    ckpts = RunDir.at(run_dir).checkpoints
    if ckpts.is_dir():
        for d in epoch_dirs(ckpts):
            f = d / "val_metrics.json"
            if f.is_file():
                try:
                    epochs[int(d.name)] = {k: float(v) for k, v in json.loads(f.read_text()).items()
                                           if isinstance(v, (int, float))}
                except (json.JSONDecodeError, OSError):
                    continue
    return dict(sorted(epochs.items()))


def epoch_markdown(epochs: dict[int, dict[str, float]], best: str | None = None) -> str:
    """One row per metric, one column per epoch."""
    cols = sorted(epochs)
    header = ["metric", *[f"epoch {e}" + (" (best)" if best == str(e) else "") for e in cols]]
    rows = [[name, *[fmt(epochs[e].get(key)) for e in cols]] for key, name in VAL_ROWS
            if any(key in epochs[e] for e in cols)]
    positions = sorted({int(k.split("_")[1]) for e in cols for k in epochs[e]
                        if k.startswith("position_") and k.endswith("_acc_epoch")})
    rows += [[f"pos{p} acc", *[fmt(epochs[e].get(f"position_{p}_acc_epoch")) for e in cols]]
             for p in positions]
    return table(header, rows)


# ---- eval results ------------------------------------------------------------


def eval_files(run: RunDir) -> list[Path]:
    """The eval results in eval/: every JSON there but the tune results (their own lines, tune_line)."""
    tunes = {run.tune_file.name, run.served_tune_file.name}
    return sorted(f for f in run.eval.glob("*.json") if f.name not in tunes)


def tune_line(run: RunDir) -> str | None:
    """What `dspark-kit tune` recommended, as one line; None without a tune result."""
    from dspark_kit.resolved import ResolveError, Tune

    lines = []
    for path, what in ((run.tune_file, "Window tune"), (run.served_tune_file, "Served tune (by throughput)")):
        try:
            tune = Tune.read(path)
        except ResolveError as e:
            lines.append(f"{what}: {e}")
            continue
        if tune is not None:
            window = tune.window if tune.window is not None else "none (windows did not help)"
            lines.append(f"{what} (`eval/{path.name}`): recommended K {fmt(tune.k)}, draft window {window}."
                         + (f" Note: {tune.note}." if tune.note else ""))
    return " ".join(lines) or None


def _eval_rows(obj: Any, name: str) -> list[tuple[str, dict]]:
    """Every dict that carries a single acceptance_length, named by file (+ context length)."""
    if isinstance(obj, dict):
        if "acceptance_length" in obj and not isinstance(obj["acceptance_length"], (dict, list)):
            ctx, category = obj.get("context_length"), obj.get("category")
            if category is not None:
                return [(f"{name} [{category}]", obj)]
            per_category = [r for c in obj.get("categories") or [] for r in _eval_rows(c, name)]
            return [(f"{name} @ {ctx}" if ctx is not None else name, obj), *per_category]
        return [r for k, v in obj.items() for r in _eval_rows(v, name)]
    if isinstance(obj, list):
        return [r for v in obj for r in _eval_rows(v, name)]
    return []


def eval_markdown(files: list[Path]) -> str | None:
    rows = []
    for f in files:
        try:
            data = json.loads(f.read_text())
            t = data.get("temperature") if isinstance(data, dict) else None
            rows += _eval_rows(data, f"{f.stem} (temperature {t:g})" if t else f.stem)
        except (OSError, json.JSONDecodeError):
            rows.append((f.stem, {"acceptance_length": "unreadable"}))
    if not rows:
        return None
    body = [[n, fmt(d.get("acceptance_length")),
             ", ".join(fmt(x) for x in per_position(d)) or NA] for n, d in rows]
    return table(["eval", "acceptance length", "per-position acceptance"], body)


def context_series(run_dir: Path) -> dict[str, dict[int, float]]:
    """AL by context length per window setting, from the tune result and eval/eval.json (tune rows
    at the tune's recommended K).

    Keys: "no window" and "window W"; values: {context tokens (0 = short prompts): AL}.
    Window-tune measurements win over eval runs at the same (window, context).
    """
    series: dict[str, dict[int, float]] = {}

    def put(window, ctx, al) -> None:
        if al is not None:
            series.setdefault(f"window {window}" if window else "no window", {})[int(ctx)] = float(al)

    run = RunDir.at(run_dir)
    ev = run.eval_json
    try:
        for r in json.loads(ev.read_text()).get("runs", []) if ev.is_file() else []:
            put(r.get("window"), r.get("context_length", 0), r.get("acceptance_length"))
    except (json.JSONDecodeError, AttributeError):
        pass
    tune = run.tune_file
    try:
        obj = json.loads(tune.read_text()) if tune.is_file() else {}
    except json.JSONDecodeError:
        obj = {}
    if obj.get("measurements"):
        k = obj.get("recommended_k")  # the K serving runs; other Ks are in the tune file
        for m in obj["measurements"]:
            if k is None or m.get("k") in (None, k):
                put(m.get("window"), m.get("context_length", 0), m.get("acceptance_length"))
    else:  # older files: window -> {context: AL}
        for key, row in (obj.get("acceptance_length") or {}).items():
            for ctx, al in row.items():
                put(None if key == "off" else int(key), int(ctx), al)
    return series


def context_png(run_dir: Path, path: Path) -> Path | None:
    """Line plot of AL vs context length per window; None when no long context was measured."""
    from dspark_kit.measure.charts import lines

    series = context_series(run_dir)
    if not any(c > 0 for pts in series.values() for c in pts):
        return None
    data = {name: ([c for c in sorted(pts)], [pts[c] for c in sorted(pts)]) for name, pts in series.items()}
    return lines(path, data, title="Acceptance length vs context length (0 = short prompts)",
                 xlabel="context tokens", ylabel="acceptance length", markers=True)


# ---- the report ----------------------------------------------------------------


def _read_json_or_empty(path: Path) -> dict:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def training_stopped_line(run: RunDir) -> str | None:
    """"Training stopped after epoch N of M" when the run's training did not finish (interrupted or
    failed: the run's state says so, or fewer whole epochs than train.epochs with no max_steps), with
    the command that resumes it; None when it finished or never started."""
    from dspark_kit.specdec.checkpoints import complete_epochs

    train = (_read_json_or_empty(run.manifest).get("recipe") or {}).get("train") or {}
    planned, status = train.get("epochs"), (_read_json_or_empty(run.state).get("train") or {}).get("status")
    done = len(complete_epochs(run.checkpoints))
    if not isinstance(planned, int) or status == "done" or (status is None and (not done or train.get("max_steps"))):
        return None
    if done >= planned:
        return None
    how = "interrupted or failed" if status else "fewer whole epochs than train.epochs"
    return (f"**Training stopped after epoch {done} of {planned}** ({how}): `dspark-kit run --replay {run.root}` "
            "resumes it where it stopped (speculators' `interrupted` save, else the last whole epoch; finished "
            "stages are skipped).")


def build_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write `run_dir/report/report.md` (or `out`) with PNGs in run_dir/report; returns its path."""
    from dspark_kit.measure.charts import lines

    run_dir = Path(run_dir).resolve()
    if not run_dir.is_dir():
        raise FileNotFoundError(f"RUN_DIR {run_dir}: not a directory (pass the recipe's workdir)")
    run = RunDir.at(run_dir)
    rep = run.report
    md_path = Path(out).resolve() if out else run.report_md
    link = lambda p: os.path.relpath(p, md_path.parent)
    parts = [f"# dspark-kit report: {run_dir.name}", f"Run directory: `{run_dir}`"]

    scalars = read_scalars(run.logs)
    epochs = val_by_epoch(run_dir, scalars)
    best_link = run.best_checkpoint
    best = os.readlink(best_link) if best_link.is_symlink() else None
    parts.append("## Training (teacher-forced validation per epoch)")
    stopped = training_stopped_line(run)
    if stopped:
        parts.append(stopped)
    if epochs:
        parts.append(epoch_markdown(epochs, best))
        parts.append("Teacher-forced `accept_len` is not serving acceptance: the bench "
                     "acceptance length below is the gold standard.")
    else:
        parts.append("not run (no `logs/` tensorboard events or `checkpoints/*/val_metrics.json`)")
    if scalars.get(TRAIN_LOSS_TAG):
        ev = scalars[TRAIN_LOSS_TAG]
        png = lines(rep / "train_loss.png", {"train loss": ([s for _, s, _ in ev], [v for *_, v in ev])},
                    title="Training loss", xlabel="step", ylabel="loss")
        parts.append(f"![train loss]({link(png)})")
    al = [(e, m["accept_len_epoch"]) for e, m in epochs.items() if "accept_len_epoch" in m]
    if al:
        png = lines(rep / "val_accept_len.png", {"val accept_len": ([e for e, _ in al], [v for _, v in al])},
                    title="Validation accept_len (teacher-forced)", xlabel="epoch",
                    ylabel="accept_len", markers=True)
        parts.append(f"![val accept_len]({link(png)})")

    parts.append("## Offline eval")
    eval_md = eval_markdown(eval_files(run))
    parts.append(eval_md or "not run (no `eval/*.json`)")
    tune = tune_line(run)
    if tune:
        parts.append(tune)
    from dspark_kit.measure.suite_report import report_parts

    parts += report_parts(run.eval, run.tune_file, link)

    ev = _read_json_or_empty(run.eval_json)
    png = category_png({"": ev.get("categories") or []}, rep / "eval_categories.png",
                       "Offline acceptance length per category")
    if png:
        parts.append(f"### Acceptance per category, temperature {ev.get('temperature') or 0:g}")
        parts.append(f"![acceptance per category]({link(png)})")

    png = context_png(run_dir, rep / "context_window.png")
    if png:
        parts.append("### Acceptance vs context length, with and without the draft window")
        parts.append(f"![AL vs context]({link(png)})")

    parts.append("## Serving benchmark")
    bench_files = bench_result_files(run.bench)
    results, bad = [], []
    for f in bench_files:
        try:
            results.append(load_bench_result(f))
        except MetricsError as e:
            bad.append(str(e))
    if results:
        parts.append(bench_markdown(results))
        png = per_position_png(results, rep / "bench_per_position.png")
        if png:
            parts.append(f"![per-position acceptance]({link(png)})")
        png = category_png({str(r.get("label")): r.get("categories") or [] for r in results},
                           rep / "bench_categories.png", "Served acceptance length per category")
        if png:
            parts.append(f"![served acceptance per category]({link(png)})")
    else:
        parts.append("not run (no `bench/*.json`; run `dspark-kit bench`)")
    parts += [f"skipped: {b}" for b in bad]
    atomic.write_text(md_path, "\n\n".join(parts) + "\n")
    return md_path


# ---- the stage ---------------------------------------------------------------


def plan(res: Resolved) -> StagePlan:
    return StagePlan.of(res, "report", [f"# in-process: report -> {res.run.report_md}"],
                        outputs={"report": str(res.run.report_md)})


def run(res: Resolved, plan: StagePlan, reporter: Reporter = STANDALONE) -> dict[str, Any]:
    return {"path": str(build_report(res.run.root))}


def report_plan(run: RunDir, out: Path | None) -> StagePlan:
    """The report stage's plan for a run folder (`dspark-kit report`), its markdown at `out` when given.
    Like build_report it needs only the folder: the report decides nothing from a recipe
    (DECIDED["report"] is empty), so RUN_DIR alone plans it wherever the command runs."""
    if not run.root.is_dir():  # the run stops here too, before writing anything
        raise FileNotFoundError(f"RUN_DIR {run.root}: not a directory (pass the recipe's workdir)")
    md = out.resolve() if out is not None else run.report_md
    lines = [f"# in-process: report -> {md} (PNGs in {run.report})",
             (f"# reads {run.logs} (tensorboard), {run.checkpoints}/*/val_metrics.json, {run.eval}/*.json "
              f"and {run.bench}/*.json; a stage not run yet is listed as \"not run\"")]
    return StagePlan("report", lines, inputs={"logs": str(run.logs), "checkpoints": str(run.checkpoints),
                                              "eval": str(run.eval), "bench": str(run.bench)},
                     outputs={"report": str(md), "plots": str(run.report)})
