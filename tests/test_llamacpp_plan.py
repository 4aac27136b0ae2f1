"""serve.engine llama.cpp: llama-server's plan per role, and the GGUF export's refusals and round-trip check (fast).

The served behaviour (llama-server serving a kit draft, its counters against the kit's decoder) is
tests/test_llamacpp_real.py's."""

from __future__ import annotations

import pytest

from dspark_kit.engines.llamacpp import LlamaCppPlanError, LlamaCppServe, plan_llamacpp
from dspark_kit.recipe import ENGINES, load_recipe
from dspark_kit.specdec.gguf_export import (
    Expected,
    gguf_config,
    round_trip_problems,
    servable_problem,
)
from tests.plan_helpers import resolved

TINY = "recipes/tiny-cpu.yaml"


def _spec(**kw) -> LlamaCppServe:
    base = {"role": "spec", "verifier_gguf": "/m/T.gguf", "draft_gguf": "/m/D.gguf", "host": "127.0.0.1", "port": 8123,
            "served_name": "smol", "k": 3, "threads": 2, "ctx_size": 512, "seed": 7}
    return LlamaCppServe(**{**base, **kw})


def test_engine_is_listed():
    assert "llama.cpp" in ENGINES


def test_spec_plan_maps_k_conf_min_threads_context_and_slots():
    plan = plan_llamacpp(_spec(conf_min=0.4, parallel=2), check_built=False)
    a = plan.argv
    assert a[0].endswith("build/bin/llama-server")
    pairs = {a[i]: a[i + 1] for i in range(1, len(a) - 1) if a[i].startswith("-")}
    assert pairs["-m"] == "/m/T.gguf" and pairs["-md"] == "/m/D.gguf"
    assert pairs["--spec-type"] == "draft-dspark" and pairs["--spec-draft-n-max"] == "3"
    assert pairs["--spec-draft-p-min"] == "0.4"
    assert pairs["-t"] == "2" and pairs["-td"] == "2" and pairs["-c"] == "512" and pairs["-np"] == "2"
    assert "--jinja" in a and pairs["--port"] == "8123" and pairs["--seed"] == "7"
    assert plan.notes == [] and plan.health_path == "/health"


def test_no_conf_min_without_adaptive_and_the_window_is_one_note():
    plan = plan_llamacpp(_spec(window=256, window_source="serve.draft_window_size"), check_built=False)
    assert "--spec-draft-p-min" not in plan.argv
    assert len(plan.notes) == 1 and "no draft window" in plan.notes[0] and "256" in plan.notes[0]
    assert "serve.draft_window_size" in plan.notes[0]


def test_chat_plan_has_no_draft_and_hidden_states_is_refused():
    chat = plan_llamacpp(_spec(role="chat", draft_gguf=None, k=None), check_built=False)
    assert "-md" not in chat.argv and "--spec-type" not in chat.argv and chat.argv[2] == "/m/T.gguf"
    with pytest.raises(LlamaCppPlanError, match="roles chat and spec"):
        plan_llamacpp(_spec(role="hidden-states"), check_built=False)


def test_planned_from_a_recipe_k_and_adaptive():
    from dspark_kit.stages.server_plan import server_plan

    r = load_recipe(TINY, ["serve.num_speculative_tokens=2", "serve.adaptive_verification=on",
                           "eval.confidence_threshold=0.3", "serve.draft_window_size=off"])
    plan = server_plan(resolved(r, engine="llama.cpp"), "spec", port=9000)
    a = plan.argv
    assert a[a.index("--spec-draft-n-max") + 1] == "2" and a[a.index("--spec-draft-p-min") + 1] == "0.3"
    assert a[a.index("-md") + 1].endswith("serve/gguf-checkpoint_best/draft.gguf")
    assert plan.notes == []  # the window was switched off: no note


def test_either_draft_arch_is_planned_before_training():
    """speculators' DSpark layers are Qwen3's for draft.arch qwen3 and llama alike, and llama.cpp's
    converter writes the same GGUF for both (tests/test_llamacpp_real.py): neither is refused."""
    from dspark_kit.stages.server_plan import server_plan

    for arch in ("qwen3", "llama"):
        plan = server_plan(resolved(load_recipe(TINY, [f"draft.arch={arch}"]), engine="llama.cpp"), "spec", port=9000)
        assert plan.argv[0].endswith("llama-server"), arch


def test_chat_role_needs_a_gguf_verifier():
    from dspark_kit.stages.server_plan import server_plan

    with pytest.raises(LlamaCppPlanError, match="verifier.path"):
        server_plan(resolved(load_recipe(TINY), engine="llama.cpp"), "chat", port=9000)


SPEC_CFG = {"speculators_model_type": "dspark", "block_size": 4, "mask_token_id": 16,
            "aux_hidden_state_layer_ids": [16], "markov_rank": 32, "markov_head_type": "vanilla",
            "sample_from_anchor": True, "draft_vocab_size": 49152,
            "transformer_layer_config": {"model_type": "qwen3", "vocab_size": 49152}}


