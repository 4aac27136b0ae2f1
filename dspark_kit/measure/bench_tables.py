"""Tables and charts of bench results: one run's, or several side by side (`bench --compare`).

`load_bench_result` reads the kit's bench JSON or a `vllm bench serve --save-result` JSON as the
kit's schema; `bench_markdown` is the table bench writes and the report shows; `compare` writes
the side-by-side table with its per-position and per-category charts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dspark_kit import atomic
from dspark_kit.measure.vllm_bench import import_vllm_bench, read_json
from dspark_kit.specdec.acceptance import per_position

NA = "–"


def fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return NA
    if isinstance(v, float):
        return f"{v:.{digits}f}" if abs(v) >= 0.01 or v == 0 else f"{v:.2g}"
    return str(v)


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def load_bench_result(path: str | Path) -> dict[str, Any]:
    """Our bench JSON or a `vllm bench serve --save-result` JSON, as our schema."""
    path = Path(path)
    raw = read_json(path, "bench")
    if isinstance(raw, dict) and str(raw.get("schema", "")).startswith("dspark-kit.bench/"):
        return raw
    return import_vllm_bench(path, raw)


def _temperature(r: dict[str, Any]) -> str:
    t = r.get("temperature")
    return NA if t is None else f"{t:g}"


def _server_latency(r: dict[str, Any]) -> str:
    m = r.get("server_metrics") or {}
    return f"{fmt(m.get('mean_tpot_ms'), 1)} / {fmt(m.get('mean_ttft_ms'), 1)}" if m else NA


def bench_markdown(results: list[dict[str, Any]]) -> str:
    """One row per metric, one column per result."""
    specs = [r.get("spec_decode") or {} for r in results]
    n_pos = max((len(per_position(s)) for s in specs), default=0)

    def row(name: str, values: list[str]) -> list[str]:
        return [name, *values]

    def rate_pct(s: dict) -> str:
        return fmt(s["acceptance_rate"] * 100, 2) if s.get("acceptance_rate") is not None else NA

    rows = [
        row("temperature", [_temperature(r) for r in results]),
        row("acceptance length", [fmt(s.get("acceptance_length")) for s in specs]),
        row("acceptance rate (%)", [rate_pct(s) for s in specs]),
    ]
    for k in range(n_pos):
        vals = [per_position(s) for s in specs]
        rows.append(row(f"pos{k} rate", [fmt(v[k], 4) if k < len(v) else NA for v in vals]))
    if any(r.get("in_process") for r in results):  # the run's served-acceptance gate
        gate = [r.get("in_process") or {} for r in results]
        rows.append(row("in-process eval acceptance length", [fmt(g.get("in_process_acceptance_length")) for g in gate]))
        rows.append(row("served / in-process", [fmt(g.get("fraction")) + (" (gated)" if g.get("comparable") else "")
                                                 if g.get("fraction") is not None else NA for g in gate]))
    rows += [
        row("output throughput (tok/s)", [fmt(r.get("output_throughput"), 1) for r in results]),
        row("mean TPOT (ms)", [fmt(r.get("mean_tpot_ms"), 1) for r in results]),
        row("mean TTFT (ms)", [fmt(r.get("mean_ttft_ms"), 1) for r in results]),
        row("server: output tok/s", [fmt((r.get("server_metrics") or {}).get("output_throughput"), 1)
                                     for r in results]),
        row("server: mean TPOT / TTFT (ms)", [_server_latency(r) for r in results]),
        row("drafts / accepted", [f"{s['num_drafts']} / {s['num_accepted_tokens']}" if s else NA
                                  for s in specs]),
        row("requests ok / failed", [f"{r.get('completed', NA)} / {r.get('failed', NA)}" for r in results]),
        row("concurrency", [fmt(r.get("concurrency")) for r in results]),
    ]
    labels = [str(r.get("label", f"run{i}")) for i, r in enumerate(results)]
    md = table(["metric", *labels], rows)
    per_category = category_table(dict(zip(labels, (r.get("categories") or [] for r in results), strict=True)))
    if per_category:
        temps = ", ".join(dict.fromkeys(_temperature(r) for r in results))
        md += (f"\n\n**Acceptance per category** at temperature {temps} (acceptance length; per-position "
                  "acceptance)\n\n" + per_category)
    notes = []
    if any(not r.get("spec_decode") for r in results):
        notes.append(f"{NA} in acceptance rows: the server reported no speculative drafts "
                     "(no draft configured, or /metrics unavailable).")
    if any(r.get("streamed") is False for r in results):
        notes.append("A server that did not stream: TTFT = full latency, TPOT = latency / output tokens.")
    return md + "".join(f"\n\n{n}" for n in notes)


def category_table(results: dict[str, list[dict]]) -> str | None:
    """One row per category, one column per result (checkpoint): `AL (pos0, pos1, ...)`; None
    when no result measured categories."""
    names = list(dict.fromkeys(r["category"] for rows in results.values() for r in rows))
    if not names:
        return None

    def cell(row: dict | None) -> str:
        if not row or row.get("acceptance_length") is None:
            return NA
        return f"{fmt(row['acceptance_length'])} ({', '.join(fmt(x, 2) for x in per_position(row))})"

    by = {label: {r["category"]: r for r in rows} for label, rows in results.items()}
    return table(["category", *results], [[n, *[cell(by[label].get(n)) for label in results]] for n in names])


def category_png(results: dict[str, list[dict]], path: Path, title: str) -> Path | None:
    from dspark_kit.measure.charts import category_bars

    results = {k: v for k, v in results.items() if v}
    return category_bars(path, results, title=title) if results else None


def per_position_png(results: list[dict[str, Any]], path: Path) -> Path | None:
    from dspark_kit.measure.charts import grouped_bars

    series = {str(r.get("label")): per_position(r.get("spec_decode") or {})
              for r in results}
    series = {k: v for k, v in series.items() if v}
    if not series:
        return None
    return grouped_bars(path, series, title="Per-position acceptance (serving)",
                        xlabel="draft position", ylabel="accepted / drafts")


def compare(paths: list[str | Path], out: str | Path | None = None) -> tuple[str, list[Path]]:
    """Markdown comparison of bench results; with `out` also writes it (+ PNG). Returns (md, files)."""
    results = [load_bench_result(p) for p in paths]
    seen: dict[str, int] = {}
    for r in results:  # two files with one label would make columns ambiguous
        n = seen[r["label"]] = seen.get(r["label"], 0) + 1
        if n > 1:
            r["label"] = f"{r['label']}#{n}"
    md = bench_markdown(results)
    if out is None:
        return md, []
    out = Path(out)
    md_path = out if out.suffix == ".md" else out / "compare.md"
    md_path.parent.mkdir(parents=True, exist_ok=True)
    png = per_position_png(results, md_path.with_suffix(".png"))
    cats = category_png({str(r["label"]): r.get("categories") or [] for r in results},
                        md_path.with_name(md_path.stem + "_categories.png"), "Acceptance length per category")
    body = md + (f"\n\n![per-position acceptance]({png.name})" if png else "")
    body += f"\n\n![acceptance per category]({cats.name})" if cats else ""
    atomic.write_text(md_path, body + "\n")
    return md, [md_path, *(p for p in (png, cats) if p)]
