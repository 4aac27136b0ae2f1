"""The plan, the saved points and the recommendation of `dspark-kit tune --served` (no server here).

A sweep is a list of server starts, one per (K, window), plus the verifier alone
(K 0, no speculation) first and again last. Each start measures every prompt
set (the short prompts, context 0, and each long context), one point per set.
The two verifier-alone runs bound the run-to-run spread of the machine: the
recommendation treats throughputs within that spread as a tie and gives the tie
to the higher acceptance.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark_kit import atomic

SCHEMA = "dspark-kit.served-tune/1"
# Rough costs for the dry run's estimate when nothing was measured yet (a previous sweep's own
# timings replace them): seconds to start a server, output tokens per second while serving.
ASSUMED = {"local": (15.0, 60.0), "vllm": (120.0, 1000.0), "vllm-ascend": (180.0, 1000.0)}
NO_WINDOW_ENGINES = {"vllm": "CUDA vLLM has no runtime draft window (it is trained in): K points only"}


@dataclass(frozen=True)
class ServerPoint:
    """One server start: K 0 is the verifier alone; `repeat` marks the closing verifier-alone run."""

    k: int
    window: int | None
    repeat: bool = False

    @property
    def label(self) -> str:
        if self.k == 0:
            return "verifier alone" + (" (again)" if self.repeat else "")
        return f"K {self.k}, window {self.window or 'off'}"


def plan_servers(engine: str, ks: list[int], windows: list[int]) -> tuple[list[ServerPoint], list[str]]:
    """Server starts in order (verifier alone first and last) and the notes to show."""
    notes = []
    if windows and engine in NO_WINDOW_ENGINES:
        notes.append(f"engine {engine}: no window points ({NO_WINDOW_ENGINES[engine]})")
        windows = []
    spec = [ServerPoint(k, w) for k in ks for w in [None, *windows]]
    return [ServerPoint(0, None), *spec, ServerPoint(0, None, repeat=True)], notes


def prompts_fingerprint(prompt_sets: dict[int, list[list[int]]]) -> str:
    blob = json.dumps({str(n): p for n, p in sorted(prompt_sets.items())}, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def estimate_seconds(engine: str, servers: int, tokens_per_server: int,
                     measured: dict | None = None) -> tuple[float, str]:
    """Rough wall time of `servers` starts that each decode up to `tokens_per_server` tokens
    (every prompt set x max new tokens): from a previous sweep's timings when there is one."""
    start_s, tok_s = ASSUMED.get(engine, ASSUMED["vllm"])
    how = f"assumed {start_s:.0f} s per server start, {tok_s:.0f} output tokens/s"
    if measured and measured.get("server_start_s") and measured.get("output_tokens_per_s"):
        start_s, tok_s = measured["server_start_s"], measured["output_tokens_per_s"]
        how = f"as the last sweep measured: {start_s:.0f} s per server start, {tok_s:.0f} output tokens/s"
    return servers * (start_s + tokens_per_server / tok_s), how


# ---- the saved file -----------------------------------------------------------------


def point_key(p: dict) -> tuple:
    return (p["k"], p["window"], p["context_length"], bool(p.get("repeat")))


def load_saved(path: Path, settings: dict) -> tuple[list[dict], str | None]:
    """Points a rerun keeps: those of a sweep with the same settings that completed without a failure.
    Returns (points, why the file was not resumed or None)."""
    if not path.is_file():
        return [], None
    try:
        data = json.loads(path.read_text())
        old, points = data["settings"], data["points"]
    except (OSError, ValueError, KeyError, TypeError):
        return [], f"{path} unreadable: starting over"
    if old != settings:
        changed = sorted(k for k in {*old, *settings} if old.get(k) != settings.get(k))
        return [], f"{path} was measured with other settings ({', '.join(changed)}): starting over"
    return [p for p in points if not p.get("failed") and not p.get("error") and p.get("completed")], None


def server_done(point: ServerPoint, saved: list[dict], context_lengths: list[int]) -> bool:
    have = {point_key(p) for p in saved}
    return all((point.k, point.window, n, point.repeat) in have for n in context_lengths)


# ---- the recommendation -----------------------------------------------------------------


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def baseline_spread(points: list[dict]) -> float | None:
    """Largest relative difference between the two verifier-alone runs over the prompt sets."""
    first = {p["context_length"]: p["output_throughput"] for p in points if p["k"] == 0 and not p.get("repeat")}
    again = {p["context_length"]: p["output_throughput"] for p in points if p["k"] == 0 and p.get("repeat")}
    diffs = [abs(first[n] - again[n]) / ((first[n] + again[n]) / 2) for n in first
             if n in again and first[n] and again[n]]
    return round(max(diffs), 4) if diffs else None


