"""Prometheus metrics with vLLM's names: what our local engine exports, and what bench reads.

vLLM (and our local engine, `EngineMetrics`) export monotonically increasing
counters; a benchmark scrapes before and after and turns the deltas into
acceptance length, acceptance rate and per-position rates
(docs/CONCEPTS.md#acceptance-figures). Every metric name is typed once, here.
The JSON `vllm bench serve --save-result` writes is read elsewhere (measure/vllm_bench.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from dspark_kit.specdec.acceptance import acceptance

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
SPEC_COUNTERS = (DRAFTS, DRAFT_TOKENS, ACCEPTED, ACCEPTED_PER_POS)
PROMPT_TOKENS = "vllm:prompt_tokens"
GENERATION_TOKENS = "vllm:generation_tokens"
REQUESTS_RUNNING = "vllm:num_requests_running"
REQUEST_SUCCESS = "vllm:request_success"
# llama-server's /metrics (`--metrics`; tools/server/server-task.cpp) counts the same things under its own
# prefix: read as vLLM's names, so bench and the served gate read llama.cpp's counters unchanged
LLAMACPP_NAMES = {"llamacpp:spec_decode_num_drafts": DRAFTS, "llamacpp:spec_decode_num_draft_tokens": DRAFT_TOKENS,
                  "llamacpp:spec_decode_num_accepted_tokens": ACCEPTED,
                  "llamacpp:spec_decode_num_accepted_tokens_per_pos": ACCEPTED_PER_POS,
                  "llamacpp:prompt_tokens": PROMPT_TOKENS, "llamacpp:tokens_predicted": GENERATION_TOKENS}


class EngineMetrics:
    """What the local engine exports at /metrics, under vLLM's names, so bench reads either engine."""

    def __init__(self, model_name: str, spec: bool):
        from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics

        disable_created_metrics()  # vLLM exposes no *_created series either
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "engine": "0"}
        names = list(labels)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()):
            return Counter(name, doc, [*names, *extra], registry=self.registry)

        self.prompt = counter(PROMPT_TOKENS, "Prefill tokens processed.").labels(**labels)
        self.generation = counter(GENERATION_TOKENS, "Tokens generated.").labels(**labels)
        self.running = Gauge(REQUESTS_RUNNING, "Requests in flight.", names, registry=self.registry).labels(**labels)
        self.spec = spec
        if spec:
            self.drafts = counter(DRAFTS, "Draft proposals.").labels(**labels)
            self.draft_tokens = counter(DRAFT_TOKENS, "Drafted tokens.").labels(**labels)
            self.accepted = counter(ACCEPTED, "Accepted tokens.").labels(**labels)
            self._per_pos = counter(ACCEPTED_PER_POS, "Accepted tokens per draft position.", ("position",))
            self._labels = labels

    def observe(self, prompt_tokens: int, res) -> None:
        """One finished request: `res` is a specdec.decoder.GenerationResult."""
        self.prompt.inc(prompt_tokens)
        self.generation.inc(len(res.token_ids))
        if self.spec:
            self.drafts.inc(res.num_drafts)
            self.draft_tokens.inc(res.num_draft_tokens)
            self.accepted.inc(res.num_accepted_tokens)
            for pos, n in enumerate(res.accepted_per_pos):
                self._per_pos.labels(**self._labels, position=str(pos)).inc(n)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class MetricsError(ValueError):
    """Scrapes that cannot be compared (one line: what happened and what to do)."""


@dataclass
class SpecCounters:
    """Spec-decode counters of one scrape, summed over engines (and models)."""

    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    accepted_per_pos: dict[int, float] = field(default_factory=dict)
    found: bool = False  # any spec-decode counter present at all


def _base_name(sample_name: str) -> str | None:
    """Counter name without `_total`; None for `_created` timestamps.

    prometheus_client strips `_total` from a typed counter's family name but
    keeps it on samples; untyped exports keep it everywhere. Samples are
    normalised so both forms match.
    """
    if sample_name.endswith("_created"):
        return None
    return sample_name.removesuffix("_total")


def iter_samples(text: str):
    """(base name, labels, value) for every sample in a text exposition."""
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError) as e:  # the parser has no error type of its own
        raise MetricsError(f"/metrics: not Prometheus text exposition ({e})") from None
    for fam in families:
        for s in fam.samples:
            name = _base_name(s.name)
            if name is not None:
                yield LLAMACPP_NAMES.get(name, name), s.labels, s.value


def sum_counter(text: str, name: str, model_name: str | None = None,
                by_label: str | None = None) -> float | dict[str, float]:
    """Sum a counter over label sets; `by_label` keeps one sum per value of that label."""
    base = name.removesuffix("_total")
    total = 0.0
    grouped: dict[str, float] = {}
    for sample, labels, value in iter_samples(text):
        if sample != base:
            continue
        if model_name is not None and labels.get("model_name", model_name) != model_name:
            continue
        if by_label is None:
            total += value
        elif by_label in labels:
            grouped[labels[by_label]] = grouped.get(labels[by_label], 0.0) + value
    return total if by_label is None else grouped


