"""The served-acceptance gate: what the server accepts, beside what the in-process eval measured.

A draft that evaluates well and accepts almost nothing once served is the field's most common
complaint; its causes are contract mismatches (anchor layout, layer ids, K, the window, a
checkpoint that changed). After `bench`, `run` puts the server's acceptance length (from
/metrics) beside eval's (eval.json) for the same checkpoint and K. Below
`bench.min_served_fraction` of eval's, the bench stage fails and prints every contract check
that could explain the gap.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# what an eval recorded about its checkpoint, compared when a served figure falls short
IDENTITY_KEYS = ("aux_hidden_state_layer_ids", "block_size", "mask_token_id", "sample_from_anchor",
                 "draft_vocab_size", "enable_confidence_head")


class ServedGateError(RuntimeError):
    """Served acceptance far below in-process: the headline, then the diagnosis (one item a line)."""


@dataclass(frozen=True)
class Served:
    """What the bench served, as its stage decided it: what the diagnosis holds eval's record against."""

    checkpoint: Path
    window: int | None
    window_source: str
    findings: tuple[str, ...] = ()  # the checkpoint's findings, one line each ("<level> <code>: <message>")
    engine_gate: str | None = None  # a vLLM engine's verdict on the checkpoint's layout; None: the local engine


def checkpoint_identity(ckpt: Path) -> dict[str, Any]:
    """The config keys the served layout depends on, and the weights' sha256: eval records it, the
    gate compares it with the checkpoint the server loaded."""
    cfg = json.loads((ckpt / "config.json").read_text())
    digest = hashlib.sha256()
    with (ckpt / "model.safetensors").open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return {"config": {k: cfg.get(k) for k in IDENTITY_KEYS}, "weights_sha256": digest.hexdigest()}


def compare(bench: dict, ev: dict | None, minimum: float | None) -> dict[str, Any]:
    """Served vs in-process acceptance length; `comparable` only for the same checkpoint and K."""
    served = (bench.get("spec_decode") or {}).get("acceptance_length")
    out: dict[str, Any] = {"served_acceptance_length": served, "minimum_fraction": minimum,
                           "in_process_acceptance_length": None, "fraction": None, "comparable": False}
    if ev is None:
        return out | {"why_not": "no in-process eval (eval.json) in this run"}
    out["in_process_acceptance_length"] = base = ev.get("acceptance_length")
    if served is None or not base:
        return out | {"why_not": "no served acceptance (no spec-decode metrics)" if served is None
                      else "no in-process acceptance"}
    out["fraction"] = round(served / base, 3)
    k_served, k_eval = bench.get("num_speculative_tokens"), ev.get("num_speculative_tokens")
    if k_served is not None and k_served != k_eval:
        return out | {"why_not": f"served K {k_served} != eval K {k_eval}: different measurements"}
    t_served, t_eval = bench.get("temperature") or 0.0, ev.get("temperature") or 0.0  # unrecorded: greedy
    if t_served != t_eval:
        return out | {"why_not": f"served at temperature {t_served}, eval at {t_eval}: different measurements"}
    return out | {"comparable": True, "passed": minimum is None or out["fraction"] >= minimum}


def diagnose(served: Served, bench: dict, ev: dict) -> list[str]:
    """Every contract check that could explain a served figure far below eval's (empty: none fired)."""
    lines: list[str] = []
    then = ev.get("checkpoint_identity") or {}
    try:
        now = checkpoint_identity(served.checkpoint)
    except OSError as e:
        now = {}
        lines.append(f"the served checkpoint {served.checkpoint} cannot be read ({e})")
    changed = [f"{k} {then['config'].get(k)!r} at eval, {now['config'].get(k)!r} served"
               for k in IDENTITY_KEYS if then.get("config") and now and then["config"].get(k) != now["config"].get(k)]
    if changed:
        lines.append("checkpoint config changed since eval: " + "; ".join(changed))
    if then.get("weights_sha256") and now and then["weights_sha256"] != now.get("weights_sha256"):
        lines.append("checkpoint weights changed since eval (model.safetensors sha256 differs): rerun eval")
    if ev.get("checkpoint") and ev["checkpoint"] != str(served.checkpoint):
        lines.append(f"eval measured {ev['checkpoint']}, the server loaded {served.checkpoint}")
    if ev.get("draft_window_size") != served.window:
        lines.append(f"draft window: eval {ev.get('draft_window_size')}, served {served.window} ({served.window_source})")
    lines += [f"checkpoint {f}" for f in served.findings]
    if served.engine_gate is not None:
        lines.append(served.engine_gate)
        lines.append("vLLM's own loader: `dspark-kit contract` loads the checkpoint as the server does")
    if bench.get("num_prompts") != (ev.get("prompts") or {}).get("count", bench.get("num_prompts")):
        lines.append(f"prompts: bench sent {bench.get('num_prompts')}, eval measured "
                     f"{(ev.get('prompts') or {}).get('count')} (bench.num_prompts vs eval.num_prompts)")
    return lines


def enforce(bench: dict, eval_json: Path, minimum: float | None, served: Callable[[], Served]) -> dict[str, Any]:
    """The comparison for the bench result (`eval_json`: the run's eval.json; `minimum`:
    bench.min_served_fraction); raises ServedGateError below it, with the diagnosis against
    `served()` (asked only then: it reads the checkpoint)."""
    ev = json.loads(eval_json.read_text()) if eval_json.is_file() else None
    verdict = compare(bench, ev, minimum)
    if verdict.get("comparable") and not verdict.get("passed"):
        why = diagnose(served(), bench, ev) or ["no contract check fired: compare eval.md with the bench report"]
        raise ServedGateError(
            f"served acceptance length {verdict['served_acceptance_length']:.3f} is "
            f"{verdict['fraction']:.2f}x the in-process eval's {verdict['in_process_acceptance_length']:.3f} "
            f"(bench.min_served_fraction {verdict['minimum_fraction']}); what could explain it:\n"
            + "\n".join(f"  - {line}" for line in why))
    return verdict


def side_by_side(verdict: dict) -> str:
    """One line for the console and the report."""
    served, base = verdict.get("served_acceptance_length"), verdict.get("in_process_acceptance_length")
    if served is None or base is None:
        return f"served vs in-process: not compared ({verdict.get('why_not', 'missing figures')})"
    tail = "" if verdict.get("comparable") else f" (not gated: {verdict.get('why_not')})"
    return (f"acceptance length served {served:.3f} vs in-process {base:.3f} "
            f"({verdict['fraction']:.2f}x, gate {verdict.get('minimum_fraction')}){tail}")
