"""A `vllm bench serve --save-result` JSON, read into the kit's bench result schema (what the report
and `bench --compare` show beside the kit's own results)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dspark_kit.engines.prom import MetricsError
from dspark_kit.specdec.acceptance import Acceptance

_VLLM_LATENCY_KEYS = [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
                      for s in ("mean", "median", "p99")]


def read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise MetricsError(f"{path}: cannot read {what} JSON ({e})") from None


def import_vllm_bench(path: str | Path, raw: Any = None) -> dict[str, Any]:
    """Read a `vllm bench serve --save-result` JSON (or its parsed `raw`) into our bench result schema."""
    path = Path(path)
    raw = read_json(path, "vLLM bench") if raw is None else raw
    if not isinstance(raw, dict) or "output_throughput" not in raw:
        raise MetricsError(f"{path}: no output_throughput key; expected `vllm bench serve --save-result` output")
    spec = None
    if raw.get("spec_decode_num_drafts") is not None:
        drafts = raw["spec_decode_num_drafts"]
        rate_pct = raw.get("spec_decode_acceptance_rate")  # vLLM stores a percentage
        draft_tokens = int(raw.get("spec_decode_draft_tokens") or 0)
        spec = Acceptance(  # vLLM's own figures: it saves per-position rates, not their counts
            num_drafts=int(drafts), num_draft_tokens=draft_tokens,
            num_accepted_tokens=int(raw.get("spec_decode_accepted_tokens") or 0), accepted_per_pos=[],
            acceptance_length=raw.get("spec_decode_acceptance_length"),
            acceptance_rate=rate_pct / 100.0 if rate_pct is not None else None,
            mean_verified_per_step=draft_tokens / drafts if drafts else None,
            per_position_acceptance=list(raw.get("spec_decode_per_position_acceptance_rates") or []),
        ).as_dict()
    result: dict[str, Any] = {
        "schema": "dspark-kit.bench/1",
        "source": "vllm-bench-serve",
        "source_file": str(path),
        "label": raw.get("label") or path.stem,
        "model": raw.get("model_id"),
        "date": raw.get("date"),
        "num_prompts": raw.get("num_prompts"),
        "concurrency": raw.get("max_concurrency"),
        "completed": raw.get("completed"),
        "failed": raw.get("failed"),
        "duration_s": raw.get("duration"),
        "total_input_tokens": raw.get("total_input_tokens"),
        "total_output_tokens": raw.get("total_output_tokens"),
        "request_throughput": raw.get("request_throughput"),
        "output_throughput": raw.get("output_throughput"),
        "streamed": True,
        "spec_decode": spec,
    }
    for k in _VLLM_LATENCY_KEYS:
        result[k] = raw.get(k)
    return result
