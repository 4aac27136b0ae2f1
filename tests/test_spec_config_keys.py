"""The planned --speculative-config, built for every surveyed release, uses only keys that release's
SpeculativeConfig takes (vLLM's config classes refuse others at start-up; the key sets are read
from each release's source by `make compat`). serve.draft_topk -> dspark_draft_topk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from plan_helpers import plan_vllm

from dspark_kit.compat import engine_table
from dspark_kit.engines.vllm import refused_spec_keys
from dspark_kit.recipe import recipe_from_dict
from dspark_kit.resolved import ResolveError

SURVEYED = [(e, f.version) for e in engine_table.ENGINES for f in engine_table.rows(e)]
SERVING = [(e, v) for e, v in SURVEYED if engine_table.serves(engine_table.lookup(e, v).features, True)]


def recipe(**serve):
    return recipe_from_dict({
        "train": {"device": "cuda"},
        "verifier": {"path": "/models/Qwen3-8B", "num_hidden_layers": 36},
        "draft": {"block_size": 8, "draft_vocab_size": 32000},
        "hidden_states": {"target_layer_ids": [1, 12, 23, 34]},
        "serve": {"engine": "vllm", "adaptive_verification": "auto", **serve},
    })


def spec_config(plan) -> dict:
    return json.loads(plan.argv[plan.argv.index("--speculative-config") + 1])


@pytest.mark.parametrize("engine,version", SERVING)
def test_every_planned_key_is_one_the_release_takes(tmp_path: Path, engine, version):
    features = engine_table.lookup(engine, version).features
    assert features.spec_keys, f"{engine} {version}: the survey read no SpeculativeConfig keys"
    topk = 4 if features.draft_topk else None
    plan = plan_vllm(recipe(draft_topk=topk), "spec", engine=engine, checkpoint=tmp_path,
                     installed_versions={engine: version})
    spec = spec_config(plan)
    assert set(spec) <= set(features.spec_keys), set(spec) - set(features.spec_keys)
    assert spec["num_speculative_tokens"] == 8  # explicit on every release (0.34.0 would default it)
    assert spec.get("dspark_draft_topk") == topk
    if engine == "vllm" and features.adaptive:
        assert spec["enable_adaptive_verification"] is True


@pytest.mark.parametrize("engine,version", [(e, v) for e, v in SERVING
                                            if not engine_table.lookup(e, v).features.draft_topk])
def test_draft_topk_is_refused_in_one_line_where_the_release_lacks_it(tmp_path: Path, engine, version):
    with pytest.raises(ResolveError, match="dspark_draft_topk") as e:
        plan_vllm(recipe(draft_topk=4), "spec", engine=engine, checkpoint=tmp_path,
                  installed_versions={engine: version})
    assert "\n" not in str(e.value) and "serve.draft_topk" in str(e.value)


def test_draft_topk_is_range_checked_against_the_draft_vocabulary(tmp_path: Path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"draft_vocab_size": 1000, "block_size": 8,
                                                  "sample_from_anchor": True}))
    ok = plan_vllm(recipe(draft_topk=1000), "spec", checkpoint=ckpt, installed_versions={"vllm": "0.34.0"})
    assert spec_config(ok)["dspark_draft_topk"] == 1000
    with pytest.raises(ResolveError, match=r"outside 1\.\.1000 \(the draft vocabulary, the checkpoint's "
                                           r"draft_vocab_size\)"):
        plan_vllm(recipe(draft_topk=1001), "spec", checkpoint=ckpt, installed_versions={"vllm": "0.34.0"})
    # before training: the recipe's draft vocabulary
    with pytest.raises(ResolveError, match=r"outside 1\.\.32000 \(the draft vocabulary, draft.draft_vocab_size\)"):
        plan_vllm(recipe(draft_topk=40000), "spec", checkpoint=tmp_path / "none", installed_versions={"vllm": "0.34.0"})


def test_draft_topk_without_an_installed_engine_names_the_release_it_needs(tmp_path: Path):
    plan = plan_vllm(recipe(draft_topk=4), "spec", checkpoint=tmp_path, installed_versions={})
    assert spec_config(plan)["dspark_draft_topk"] == 4
    first = engine_table.first_serving("vllm", feature="draft_topk")
    assert any(f"vllm >= {first}" in d for d in plan.decisions)
    with pytest.raises(ResolveError, match="no surveyed vllm-ascend release"):
        plan_vllm(recipe(draft_topk=4), "spec", engine="vllm-ascend", checkpoint=tmp_path, installed_versions={})


def test_unset_draft_topk_sends_no_key(tmp_path: Path):
    plan = plan_vllm(recipe(), "spec", checkpoint=tmp_path, installed_versions={"vllm": "0.34.0"})
    assert "dspark_draft_topk" not in spec_config(plan)


def test_a_key_the_release_lacks_is_a_plan_error(tmp_path: Path):
    features = engine_table.lookup("vllm", "0.34.0").features
    assert refused_spec_keys({"method": "dspark", "disable_padded_drafter_batch": True}, features) == [
        "disable_padded_drafter_batch"]
    assert refused_spec_keys({"method": "dspark", "disable_padded_drafter_batch": True},
                             engine_table.lookup("vllm", "0.33.0").features) == []
    assert refused_spec_keys({"anything": 1}, None) == []  # release unknown: nothing to judge against
