"""What a suite eval leaves: the paper-style table (console, eval.md), eval.json and its pictures,
and the paired-comparison table."""

from __future__ import annotations

import json
from pathlib import Path

from dspark_kit import atomic


def _f(x, nd: int = 3) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def _ci(ci) -> str:
    return "" if not ci else f" [{ci[0]:.2f}, {ci[1]:.2f}]"


def _row(name: str, r: dict) -> str:
    cal = r.get("calibration") or {}
    unc = " ".join(_f(x, 2) for x in r["per_position_unconditional"])
    cond = " ".join(_f(x, 2) for x in r["per_position_conditional"])
    return (f"| {name} | {r['prompts']} | {_f(r['tau'])}{_ci(r.get('tau_interval'))} | {unc} | {cond} | "
            f"{_f(r['drafts_per_request'], 1)} | {_f(cal.get('ece'))}{_ci(cal.get('ece_interval'))} | "
            f"{_f(cal.get('auc'))}{_ci(cal.get('auc_interval'))} |")


def table_rows(summary: dict) -> list[dict]:
    """One flat row per benchmark and temperature (what scripts read)."""
    out = []
    for b in summary["benchmarks"]:
        for t, r in b["results"].items():
            cal = r.get("calibration") or {}
            out.append({"benchmark": b["benchmark"], "temperature": float(t), "prompts": r["prompts"],
                        "requests": r["requests"], "tau": r["tau"], "tau_interval": r.get("tau_interval"),
                        "per_position_unconditional": r["per_position_unconditional"],
                        "per_position_conditional": r["per_position_conditional"],
                        "drafts_per_request": r["drafts_per_request"], "ece": cal.get("ece"),
                        "ece_interval": cal.get("ece_interval"), "auc": cal.get("auc"),
                        "auc_interval": cal.get("auc_interval"), "calibration_slots": cal.get("slots")})
    return out


def suite_markdown(summary: dict) -> str:
    k = summary["num_speculative_tokens"]
    lines = [f"# Suite {summary['suite']}: {summary['checkpoint']}", "",
             (f"K={k}, up to {summary['max_new_tokens']} new tokens, {summary['limit']} rows per benchmark "
              f"(seed {summary['seed']}), {summary['mode']} on {summary['device']}; tau counts the bonus token; "
              "[95% bootstrap interval over prompts]"), ""]
    if not summary.get("has_confidence_head"):
        lines += ["This draft has no confidence head: ECE and AUC are not measured.", ""]
    for t in summary["temperatures"]:
        key = f"{t:g}"
        lines += [f"## T = {t:g}" + (" (greedy)" if t == 0 else " (lossless speculative sampling, seeded)"), "",
                  ("| benchmark | prompts | tau | acceptance per position | conditional per position | drafts/request "
                  "| ECE | AUC |"), "|---|---|---|---|---|---|---|---|"]
        for b in summary["benchmarks"]:
            r = b["results"].get(key)
            if r is None:
                continue
            lines.append(_row(b["benchmark"], r))
        pooled = (summary.get("pooled") or {}).get(key)
        if pooled and len(summary["benchmarks"]) > 1:
            lines.append(_row("all (pooled)", pooled))
        lines.append("")
    lines.append("Sources: " + "; ".join(f"{b['benchmark']}: {b['source']}" for b in summary["benchmarks"]))
    return "\n".join(lines) + "\n"


def compare_markdown(result: dict) -> str:
    lines = [f"# Paired comparison: B - A on the same prompts ({result['statistic']})", "",
             f"A = {result['a']}", f"B = {result['b']}", "",
             "| benchmark | T | prompts | tau A | tau B | B - A | 95% interval |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['benchmark']} | {r['temperature']:g} | {r['prompts']} | {_f(r['a'])} | {_f(r['b'])} | "
                     f"{_f(r['difference'])} | {_ci(r['interval']).strip() or '–'} |")
    return "\n".join(lines) + "\n"


def write_suite_outputs(summary: dict, out_dir: Path) -> dict[str, str]:
    from dspark_kit.measure.charts import interval_bars, reliability_diagram

    files = {"json": out_dir / "eval.json", "markdown": out_dir / "eval.md", "tau_png": out_dir / "eval_suite_tau.png"}
    names = [b["benchmark"] for b in summary["benchmarks"]]
    series = {f"T={t:g}": [((b["results"].get(f"{t:g}") or {}).get("tau"),
                            (b["results"].get(f"{t:g}") or {}).get("tau_interval")) for b in summary["benchmarks"]]
              for t in summary["temperatures"]}
    interval_bars(files["tau_png"], names, series, title=f"tau per benchmark ({summary['suite']})",
                  ylabel="tau (acceptance length, bonus token counted)")
    # pooled over the suite's benchmarks, one curve per temperature (a benchmark's few slots per bin are noise)
    curves = {f"all benchmarks, T={t}": r["calibration"]["reliability"] for t, r in (summary.get("pooled") or {}).items()
              if r.get("calibration") and r["calibration"]["reliability"]}
    if curves:
        files["reliability_png"] = out_dir / "eval_reliability.png"
        reliability_diagram(files["reliability_png"], curves)
    summary["table"] = table_rows(summary)
    paths = {k: str(v) for k, v in files.items()}
    atomic.write_text(files["markdown"], suite_markdown(summary))
    atomic.write_text(files["json"], json.dumps({**summary, "files": paths}, indent=2))
    return paths


def report_parts(eval_dir: Path, tune_file: Path, link) -> list[str]:
    """The report's benchmark-suite sections (every eval/suite-*/eval.json, with its pictures) and the
    tune's confidence-threshold curve; `link(path)` makes a path relative to the report."""
    from dspark_kit.measure.threshold_curve import curve_markdown

    parts = []
    for f in sorted(eval_dir.glob("suite-*/eval.json")):
        try:
            s = json.loads(f.read_text(encoding="utf-8"))
            body = suite_markdown(s).split("\n", 1)[1]
        except (OSError, ValueError, KeyError) as e:
            parts.append(f"skipped: {f} ({type(e).__name__})")
            continue
        parts.append(f"## Benchmark suite {s['suite']} (`{link(f)}`)")
        parts.append(body.replace("\n## T = ", "\n### T = "))
        for key, alt in (("tau_png", "tau per benchmark"), ("reliability_png", "reliability diagram")):
            png = (s.get("files") or {}).get(key)
            if png and Path(png).is_file():
                parts.append(f"![{alt}]({link(Path(png))})")
    if tune_file.is_file():
        try:
            curve = json.loads(tune_file.read_text(encoding="utf-8")).get("threshold_curve")
        except (OSError, ValueError):
            curve = None
        lines = curve_markdown(curve)
        if lines:
            parts.append("\n".join(lines[1:]).replace("## Confidence", "### Confidence", 1))
    return parts
