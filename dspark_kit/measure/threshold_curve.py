"""What the confidence head buys: acceptance and tokens per second against the confidence threshold.

A point measures one threshold (None: the fixed K, no cut) on any engine through a `PointMeasure`:
the in-process reference decoder (stages.evaluation.window_tune passes EvalSession.measure), or a
served engine that cuts draft blocks by confidence (llama.cpp's `--spec-draft-conf-min P` cuts at
the first slot whose own confidence is below P; the kit's decoder cuts once the product of the
slots' confidences falls below it, as vLLM's adaptive verification does; a served measure says
which rule it applied in `rule`). The recommended threshold is read off the measured curve: the
highest tokens per second, a tie (within `tolerance` of the best) going to the higher acceptance
length. Plain values only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

THRESHOLDS: tuple[float | None, ...] = (None, 0.1, 0.3, 0.5, 0.7, 0.9)
PRODUCT_RULE = "cut once the product of the slots' confidences is below the threshold"

# threshold -> {"acceptance_length", "tokens_per_s", "mean_verified_per_step", ...}
PointMeasure = Callable[[float | None], dict]


def point(m: dict) -> dict:
    """The figures a curve keeps from one measure (EvalSession.measure's dict, or a served one)."""
    tps = m.get("tokens_per_s")
    if tps is None and m.get("wall_s"):
        tps = m["output_tokens"] / m["wall_s"]
    return {"acceptance_length": m.get("acceptance_length"), "tokens_per_s": None if tps is None else round(tps, 3),
            "mean_verified_per_step": m.get("mean_verified_per_step"),
            "tokens_per_verifier_forward": m.get("tokens_per_verifier_forward")}


def recommend(points: Sequence[dict], tolerance: float = 0.02) -> float | None:
    """The threshold of the fastest point; points within `tolerance` (relative) of it: the one with the
    higher acceptance length. None: the fixed K (no threshold) measured best."""
    timed = [p for p in points if p.get("tokens_per_s")]
    if not timed:
        return None
    best = max(p["tokens_per_s"] for p in timed)
    near = [p for p in timed if p["tokens_per_s"] >= best * (1 - tolerance)]
    return max(near, key=lambda p: (p.get("acceptance_length") or 0.0, p["tokens_per_s"]))["threshold"]


def threshold_curve(measure: PointMeasure, thresholds: Sequence[float | None] = THRESHOLDS, engine: str = "local",
                    rule: str = PRODUCT_RULE, tolerance: float = 0.02) -> dict:
    points = [{"threshold": t, **point(measure(t))} for t in thresholds]
    return {"engine": engine, "rule": rule, "points": points, "tolerance": tolerance,
            "recommended_threshold": recommend(points, tolerance)}


def curve_markdown(curve: dict | None) -> list[str]:
    if not curve:
        return []
    rec = curve["recommended_threshold"]
    out = ["", f"## Confidence threshold curve ({curve['engine']} engine)", "",
           f"Rule: {curve['rule']}. Recommended: "
           + ("none (the fixed K was fastest)" if rec is None else f"{rec:g}") + " (highest tokens/s).", "",
           "| threshold | acceptance length | tokens/s | draft tokens verified / step |", "|---|---|---|---|"]
    for p in curve["points"]:
        t = "off (fixed K)" if p["threshold"] is None else f"{p['threshold']:g}"
        out.append(f"| {t} | {p['acceptance_length']} | {p['tokens_per_s']} | {p['mean_verified_per_step']} |")
    return out
