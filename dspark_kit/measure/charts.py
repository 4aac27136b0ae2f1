"""Small matplotlib helpers (Agg backend: no display needed on servers or CI)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp" + path.suffix)
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    plt.close(fig)
    tmp.replace(path)
    return path


def grouped_bars(path: Path, series: dict[str, list[float]], *, title: str, xlabel: str,
                 ylabel: str, category_prefix: str = "pos") -> Path:
    """One bar group per index (e.g. draft position), one colour per series (e.g. checkpoint)."""
    n_cat = max((len(v) for v in series.values()), default=0)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.0 + 0.9 * n_cat), 3.6))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [k + (i - (len(series) - 1) / 2) * width for k in range(len(values))]
        ax.bar(xs, values, width=width, label=name)
    ax.set_xticks(range(n_cat), [f"{category_prefix}{k}" for k in range(n_cat)])
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(axis="y", alpha=0.3)
    if series:
        ax.legend(fontsize=8)
    return _save(fig, path)


def lines(path: Path, series: dict[str, tuple[list[float], list[float]]], *, title: str,
          xlabel: str, ylabel: str, markers: bool = False) -> Path:
    """One line per series: name -> (xs, ys)."""
    fig, ax = plt.subplots(figsize=(6.0, 3.6))
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, label=name, marker="o" if markers else None, lw=1.4)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    if all(float(x).is_integer() for xs, _ in series.values() for x in xs):  # epochs, steps
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if len(series) > 1:
        ax.legend(fontsize=8)
    return _save(fig, path)


def category_bars(path: Path, results: dict[str, list[dict]], *, title: str = "Acceptance per category") -> Path:
    """Left: acceptance length per category, one colour per result (checkpoint); right: per-position
    acceptance, one line per category (and result). `results`: label -> rows with category,
    acceptance_length and per_position_acceptance (eval.json / bench json "categories")."""
    names = list(dict.fromkeys(r["category"] for rows in results.values() for r in rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(9.0, 3.0 + 1.1 * len(names)), 3.8))
    width = 0.8 / max(1, len(results))
    for i, (label, rows) in enumerate(results.items()):
        by_name = {r["category"]: r for r in rows}
        xs = [k + (i - (len(results) - 1) / 2) * width for k in range(len(names))]
        left.bar(xs, [(by_name.get(n) or {}).get("acceptance_length") or 0.0 for n in names], width=width,
                 label=label or None)
        for r in rows:
            per = r.get("per_position_acceptance") or []
            right.plot(range(len(per)), per, marker="o", lw=1.2,
                       label=f"{label}: {r['category']}" if label else r["category"])
    left.set_xticks(range(len(names)), names, rotation=30, ha="right")
    left.set(title=title, ylabel="acceptance length")
    left.grid(axis="y", alpha=0.3)
    k = max((len(r.get("per_position_acceptance") or []) for rows in results.values() for r in rows), default=0)
    right.set_xticks(range(k), [f"pos{i}" for i in range(k)])
    right.set(title="Per-position acceptance", xlabel="draft position", ylabel="accepted / drafts")
    right.grid(alpha=0.3)
    right.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: one entry per line
    if any(results):
        left.legend(fontsize=8)
    return _save(fig, path)


def interval_bars(path: Path, names: list[str], series: dict[str, list[tuple[float | None, list[float] | None]]], *,
                  title: str, ylabel: str) -> Path:
    """One bar group per name, one colour per series (e.g. temperature); each bar (value, [lo, hi])
    with its interval as an error bar (a missing value is drawn as 0 without a bar)."""
    fig, ax = plt.subplots(figsize=(max(6.0, 2.0 + 0.9 * len(names)), 3.8))
    width = 0.8 / max(1, len(series))
    for i, (label, points) in enumerate(series.items()):
        xs = [k + (i - (len(series) - 1) / 2) * width for k in range(len(names))]
        ys = [v or 0.0 for v, _ in points]
        err = [[max(0.0, (v or 0.0) - (ci[0] if ci else v or 0.0)) for v, ci in points],
               [max(0.0, (ci[1] if ci else v or 0.0) - (v or 0.0)) for v, ci in points]]
        ax.bar(xs, ys, width=width, label=label, yerr=err, capsize=3)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set(title=title, ylabel=ylabel)
    ax.grid(axis="y", alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=8)
    return _save(fig, path)


def reliability_diagram(path: Path, curves: dict[str, list[dict]], *, title: str = "Confidence head reliability") -> Path:
    """Predicted acceptance (the bin's mean confidence) against the observed accept rate, one line per
    curve (rows of measure.suite_metrics.reliability), each marker sized by its bin's share of the
    slots; the diagonal is a perfectly calibrated head."""
    fig, ax = plt.subplots(figsize=(5.2, 4.6))
    ax.plot([0, 1], [0, 1], ls="--", color="grey", lw=1, label="calibrated")
    for name, rows in curves.items():
        line, = ax.plot([r["mean_confidence"] for r in rows], [r["accept_rate"] for r in rows], lw=1.2, label=name)
        total = sum(r["count"] for r in rows) or 1  # marker area: the bin's share of the slots
        ax.scatter([r["mean_confidence"] for r in rows], [r["accept_rate"] for r in rows], color=line.get_color(),
                   s=[12 + 240 * r["count"] / total for r in rows], zorder=3)
    ax.set(title=title, xlabel="predicted acceptance (confidence)", ylabel="accepted fraction", xlim=(0, 1),
           ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)
