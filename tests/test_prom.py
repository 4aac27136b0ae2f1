"""Prometheus parsing and spec-decode deltas (docs/CONCEPTS.md#acceptance-figures)."""

from __future__ import annotations

import json

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from dspark_kit.engines.prom import (
    MetricsError,
    parse_spec_counters,
    spec_decode_delta,
    sum_counter,
)
from dspark_kit.measure.vllm_bench import import_vllm_bench


@pytest.fixture(autouse=True)
def _created_series_on():
    """The local engine turns `_created` series off process-wide (like vLLM); these tests want them."""
    from prometheus_client import metrics

    before = metrics._use_created
    prometheus_client.enable_created_metrics()
    yield
    metrics._use_created = before


def _exposition(per_engine: dict[str, dict], model: str = "m") -> str:
    """Real prometheus_client output: typed counters with `_total` + `_created` samples."""
    reg = CollectorRegistry()
    labels = ["model_name", "engine"]
    drafts = Counter("vllm:spec_decode_num_drafts", "d", labels, registry=reg)
    tokens = Counter("vllm:spec_decode_num_draft_tokens", "t", labels, registry=reg)
    acc = Counter("vllm:spec_decode_num_accepted_tokens", "a", labels, registry=reg)
    per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "p", [*labels, "position"], registry=reg)
    for engine, c in per_engine.items():
        drafts.labels(model, engine).inc(c["drafts"])
        tokens.labels(model, engine).inc(c["tokens"])
        acc.labels(model, engine).inc(sum(c["per_pos"]))
        for pos, v in enumerate(c["per_pos"]):
            per_pos.labels(model, engine, str(pos)).inc(v)
    return generate_latest(reg).decode()


def test_sums_over_engines_and_ignores_created():
    text = _exposition({"0": {"drafts": 10, "tokens": 30, "per_pos": [6, 3, 1]},
                        "1": {"drafts": 5, "tokens": 15, "per_pos": [4, 2, 0]}})
    assert "_created" in text  # the parser must not add creation timestamps to counts
    c = parse_spec_counters(text)
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (15, 45, 16)
    assert c.accepted_per_pos == {0: 10, 1: 5, 2: 1}
    assert sum_counter(text, "vllm:spec_decode_num_drafts_total") == 15
    assert sum_counter(text, "vllm:spec_decode_num_drafts", by_label="engine") == {"0": 10, "1": 5}


def test_untyped_total_names_parse_like_typed_ones():
    untyped = (
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="a"} 4\n'
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="b"} 100\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="a",position="1"} 2\n'
    )
    c = parse_spec_counters(untyped, model_name="a")
    assert c.num_drafts == 4 and c.accepted_per_pos == {1: 2}
    assert parse_spec_counters(untyped).num_drafts == 104


def test_delta_formulas():
    before = _exposition({"0": {"drafts": 10, "tokens": 30, "per_pos": [5, 2, 1]}})
    after = _exposition({"0": {"drafts": 30, "tokens": 90, "per_pos": [17, 8, 3]}})
    d = spec_decode_delta(before, after)
    # deltas: drafts 20, draft tokens 60, accepted (12+6+2)=20, per pos [12, 6, 2]
    assert d["num_drafts"] == 20 and d["num_accepted_tokens"] == 20
    assert d["acceptance_length"] == pytest.approx(1 + 20 / 20)
    assert d["acceptance_rate"] == pytest.approx(20 / 60)
    assert d["per_position_acceptance"] == pytest.approx([0.6, 0.3, 0.1])
    # invariant (docs/CONCEPTS.md#acceptance-figures): sum of per-position rates + 1 = acceptance length
    assert sum(d["per_position_acceptance"]) + 1 == pytest.approx(d["acceptance_length"])


def test_restart_detected():
    before = _exposition({"0": {"drafts": 50, "tokens": 150, "per_pos": [20, 10, 5]}})
    after = _exposition({"0": {"drafts": 3, "tokens": 9, "per_pos": [1, 0, 0]}})
    with pytest.raises(MetricsError, match="restarted"):
        spec_decode_delta(before, after)


def test_no_spec_decode_or_no_drafts_gives_none():
    plain = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"
    assert spec_decode_delta(plain, plain) is None
    same = _exposition({"0": {"drafts": 3, "tokens": 9, "per_pos": [1, 0, 0]}})
    assert spec_decode_delta(same, same) is None


def test_garbage_is_a_clear_error():
    with pytest.raises(MetricsError, match="/metrics"):
        parse_spec_counters("this is { not prometheus")


