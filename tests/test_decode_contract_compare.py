"""engines.vllm_decode_contract.compare on hand-made traces: the first stage that differs is the one
finding, with the prompt, step, slot, both tokens and both top-5 (no vLLM, no model)."""

from __future__ import annotations

import torch

from dspark_kit.engines.vllm_decode_contract import DECODE_TOLERANCE, Layout, Trace, compare

K, V = 3, 12
TOL = DECODE_TOLERANCE["float32"]


def step(ctx_len: int, anchor: int, tokens: list[int], accepted: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(K, V, generator=g)
    for i, t in enumerate(tokens):
        logits[i, t] = 10.0
    return {"context_len": ctx_len, "anchor": anchor, "tokens": tokens, "accepted": accepted,
            "input_ids": [anchor, 5, 5], "context": torch.randn(ctx_len, 4, generator=g),
            "context_k": torch.randn(2, ctx_len, 1, 4, generator=g), "base": logits - 1, "logits": logits,
            "confidence": [0.5, 0.4, 0.3]}


def clone(s: dict) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else list(v) if isinstance(v, list) else v) for k, v in s.items()}


def traces():
    steps = [step(5, 7, [1, 2, 3], 3, 0), step(9, 4, [8, 9, 10], 1, 1)]
    tokens = [7, 1, 2, 3, 4, 8, 9]
    vllm = {"decode": [{"tokens": tokens, "steps": [clone(s) for s in steps]}]}
    return vllm, [Trace(list(tokens), [clone(s) for s in steps])]


LAYOUT = {"vllm": "0.32.0", "sample_from_anchor": True, "num_query_per_req": K}
KIT = Layout(sample_from_anchor=True, num_query_per_req=K)


def test_equal_traces_hold_with_figures():
    vllm, kit = traces()
    r = compare(LAYOUT, vllm, kit, KIT, TOL)
    assert r["finding"] is None and r["tokens_equal"] and r["blocks_equal"] and r["acceptance_equal"]
    assert r["prompts"][0]["blocks"] == r["prompts"][0]["blocks_equal"] == 2
    assert r["acceptance_length"]["vllm"] == r["acceptance_length"]["kit"] == (3 + 1 + 2) / 2


def test_markov_difference_is_one_line_with_slot_tokens_and_top5():
    vllm, kit = traces()
    s = vllm["decode"][0]["steps"][1]
    s["logits"][2, 10], s["logits"][2, 11] = 0.0, 11.0  # the base logits agree: the Markov bias differs
    s["tokens"][2] = 11
    r = compare(LAYOUT, vllm, kit, KIT, TOL)
    f = r["finding"]
    assert f.code == "decode-markov" and "\n" not in f.message
    assert "prompt 0 step 1" in f.message and "slot 2: vLLM 11" in f.message and "kit 10" in f.message
    d = r["first_divergence"]
    assert (d["slot"], d["vllm_token"], d["kit_token"]) == (2, 11, 10)
    assert d["vllm_top5"][0] == 11 and d["kit_top5"][0] == 10 and len(d["kit_top5"]) == 5
    assert not r["blocks_equal"] and r["prompts"][0]["blocks_equal"] == 1


def test_the_earliest_stage_names_the_finding():
    vllm, kit = traces()
    s = vllm["decode"][0]["steps"][0]
    s["context_k"][1] += 1.0  # layer 1's K, and downstream everything
    s["base"] += 1.0
    s["logits"] += 1.0
    f = compare(LAYOUT, vllm, kit, KIT, TOL)["finding"]
    assert f.code == "decode-context-k" and "draft layer 1" in f.message
    vllm, kit = traces()
    vllm["decode"][0]["steps"][0]["input_ids"] = [7, 6, 6]
    assert compare(LAYOUT, vllm, kit, KIT, TOL)["finding"].code == "decode-mask-token"
    vllm, kit = traces()
    vllm["decode"][0]["steps"][0]["confidence"][1] = 0.9
    assert compare(LAYOUT, vllm, kit, KIT, TOL)["finding"].code == "decode-confidence"


def test_the_other_block_layout_is_named_before_any_block():
    vllm, kit = traces()
    f = compare({**LAYOUT, "sample_from_anchor": False, "num_query_per_req": K + 1}, vllm, kit, KIT, TOL)["finding"]
    assert f.code == "decode-anchor" and "sample_from_anchor=False" in f.message
    # a bonus-anchor draft (K + 1 query tokens) drafted so by both holds
    both = compare({**LAYOUT, "sample_from_anchor": False, "num_query_per_req": K + 1}, vllm, kit,
                   Layout(False, K + 1), TOL)
    assert both["finding"] is None