def parse_spec_counters(text: str, model_name: str | None = None) -> SpecCounters:
    c = SpecCounters()
    for sample, labels, value in iter_samples(text):
        if sample not in SPEC_COUNTERS:
            continue
        if model_name is not None and labels.get("model_name", model_name) != model_name:
            continue
        c.found = True
        if sample == DRAFTS:
            c.num_drafts += value
        elif sample == DRAFT_TOKENS:
            c.num_draft_tokens += value
        elif sample == ACCEPTED:
            c.num_accepted_tokens += value
        elif "position" in labels:
            pos = int(labels["position"])
            c.accepted_per_pos[pos] = c.accepted_per_pos.get(pos, 0.0) + value
    return c


def spec_decode_delta(before: str, after: str, model_name: str | None = None) -> dict[str, Any] | None:
    """Acceptance over the window between two scrapes; None when the server has no drafts.

    Raises MetricsError when a counter went down (the server restarted between
    the scrapes, so the deltas would be meaningless).
    """
    b = parse_spec_counters(before, model_name)
    a = parse_spec_counters(after, model_name)
    if not a.found:
        return None
    pairs = {
        "num_drafts": (b.num_drafts, a.num_drafts),
        "num_draft_tokens": (b.num_draft_tokens, a.num_draft_tokens),
        "num_accepted_tokens": (b.num_accepted_tokens, a.num_accepted_tokens),
    }
    positions = sorted(set(b.accepted_per_pos) | set(a.accepted_per_pos))
    for p in positions:
        pairs[f"accepted_per_pos[{p}]"] = (b.accepted_per_pos.get(p, 0.0), a.accepted_per_pos.get(p, 0.0))
    dropped = [k for k, (x, y) in pairs.items() if y < x]
    if dropped:
        raise MetricsError(
            f"/metrics: counters decreased ({', '.join(dropped)}): the server restarted during "
            "the benchmark; rerun the benchmark against a server that stays up"
        )
    d = {k: y - x for k, (x, y) in pairs.items()}
    if d["num_drafts"] <= 0:
        return None
    per_pos = [d[f"accepted_per_pos[{p}]"] for p in positions]
    return acceptance(d["num_drafts"], d["num_draft_tokens"], d["num_accepted_tokens"], per_pos).as_dict()


# ---- the server's own throughput and latency ---------------------------------

# vLLM's request counters and latency histograms (per engine; summed here). TPOT is the
# per-request mean (vllm:request_time_per_output_token_seconds, vLLM 0.11+; older builds:
# time_per_output_token_seconds), as bench computes it; ITL is per token gap.
SERVER_COUNTERS = {"requests": REQUEST_SUCCESS, "prompt_tokens": PROMPT_TOKENS, "generation_tokens": GENERATION_TOKENS}
SERVER_HISTOGRAMS = {"ttft": ("vllm:time_to_first_token_seconds",),
                     "tpot": ("vllm:request_time_per_output_token_seconds", "vllm:time_per_output_token_seconds"),
                     "itl": ("vllm:inter_token_latency_seconds",),
                     "e2el": ("vllm:e2e_request_latency_seconds",)}


def _present(text: str) -> set[str]:
    return {name for name, _, _ in iter_samples(text)}


def server_delta(before: str, after: str, duration_s: float,
                 model_name: str | None = None) -> dict[str, Any] | None:
    """Throughput and mean latencies from the server's own counters over a run.

    None when the server exports none of them. Keys: requests, prompt_tokens,
    generation_tokens, output_throughput (generation tokens / duration_s) and
    mean_{ttft,tpot,itl,e2el}_ms from histogram _sum/_count deltas (None when absent).
    """
    names = _present(after)
    out: dict[str, Any] = {}
    for key, name in SERVER_COUNTERS.items():
        if name in names:
            out[key] = int(sum_counter(after, name, model_name) - sum_counter(before, name, model_name))
        else:
            out[key] = None
    for key, candidates in SERVER_HISTOGRAMS.items():
        name = next((c for c in candidates if c + "_count" in names), None)
        out[f"mean_{key}_ms"] = None
        if name is not None:
            count = sum_counter(after, name + "_count", model_name) - sum_counter(before, name + "_count", model_name)
            total = sum_counter(after, name + "_sum", model_name) - sum_counter(before, name + "_sum", model_name)
            out[f"mean_{key}_ms"] = total / count * 1000.0 if count > 0 else None
    if all(v is None for v in out.values()):
        return None
    gen = out["generation_tokens"]
    out["output_throughput"] = gen / duration_s if gen is not None and duration_s > 0 else None
    return out
