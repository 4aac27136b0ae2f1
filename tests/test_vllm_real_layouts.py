"""vLLM's own loader (its CPU build) reads a trained checkpoint and its `dspark-kit export` (DSpark's
own layout) to the same parameters, the same verifier layers, the anchor layout it was trained in
and the KV lookahead that layout needs (num_lookahead_tokens = K with the anchor sampled); and
`import` gives the checkpoint back bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import TINY_RECIPE

from dspark_kit.engines import vllm_contract
from dspark_kit.recipe import load_recipe
from dspark_kit.resolved import Resolved
from dspark_kit.specdec.checkpoints import resolve_checkpoint
from dspark_kit.specdec.draft_layouts import export_draft, import_draft

pytestmark = [pytest.mark.vllm_real, pytest.mark.slow, pytest.mark.usefixtures("vllm_cpu_build")]


def test_vllm_reads_the_export_like_the_checkpoint(trained_run: Path, tmp_path: Path):
    res = Resolved(load_recipe(TINY_RECIPE, []), trained_run)
    ckpt = resolve_checkpoint(res.run.checkpoints)
    exported = tmp_path / "dspark_tiny_block"  # "dspark" in the path, as released drafts are named
    export_draft(ckpt, exported)
    import_draft(exported, tmp_path / "back", verifier=res.verifier_path)
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "back" / name).read_bytes() == (ckpt / name).read_bytes(), name

    k = res.k.value
    report = vllm_contract.run_probe(res.verifier_path, [(ckpt, k), (exported, k)])
    original, native = report["results"]
    for r in (original, native):
        assert "failed" not in r, r.get("failed")
        assert r["load_weights"]["missing"] == []
        assert r["engine_config"]["sample_from_anchor"] is True  # as trained
        assert r["engine_config"]["num_lookahead_tokens"] == k  # the anchor is the first of K positions
    assert native["load_weights"]["parameters_sha256"] == original["load_weights"]["parameters_sha256"]
    assert native["engine_config"]["aux_layers"] == original["engine_config"]["aux_layers"]
    assert native["config"]["architectures"] == original["config"]["architectures"] == ["Qwen3DSparkModel"]
