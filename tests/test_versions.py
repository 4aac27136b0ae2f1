
import pytest

from dspark_kit.compat import engine_table, versions


def test_installed_reads_metadata_and_aliases():
    import transformers

    assert versions.installed("transformers") == transformers.__version__
    # vllm / vllm-ascend / torch_npu cannot be installed in this environment
    assert versions.installed("vllm") is None
    assert versions.installed("vllm_ascend") is None
    assert versions.installed("torch_npu") is None
    with pytest.raises(ValueError, match="unknown package"):
        versions.installed("numpyy")


def dspark_gate(engine: str, version: str | None,
                sample_from_anchor: bool | None = engine_table.KIT_SAMPLE_FROM_ANCHOR) -> versions.Gate:
    """Does this engine version serve a DSpark checkpoint with this anchor layout?"""
    return versions.engine_support(engine, version).serves(sample_from_anchor)


def test_dspark_gates_come_from_the_table():
    # docs/COMPAT.md: 0.24.0 has no DSpark, 0.25.0-0.26.0 rewrite to the bonus anchor, 0.27.0 serves
    assert dspark_gate("vllm", "0.24.0").ok is False
    assert dspark_gate("vllm", "0.26.0").ok is False
    assert dspark_gate("vllm", "0.27.0").ok is True
    assert dspark_gate("vllm", "0.33.0+cu130").ok is True  # local tags do not matter
    assert "vllm>=0.27.0" in dspark_gate("vllm", "0.23.1").message
    assert dspark_gate("vllm-ascend", "0.24.0rc1").ok is False  # paired with vLLM 0.24.0
    assert dspark_gate("vllm-ascend", "0.25.1rc1").ok is False
    assert dspark_gate("vllm-ascend", "0.26.0rc1").ok is True  # backports vLLM PR 48639
    assert dspark_gate("vllm", None).ok is None
    # a checkpoint trained in a layout nobody knows (no sample_from_anchor): no release serves it, the
    # fix is the trained value (never a loader's default), on the installed release or none at all
    for version in ("0.30.0", None):
        missing = dspark_gate("vllm", version, sample_from_anchor=None)
        assert missing.ok is False and "add the trained value" in missing.message
    # a bonus-anchor checkpoint (explicit false) is what 0.25-0.26 serve
    assert dspark_gate("vllm", "0.25.1", sample_from_anchor=False).ok is True


def test_versions_between_and_beyond_the_surveyed_releases():
    newer = versions.engine_support("vllm", "0.40.0")
    assert newer.serves().ok is True and "assumed like it" in newer.source
    between = versions.engine_support("vllm", "0.27.5")  # 0.27.1 and 0.28.0 agree on serving
    assert between.serves().ok is True and between.has("adaptive") == "unknown"
    assert versions.engine_support("vllm", "0.25.5").serves().ok is False  # both neighbours rewrite


def test_no_surveyed_release_has_a_k_rule_of_its_own():
    """Every K in 1..slots is served by every release (the kit's one K rule is
    checkpoints.ks_outside_slots); a guard on a key the loader passes on would be one."""
    for engine in ("vllm", "vllm-ascend"):
        for f in engine_table.rows(engine):
            assert versions.k_rule(versions.engine_support(engine, f.version)) is None, (engine, f.version)
    import dataclasses

    guarded = versions.engine_support("vllm", "0.26.0")
    passed_on = dataclasses.replace(guarded.features, config_keys=(*guarded.features.config_keys, "dspark_block_size"))
    rule = versions.k_rule(dataclasses.replace(guarded, features=passed_on))
    assert rule.choose(7, 8) == (8, "num_speculative_tokens 7 -> 8: vllm 0.26.0 refuses K < dspark_block_size for DSpark")