def baseline_throughput(points: list[dict]) -> dict[int, float]:
    """Verifier-alone output tokens/s per context length (mean of its runs)."""
    runs: dict[int, list[float]] = {}
    for p in points:
        if p["k"] == 0 and p.get("output_throughput"):
            runs.setdefault(p["context_length"], []).append(p["output_throughput"])
    return {n: _mean(v) for n, v in runs.items()}


def candidates(points: list[dict], context_lengths: list[int]) -> dict[tuple[int, int | None], dict]:
    """Per (K, window) measured on every prompt set without a failure: mean throughput and AL."""
    by: dict[tuple[int, int | None], dict[int, dict]] = {}
    for p in points:
        if p.get("repeat"):
            continue
        by.setdefault((p["k"], p["window"]), {})[p["context_length"]] = p
    out = {}
    for key, per_ctx in by.items():
        if set(per_ctx) != set(context_lengths):
            continue
        pts = list(per_ctx.values())
        if any(p.get("failed") or p.get("error") or not p.get("output_throughput") for p in pts):
            continue
        out[key] = {"throughput": _mean([p["output_throughput"] for p in pts]),
                    "acceptance_length": _mean([(p["acceptance_length"] or 1.0) if key[0] else 1.0 for p in pts])}
    return out


def recommend(points: list[dict], context_lengths: list[int], spread: float | None) -> dict[str, Any]:
    """The fastest (K, window) over the prompt sets (K 0 = no speculation can win); throughputs
    within the measured spread tie and go to the higher acceptance. Beside it, the choice by
    acceptance alone (speculative points only)."""
    cands = candidates(points, context_lengths)
    tol = spread or 0.0
    best = max((c["throughput"] for c in cands.values()), default=None)
    rec = by_al = None
    if best is not None:
        tied = [key for key, c in cands.items() if c["throughput"] >= best * (1 - tol)]
        rec = max(tied, key=lambda key: (cands[key]["acceptance_length"], cands[key]["throughput"]))
    spec = {key: c for key, c in cands.items() if key[0] > 0}
    if spec:
        by_al = max(spec, key=lambda key: (spec[key]["acceptance_length"], spec[key]["throughput"]))

    def shown(key):
        return None if key is None else {"k": key[0], "window": key[1]}

    return {"recommended": shown(rec), "recommended_by_acceptance": shown(by_al),
            "scores": [{"k": k, "window": w, "mean_output_throughput": round(c["throughput"], 3),
                        "mean_acceptance_length": round(c["acceptance_length"], 4)}
                       for (k, w), c in sorted(cands.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0))]}


# ---- the outputs ---------------------------------------------------------------------------


def _fmt(v: Any, nd: int = 2) -> str:
    return "—" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def markdown(result: dict) -> str:
    rec, by_al = result.get("recommended"), result.get("recommended_by_acceptance")

    def name(r):
        if r is None:
            return "none (no point completed on every prompt set)"
        return "no speculation (the verifier alone)" if r["k"] == 0 else f"K {r['k']}, window {r['window'] or 'off'}"

    lines = [f"# Served tune: {result['engine']} engine, concurrency {result['concurrency']}", "",
             f"Recommended by output throughput: **{name(rec)}**; by acceptance alone: {name(by_al)}.",
             (f"Spread (verifier alone, first vs last run): {_fmt(result.get('spread'), 4)}; throughputs within it "
             "tie and go to the higher acceptance."), ""]
    lines += [f"- {n}" for n in result.get("notes", [])]
    lines += ["", ("| K | window | context | AL | per-position | output tok/s | speedup | TTFT ms | TPOT ms "
              "| completed | failed |"), "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in result["points"]:
        per = ", ".join(f"{x:.2f}" for x in p.get("per_position_acceptance") or []) or "—"
        k = f"{p['k']}" + (" (again)" if p.get("repeat") else "")
        lines.append(f"| {k} | {p['window'] or 'off'} | {p['context_length'] or 'short'} | "
                     f"{_fmt(p.get('acceptance_length'), 3)} | {per} | {_fmt(p.get('output_throughput'), 1)} | "
                     f"{_fmt(p.get('speedup'), 2)} | {_fmt(p.get('ttft_ms'), 1)} | {_fmt(p.get('tpot_ms'), 1)} | "
                     f"{p.get('completed', 0)} | {p.get('failed', 0)} |")
    errors = [p for p in result["points"] if p.get("error")]
    if errors:
        lines += ["", "Failed points:", ""]
        lines += [f"- K {p['k']} window {p['window'] or 'off'} context {p['context_length']}: {p['error']}"
                  for p in errors]
    return "\n".join(lines) + "\n"


def write(path: Path, result: dict) -> None:
    """served_tune.json and served_tune.md, each written whole (temp file, then rename)."""
    atomic.write_text(path, json.dumps(result, indent=2) + "\n")
    atomic.write_text(path.with_suffix(".md"), markdown(result))
