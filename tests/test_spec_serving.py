"""Issue 5 integration: local spec server on the trained tiny draft + `dspark-kit bench` against it."""

import itertools

import httpx
import pytest

from dspark_kit.engines.ports import free_port
from dspark_kit.engines.prom import spec_decode_delta
from dspark_kit.resolved import Resolved
from dspark_kit.stages.server_plan import running_server

pytestmark = pytest.mark.slow


def test_metrics_deltas_equal_the_engines_own_count(own_trained_run, tiny_recipe):
    trained_run = own_trained_run  # bench writes bench/ into it
    from dspark_kit.stages.serving.bench import bench_endpoint

    res = Resolved(tiny_recipe, trained_run)
    with running_server(res, "spec", port=free_port()) as url:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        before = httpx.get(f"{url}/metrics").text
        own = {"num_drafts": 0, "num_accepted_tokens": 0, "num_draft_tokens": 0}
        for prompt in ["Count from 3 to 11.", "Repeat after me: the red fox sees the moon.", "Sort these words alphabetically: tree, apple"]:
            body = httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
                "model": model, "max_tokens": 24, "temperature": 0,
                "messages": [{"role": "user", "content": prompt}]}).json()
            for k in own:
                own[k] += body["spec_decode"][k]
        delta = spec_decode_delta(before, httpx.get(f"{url}/metrics").text)
        assert own["num_drafts"] > 0
        assert delta["num_drafts"] == own["num_drafts"]
        assert delta["num_accepted_tokens"] == own["num_accepted_tokens"]
        assert delta["acceptance_length"] == pytest.approx(1 + own["num_accepted_tokens"] / own["num_drafts"])

        result = bench_endpoint(res, url, label="tiny-spec", out_dir=trained_run / "bench", num_prompts=4,
                           concurrency=2, max_tokens=24)
    spec = result["spec_decode"]
    rates = spec["per_position_acceptance"]
    # the K the server ran (auto: the checkpoint's trained slots), read back from its /metrics
    assert len(rates) == res.k.value == res.trained_slots == tiny_recipe.draft.block_size
    assert result["num_speculative_tokens"] == res.k.value and "/metrics" in result["num_speculative_tokens_source"]
    assert all(a >= b for a, b in itertools.pairwise(rates))  # a later slot is accepted only after the earlier ones
    assert 1 + sum(rates) == pytest.approx(spec["acceptance_length"])
    assert (trained_run / "bench" / "bench_tiny-spec.json").exists()