def test_import_vllm_bench(tmp_path):
    raw = {
        "date": "20260720-062517", "backend": "openai-chat", "model_id": "qwen3", "num_prompts": 10,
        "max_concurrency": 10, "duration": 12.5, "completed": 10, "failed": 0,
        "total_input_tokens": 900, "total_output_tokens": 1200, "request_throughput": 0.8,
        "output_throughput": 95.6, "mean_ttft_ms": 300.0, "median_ttft_ms": 290.0, "p99_ttft_ms": 410.0,
        "mean_tpot_ms": 94.2, "median_tpot_ms": 93.0, "p99_tpot_ms": 120.0,
        "spec_decode_acceptance_rate": 12.72, "spec_decode_acceptance_length": 1.891,
        "spec_decode_num_drafts": 10832, "spec_decode_draft_tokens": 75824,
        "spec_decode_accepted_tokens": 9647,
        "spec_decode_per_position_acceptance_rates": [0.493, 0.227, 0.098],
    }
    p = tmp_path / "vllm.json"
    p.write_text(json.dumps(raw))
    r = import_vllm_bench(p)
    assert r["output_throughput"] == 95.6 and r["mean_tpot_ms"] == 94.2 and r["concurrency"] == 10
    s = r["spec_decode"]
    assert s["acceptance_rate"] == pytest.approx(0.1272)  # vLLM stores percent, we store a fraction
    assert s["num_drafts"] == 10832 and s["num_accepted_tokens"] == 9647
    assert s["per_position_acceptance"] == [0.493, 0.227, 0.098]
    p.write_text(json.dumps({"hello": 1}))
    with pytest.raises(MetricsError, match="output_throughput"):
        import_vllm_bench(p)


def _server_exposition(requests: int, prompt: int, gen: int, ttft: list[float], tpot: list[float]) -> str:
    """The series vLLM exports for throughput and latency (names as in vLLM 0.32)."""
    from prometheus_client import Histogram

    reg = CollectorRegistry()
    labels = ["model_name", "engine"]
    Counter("vllm:request_success", "r", [*labels, "finished_reason"], registry=reg).labels("m", "0", "stop").inc(requests)
    Counter("vllm:prompt_tokens", "p", labels, registry=reg).labels("m", "0").inc(prompt)
    Counter("vllm:generation_tokens", "g", labels, registry=reg).labels("m", "0").inc(gen)
    h_ttft = Histogram("vllm:time_to_first_token_seconds", "t", labels, registry=reg).labels("m", "0")
    h_tpot = Histogram("vllm:request_time_per_output_token_seconds", "t", labels, registry=reg).labels("m", "0")
    for v in ttft:
        h_ttft.observe(v)
    for v in tpot:
        h_tpot.observe(v)
    return generate_latest(reg).decode()


def test_server_delta_throughput_and_latency():
    from dspark_kit.engines.prom import server_delta

    before = _server_exposition(2, 10, 20, [0.5], [0.1])
    after = _server_exposition(6, 50, 120, [0.5, 0.1, 0.3], [0.1, 0.02, 0.04])
    d = server_delta(before, after, duration_s=4.0)
    assert (d["requests"], d["prompt_tokens"], d["generation_tokens"]) == (4, 40, 100)
    assert d["output_throughput"] == pytest.approx(25.0)
    assert d["mean_ttft_ms"] == pytest.approx(200.0) and d["mean_tpot_ms"] == pytest.approx(30.0)
    assert d["mean_itl_ms"] is None and d["mean_e2el_ms"] is None  # not exported here
    assert server_delta("", "", 1.0) is None  # a server with none of these series


def test_in_process_and_served_figures_are_one_type_with_one_name_each():
    """eval's aggregate (decoder counts) and bench's /metrics deltas write the same keys, same values."""
    from types import SimpleNamespace

    from dspark_kit.engines.prom import spec_decode_delta
    from dspark_kit.stages.evaluation.evaluate import aggregate

    req = SimpleNamespace(num_drafts=10, num_draft_tokens=30, num_accepted_tokens=9, accepted_per_pos=[6, 3, 0],
                          token_ids=[1] * 19)
    in_process = aggregate([req], 3)

    def scrape(d, t, a, pos):
        lines = [f"vllm:spec_decode_num_drafts_total {d}", f"vllm:spec_decode_num_draft_tokens_total {t}",
                 f"vllm:spec_decode_num_accepted_tokens_total {a}"]
        lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}} {v}' for i, v in enumerate(pos)]
        return "\n".join(lines) + "\n"

    served = spec_decode_delta(scrape(0, 0, 0, [0, 0, 0]), scrape(10, 30, 9, [6, 3, 0]))
    assert set(served) <= set(in_process)
    for key in served:
        assert in_process[key] == pytest.approx(served[key], abs=1e-4), key
    assert served["per_position_acceptance"] == pytest.approx([0.6, 0.3, 0.0])
