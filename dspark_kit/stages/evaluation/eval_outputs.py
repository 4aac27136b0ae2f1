"""What an eval leaves: eval.json, eval.md and its charts, and the markdown parts the pipeline's
summary and `window tune` print (temperature, categories, verify budget).

The in-process eval and the served one (served_tune.served_eval) write through `write_outputs`,
so both leave the same files.
"""

from __future__ import annotations

import json
from pathlib import Path

from dspark_kit import atomic


def markdown(summary: dict) -> str:
    how = f"Served eval ({summary['engine']} engine)" if summary.get("mode") == "served" else "Offline eval"
    lines = [
        f"# {how}: {summary['checkpoint']}",
        "",
        (f"K={summary['num_speculative_tokens']}, max_new_tokens={summary['max_new_tokens']}, "
         f"draft window={summary['draft_window_size']}, {temperature_words(summary.get('temperature'))}"),
        "",
        "| context | prompt tokens | window | acceptance length | per-position | tokens/verifier fwd | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in summary["runs"]:
        per = ", ".join(f"{x:.3f}" for x in r["per_position_acceptance"])
        lines.append(f"| {r['context_length'] or 'short'} | {r['mean_prompt_tokens']} | {r['window'] or 'off'} | "
                     f"{r['acceptance_length']} | {per} | {r['tokens_per_verifier_forward']} | {r['wall_s']} |")
    lines += category_markdown(summary.get("categories"), summary.get("temperature"))
    lines += budget_markdown(summary.get("verify_budget"))
    return "\n".join(lines) + "\n"


def temperature_words(t: float | None) -> str:
    """How a table names the temperature it measured at (None: recorded before eval.temperature existed)."""
    if t is None:
        return "temperature 0 (greedy)"
    return "temperature 0 (greedy)" if t == 0 else f"temperature {t:g} (speculative sampling)"


def category_markdown(rows: list[dict] | None, temperature: float | None = None) -> list[str]:
    """Acceptance length and per-position acceptance, one row per category, at the measured temperature."""
    if not rows:
        return []
    k = max(len(r.get("per_position_acceptance") or []) for r in rows)
    out = ["", f"## Acceptance per category, {temperature_words(temperature)}", "",
           "| category | prompts | acceptance length | " + " | ".join(f"pos{i}" for i in range(k)) + " |",
           "|---|---|---|" + "---|" * k]
    for r in rows:
        per = list(r.get("per_position_acceptance") or [])
        cells = [f"{x:.3f}" for x in per] + ["–"] * (k - len(per))
        al = r.get("acceptance_length")
        out.append(f"| {r['category']} | {r.get('count', '–')} | {'–' if al is None else f'{al:.3f}'} | "
                   + " | ".join(cells) + " |")
    return out


def budget_markdown(budget: dict | None) -> list[str]:
    """The fixed K beside confidence-threshold verify budgets (what adaptive verification trades)."""
    if not budget:
        return []
    out = ["", "## Verify budget from the confidence head", "",
           ("What serving with `serve.adaptive_verification` trades: fewer draft tokens verified per step for "
            "the acceptance length they keep (offline, short prompts)."), "",
           "| verify budget | acceptance length | draft tokens verified / step | tokens / verifier forward |",
           "|---|---|---|---|"]
    f = budget["fixed"]
    out.append(f"| fixed K={budget['k']} | {f['acceptance_length']} | {f['mean_verified_per_step']} | "
               f"{f['tokens_per_verifier_forward']} |")
    for t in budget["thresholds"]:
        out.append(f"| confidence >= {t['threshold']} | {t['acceptance_length']} | {t['mean_verified_per_step']} | "
                   f"{t['tokens_per_verifier_forward']} |")
    return out


def write_outputs(summary: dict, out_dir: Path) -> dict[str, str]:
    from dspark_kit.measure.charts import category_bars, grouped_bars, lines

    files = {"json": out_dir / "eval.json", "markdown": out_dir / "eval.md", "positions_png": out_dir / "eval_positions.png"}
    grouped_bars(files["positions_png"], {"acceptance": summary["per_position_acceptance"]},
                 title="Per-position acceptance (short prompts)", xlabel="draft position", ylabel="accepted / drafts")
    if summary.get("categories"):
        files["categories_png"] = out_dir / "eval_categories.png"
        category_bars(files["categories_png"], {"": summary["categories"]})
    long_runs = [r for r in summary["runs"] if r["context_length"]]
    if long_runs:
        series = {}
        for w in dict.fromkeys(r["window"] for r in long_runs):
            pts = sorted((r["context_length"], r["acceptance_length"] or 1.0) for r in long_runs if r["window"] == w)
            series[f"window {w}" if w else "no window"] = ([x for x, _ in pts], [y for _, y in pts])
        files["context_png"] = out_dir / "eval_context.png"
        lines(files["context_png"], series, title="Acceptance length vs context length",
              xlabel="context tokens", ylabel="acceptance length", markers=True)
    names = {k: str(v) for k, v in files.items()}
    atomic.write_text(files["markdown"], markdown(summary))
    atomic.write_text(files["json"], json.dumps({**summary, "files": names}, indent=2))
    return names
