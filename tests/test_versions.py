from pathlib import Path

import pytest

from dspark_kit.compat import versions


def test_installed_reads_metadata_and_aliases():
    import transformers

    assert versions.installed("transformers") == transformers.__version__
    # vllm / vllm-ascend / torch_npu cannot be installed in this environment
    assert versions.installed("vllm") is None
    assert versions.installed("vllm_ascend") is None
    assert versions.installed("torch_npu") is None
    with pytest.raises(ValueError, match="unknown package"):
        versions.installed("numpyy")


@pytest.mark.parametrize("version,minimum,expected", [
    ("0.24.0rc1", "0.24.0rc1", True),
    ("0.24.0rc2", "0.24.0rc1", True),
    ("0.24.0", "0.24.0rc1", True),
    ("0.23.1rc1.dev752", "0.24.0rc1", False),  # the reference run's vLLM
    ("0.24.0rc1", "0.24", False),  # a release candidate is not the release
    ("0.24.0.dev5+g1f486d9", "0.24", False),
    ("0.24.1+cu130", "0.24", True),  # local build tags do not matter
    ("0.9.1", "0.24", False),  # numeric, not string, order
    (None, "0.24", False),
    ("not-a-version", "0.24", False),
])
def test_at_least(version, minimum, expected):
    assert versions.at_least(version, minimum) is expected


def test_dspark_gates():
    assert versions.dspark_gate("vllm", "0.24.0").ok is True
    assert versions.dspark_gate("vllm", "0.23.1").ok is False
    assert "vllm>=0.24" in versions.dspark_gate("vllm", "0.23.1").message
    assert versions.dspark_gate("vllm-ascend", "0.24.0rc1").ok is True
    assert versions.dspark_gate("vllm-ascend", "0.23.0").ok is False
    assert versions.dspark_gate("vllm", None).ok is None


PRE_14596 = '''
        self.draft_window_size = (
            self.vllm_config.additional_config.get("draft_window_size") if self.vllm_config.additional_config else None
        )
        if self.draft_window_size is not None:
            future_offset = 0 if self.method == "dflash" else self.num_speculative_tokens
'''
WITH_14596 = PRE_14596.replace('self.method == "dflash"', 'self.method in ("dflash", "dspark")') + '''
        if self.draft_window_size is not None and self.method != "dspark":
            self.sliding_window.apply(common_attn_metadata)
'''


def test_window_support_from_source():
    assert versions.window_support_from_source(WITH_14596) == "yes"
    assert versions.window_support_from_source(PRE_14596) == "no"
    assert versions.window_support_from_source("def propose(self): pass") == "no"


def test_ascend_window_support_reads_installed_tree(tmp_path: Path):
    assert versions.ascend_dspark_window_support() == "unknown"  # not installed here
    src = tmp_path / versions.ASCEND_PROPOSER
    src.parent.mkdir(parents=True)
    src.write_text(WITH_14596)
    assert versions.ascend_dspark_window_support(tmp_path) == "yes"
    src.write_text(PRE_14596)
    assert versions.ascend_dspark_window_support(tmp_path) == "no"
    src.unlink()  # an old tree without the proposer has no window
    assert versions.ascend_dspark_window_support(tmp_path) == "no"


def test_k_rule_by_engine_and_version():
    block = 8
    ascend = versions.k_rule("vllm-ascend", "0.24.0rc1")
    assert ascend.allowed(7, block) and ascend.allowed(8, block) and not ascend.allowed(9, block)
    assert ascend.choose(7, block) == (7, None)  # the reference run's K=7 for block 8

    guarded = versions.k_rule("vllm", "0.26.0")
    assert not guarded.allowed(7, block) and guarded.allowed(8, block)
    k, note = guarded.choose(7, block)
    assert k == 8 and "47419" in note

    for v in ("0.24.0", "0.25.2", "0.27.1"):
        rule = versions.k_rule("vllm", v)
        assert rule.allowed(1, block) and rule.allowed(7, block) and not rule.allowed(9, block), v

    assert not versions.k_rule("vllm", "0.23.1").allowed(7, block)

    unknown = versions.k_rule("vllm", None)
    assert unknown.known is False
    k, note = unknown.choose(7, block)
    assert k == 7 and "unknown" in note