def test_a_servable_draft_passes():
    assert servable_problem(SPEC_CFG, "export X") is None
    llama = {**SPEC_CFG, "transformer_layer_config": {"model_type": "llama", "vocab_size": 49152}}
    assert servable_problem(llama, "export X") is None  # draft.arch llama: the same Qwen3 layers


@pytest.mark.parametrize("change, key", [
    ({"transformer_layer_config": {"model_type": "gemma3", "vocab_size": 49152}}, "transformer_layer_config.model_type"),
    ({"markov_head_type": "gated"}, "markov_head_type"),
    ({"block_size": None}, "block_size"),
    ({"draft_vocab_size": 60000}, "draft_vocab_size"),
    ({"speculators_model_type": "eagle3"}, "speculators_model_type"),
])
def test_a_draft_llamacpp_cannot_serve_is_one_line_naming_the_key(change, key):
    why = servable_problem({**SPEC_CFG, **change}, "export X")
    assert why is not None and key in why and "\n" not in why


def test_sample_from_anchor_is_written_explicitly():
    cfg = {k: v for k, v in SPEC_CFG.items() if k != "sample_from_anchor"}
    cfg["dspark_kit_import"] = {"anchor": {"value": True, "source": "measured"}}
    assert gguf_config(cfg)["sample_from_anchor"] is True  # the converter would read a missing key as false
    cfg.pop("dspark_kit_import")
    assert "sample_from_anchor" in servable_problem(cfg, "export X")  # unknown: refused, not guessed


def test_round_trip_names_each_value_that_differs():
    want = Expected(4, 16, [16], True, 32, True)
    got = {"block_size": 4, "mask_token_id": 16, "target_layers": [16], "sample_from_anchor": True,
           "has_confidence_head": True, "markov_rank": 32}
    assert round_trip_problems(got, want) == []
    bad = round_trip_problems({**got, "sample_from_anchor": False, "block_size": 16}, want)
    assert len(bad) == 2 and bad[0].startswith("block_size: gguf 16") and "sample_from_anchor" in bad[1]


LLAMACPP_METRICS = """# HELP llamacpp:spec_decode_num_draft_tokens_total Speculative: Total draft tokens generated
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total {dt}
# HELP llamacpp:spec_decode_num_accepted_tokens_total Speculative: Total draft tokens accepted by the target model
# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter
llamacpp:spec_decode_num_accepted_tokens_total {acc}
# HELP llamacpp:spec_decode_num_drafts_total Speculative: Total speculative decoding verification steps
# TYPE llamacpp:spec_decode_num_drafts_total counter
llamacpp:spec_decode_num_drafts_total {n}
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total {gen}
"""


def test_llamacpp_counters_read_as_the_spec_decode_delta():
    """llama-server's own /metrics text (names as tools/server/server-task.cpp writes them)."""
    from dspark_kit.engines.prom import server_delta, spec_decode_delta

    before = LLAMACPP_METRICS.format(dt=0, acc=0, n=0, gen=0)
    after = LLAMACPP_METRICS.format(dt=208, acc=10, n=52, gen=62)
    d = spec_decode_delta(before, after)
    assert d["num_drafts"] == 52 and d["num_accepted_tokens"] == 10
    assert abs(d["acceptance_length"] - (1 + 10 / 52)) < 1e-9
    assert server_delta(before, after, 2.0)["generation_tokens"] == 62


def test_a_failed_build_fails_the_llamacpp_tests_in_one_line(tmp_path):
    from tests.llamacpp_build import llama_server

    marker = tmp_path / "failed"
    marker.write_text("make llama-cpp failed\n")
    with pytest.raises(pytest.fail.Exception, match="llama.cpp build: make llama-cpp failed"):
        llama_server(marker, building=tmp_path / "no-background-build")


def test_slots_follow_the_client_and_share_the_context():
    from dspark_kit.stages.server_plan import server_plan

    r = load_recipe(TINY, ["bench.concurrency=3", "serve.max_model_len=512", "serve.cpu_threads=1"])
    a = server_plan(resolved(r, engine="llama.cpp"), "spec", port=9000).argv
    assert a[a.index("-np") + 1] == "3" and a[a.index("-c") + 1] == str(3 * 512)
    assert a[a.index("-t") + 1] == "1" and a[a.index("-td") + 1] == "1"


def test_the_gate_compares_accepted_tokens_per_step_not_the_floored_length():
    from dspark_kit.measure.llamacpp_accept import gate_line

    assert gate_line(1.148, 1.142, 0.7, "trained") is None
    line = gate_line(1.0, 1.142, 0.7, "zero_markov")  # AL 1.0 is 0.88x of 1.142, yet nothing is accepted
    assert line is not None and "0.00x" in line and "\n" not in line
    assert "no speculative steps" in gate_line(None, 1.142, 0.7, "x")
