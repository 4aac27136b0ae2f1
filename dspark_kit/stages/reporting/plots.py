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
